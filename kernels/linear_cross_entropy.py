"""The LM head and its cross-entropy fused by chunking over tokens, so the (N, V) logits never exist.

For N tokens, a vocabulary of V and hidden size D, eager PyTorch keeps the (N, V) logits, an fp32 copy and
log_softmax's output alive at once: at 8k tokens × 50k vocab that is gigabytes, far more than the model's
activations. Here the tokens are processed a chunk of rows at a time: logits_chunk = hidden_chunk @ weightᵀ
(a torch matmul in the input dtype), then the cross-entropy kernel turns that chunk into its loss and, in the
same launch, overwrites it with d loss / d logits. The chunk's contributions are taken at once, still in the
forward: grad_hidden_chunk = dlogits @ weight and grad_weight += dlogitsᵀ @ hidden_chunk. After the last chunk
only the two gradients (the size of hidden and of weight) are kept, and backward merely multiplies them by the
upstream scalar (Liger-Kernel's fused linear cross-entropy does the same): nothing is recomputed.

"mean" divides by the number of non-ignored tokens over all of N, counted before the first chunk, so every
chunk's gradient carries the global 1/count. "none" cannot use the trick: its upstream gradient differs per
token, and grad_weight sums over tokens, so the forward only computes losses and backward runs the chunks again
with each row's upstream gradient folded into the kernel's scale.

Chunk size: rows are split into equal chunks of about 4·D rows, rounded up to a multiple of 256, so a logits
chunk holds about 4·V·D elements, four times the LM head itself, however many tokens there are. The bound
trades memory against the cost of chunking: each chunk reads the weight twice and reads and writes grad_weight
(about 4·V·D elements of traffic) against about six passes over its own chunk·V logits (written by the matmul,
read twice and written by the kernel, read by the two gradient matmuls); at 4·D rows the weight traffic is a
sixth of the logits'. Smaller chunks make it dominate (Liger's default, chunk·V ≈ N·D, gives 128-row chunks at
8k × 50k × 768, 64 of them), and a matmul with 4·D ≥ 2048 rows (D ≥ 512) is in cuBLAS's efficient range. For
8k tokens, a 50k vocabulary and D = 768 this is chunks of 2816, 2816 and 2560 rows (283 MB of bf16 logits
each, in one buffer reused by every chunk) instead of all 8192 rows.

Alignment: cuBLAS takes its fast (sm90) GEMMs only when every operand's leading dimension is a multiple of 16
bytes. The model pads its vocabulary to a multiple of 64 rows, so the op works on the whole padded weight and
is told how many of its rows are classes (`vocab_size`): the logits rows keep the padded width (50,304 for
GPT-2's 50,257 + 3), the kernel leaves the padding columns out of the softmax and writes them a gradient of 0,
and the padding rows' weight gradient is 0. Slicing the padding off instead (50,260 columns, 100,520 bytes a
bf16 row) sent the H200's head GEMMs to sm80 CUTLASS `align2` kernels at ~5.2 ms each per step (2026-11-27).
Chunks start at multiples of 256 rows, so every chunk's rows start aligned too.

grad_weight accumulates in fp32 for 16-bit weights (each chunk's product is added to an fp32 buffer) and is
rounded to the weight's dtype once, after the last chunk.

Layering: the cross-entropy kernel (kernels/cross_entropy.py) and torch's matmuls; the custom ops
`kiln::linear_cross_entropy` (the chunked forward, gradients included) and `kiln::linear_cross_entropy_backward`
("none"'s second pass), one opaque node each under `torch.compile`; `linear_cross_entropy`, which checks the
arguments, settles the chunk size and which gradients autograd will want, and picks the op or the reference.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
import triton

from kiln.kernels.backend import use_triton
from kiln.kernels.cross_entropy import (
    check_args,
    loss_and_grad_rows,
    loss_dtype,
    needs_grad,
    reduce,
    reduced_loss,
    scaled,
)
from kiln.kernels.cross_entropy import reference as ce_reference

CHUNK_ALIGN = 256  # rows: the default chunk is a multiple of this (a GEMM tile's multiple, and 16-byte aligned)


def default_chunk_size(n_tokens: int, d_model: int) -> int:
    """Equal chunks of about 4·d_model rows rounded up to a multiple of CHUNK_ALIGN, never more rows than there
    are tokens (see the module docstring for why)."""
    n_chunks = max(1, triton.cdiv(n_tokens, 4 * d_model))
    rows = triton.cdiv(triton.cdiv(n_tokens, n_chunks), CHUNK_ALIGN) * CHUNK_ALIGN
    return max(1, min(rows, n_tokens))


def _check(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, reduction: str,
           chunk_size: int | None, vocab_size: int, softcap: float) -> None:
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"linear_cross_entropy: hidden (N, D) and weight (V, D) expected, got "
                         f"{tuple(hidden.shape)} and {tuple(weight.shape)}")
    if hidden.dtype != weight.dtype:
        raise ValueError(f"linear_cross_entropy: hidden is {hidden.dtype} but weight is {weight.dtype}; cast one "
                         "(e.g. weight.to(hidden.dtype), which autograd differentiates)")
    check_args(targets, hidden.shape[0], reduction)
    if chunk_size is not None and chunk_size < 1:
        raise ValueError(f"linear_cross_entropy: chunk_size must be a positive number of tokens, got {chunk_size}")
    if not 1 <= vocab_size <= weight.shape[0]:
        raise ValueError(f"linear_cross_entropy: vocab_size must be 1..{weight.shape[0]} (weight's rows), "
                         f"got {vocab_size}")
    if not (softcap >= 0 and math.isfinite(softcap)):
        raise ValueError(f"linear_cross_entropy: softcap must be a finite number >= 0 (0: off), got {softcap}")


def _chunked_pass(hidden, weight, targets, vocab_size, ignore_index, z_loss, softcap, row_scale, chunk_size,
                  want_dhidden, want_dweight):
    """Loss per token (fp32) and, if asked, grad_hidden and grad_weight with row_scale folded in, one chunk of
    tokens at a time. One logits buffer serves every chunk, and becomes each chunk's gradient in place."""
    n = hidden.shape[0]
    loss = torch.empty(n, dtype=torch.float32, device=hidden.device)
    dhidden = torch.empty_like(hidden) if want_dhidden else None
    # fp32 (or fp64) whatever the weight's dtype: one rounding at the end, not one per chunk.
    dweight = torch.empty(weight.shape, dtype=loss_dtype(weight.dtype), device=weight.device) if want_dweight \
        else None
    if dweight is not None and n == 0:
        dweight.zero_()
    buffer = hidden.new_empty(min(chunk_size, n), weight.shape[0])
    # Under the model's autocast the matmuls would change dtype under the out= buffers; the caller's dtypes rule.
    with torch.autocast(hidden.device.type, enabled=False):
        for start in range(0, n, chunk_size):
            rows = slice(start, start + chunk_size)
            h = hidden[rows]
            logits = torch.mm(h, weight.T, out=buffer[:h.shape[0]])
            scale = row_scale[rows] if row_scale.dim() else row_scale
            grad = logits if (want_dhidden or want_dweight) else None
            loss_and_grad_rows(logits, targets[rows], loss[rows], grad, ignore_index, z_loss, scale, vocab_size,
                               softcap)
            if dhidden is not None:
                torch.mm(logits, weight, out=dhidden[rows])
            if dweight is not None:
                # the first chunk writes the buffer over (its uninitialised contents are never read)
                accumulate(dweight, logits.T, h, first=start == 0)
    return loss, dhidden, None if dweight is None else dweight.to(weight.dtype)


def accumulate(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, first: bool) -> None:
    """out = a @ b (first) or out += a @ b, summed in out's dtype. For 16-bit a and b into fp32 out, CUDA has
    one GEMM that writes fp32 (out_dtype, torch >= 2.8); elsewhere (the CPU's interpreter tests) each product
    is rounded to a and b's dtype once before the fp32 sum."""
    if a.dtype == out.dtype:
        out.addmm_(a, b, beta=0.0 if first else 1.0)
    elif out.is_cuda and first:
        torch.mm(a, b, out_dtype=out.dtype, out=out)
    elif out.is_cuda:
        torch.addmm(out, a, b, out_dtype=out.dtype, out=out)
    elif first:
        out.copy_(a @ b)
    else:
        out.add_(a @ b)


def _empty(like: torch.Tensor, wanted: bool) -> torch.Tensor:
    return like.new_empty(like.shape if wanted else (0,))


@torch.library.custom_op("kiln::linear_cross_entropy", mutates_args=())
def linear_cross_entropy_op(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, vocab_size: int,
                            ignore_index: int, z_loss: float, softcap: float, reduction: str, chunk_size: int,
                            grad_hidden: bool, grad_weight: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(the loss reduced as asked; d loss / d hidden and d loss / d weight for an upstream gradient of 1, each
    only when asked and the reduction is not "none", else an empty tensor)."""
    hidden, weight, targets = hidden.contiguous(), weight.contiguous(), targets.contiguous()
    n_valid = (targets != ignore_index).sum()
    one = torch.ones((), device=hidden.device)
    if reduction == "none":
        grad_hidden = grad_weight = False  # the backward op runs the chunks again with each row's own scale
    scale = 1.0 / n_valid if reduction == "mean" else one
    loss, dh, dw = _chunked_pass(hidden, weight, targets, vocab_size, ignore_index, z_loss, softcap, scale,
                                 chunk_size, grad_hidden, grad_weight)
    return (reduce(loss, n_valid, reduction, loss_dtype(hidden.dtype)),
            hidden.new_empty(0) if dh is None else dh, weight.new_empty(0) if dw is None else dw)


@linear_cross_entropy_op.register_fake
def _(hidden, weight, targets, vocab_size, ignore_index, z_loss, softcap, reduction, chunk_size, grad_hidden,
      grad_weight):
    chunked = reduction != "none"
    return (reduced_loss(hidden, hidden.shape[0], reduction), _empty(hidden, chunked and grad_hidden),
            _empty(weight, chunked and grad_weight))


@torch.library.custom_op("kiln::linear_cross_entropy_backward", mutates_args=())
def linear_cross_entropy_backward_op(grad_out: torch.Tensor, hidden: torch.Tensor, weight: torch.Tensor,
                                     targets: torch.Tensor, vocab_size: int, ignore_index: int, z_loss: float,
                                     softcap: float, chunk_size: int, grad_hidden: bool,
                                     grad_weight: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """reduction="none"'s gradients: the chunks again, each row's upstream gradient folded into the kernel's
    scale (empty where not asked)."""
    hidden, weight, targets = hidden.contiguous(), weight.contiguous(), targets.contiguous()
    _, dh, dw = _chunked_pass(hidden, weight, targets, vocab_size, ignore_index, z_loss, softcap, grad_out,
                              chunk_size, grad_hidden, grad_weight)
    return hidden.new_empty(0) if dh is None else dh, weight.new_empty(0) if dw is None else dw


@linear_cross_entropy_backward_op.register_fake
def _(grad_out, hidden, weight, targets, vocab_size, ignore_index, z_loss, softcap, chunk_size, grad_hidden,
      grad_weight):
    return _empty(hidden, grad_hidden), _empty(weight, grad_weight)


def _setup_context(ctx, inputs, output):
    (hidden, weight, targets, vocab_size, ignore_index, z_loss, softcap, reduction, chunk_size, grad_hidden,
     grad_weight) = inputs
    ctx.reduction = reduction
    # the backward op's, after the tensors
    ctx.args = (vocab_size, ignore_index, z_loss, softcap, chunk_size, grad_hidden, grad_weight)
    if reduction == "none":
        ctx.save_for_backward(hidden, weight, targets)
    else:
        ctx.save_for_backward(output[1], output[2])


def _backward(ctx, grad_out, _dh, _dw):
    if ctx.reduction == "none":
        dh, dw = linear_cross_entropy_backward_op(grad_out, *ctx.saved_tensors, *ctx.args)
    else:
        dh, dw = (scaled(g, grad_out) for g in ctx.saved_tensors)
    grad_hidden, grad_weight = ctx.args[5:]
    return dh if grad_hidden else None, dw if grad_weight else None, *[None] * 9


linear_cross_entropy_op.register_autograd(_backward, setup_context=_setup_context)


def reference(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100,
              z_loss: float = 0.0, reduction: str = "mean", vocab_size: int | None = None,
              softcap: float = 0.0) -> torch.Tensor:
    """The full logits F.linear(hidden, weight[:vocab_size]) (capped to softcap·tanh(logits / softcap) in at least
    fp32 if softcap > 0), then the plain cross-entropy reference."""
    logits = F.linear(hidden, weight[:vocab_size])
    if softcap:
        logits = softcap * torch.tanh(logits.to(loss_dtype(logits.dtype)) / softcap)
    return ce_reference(logits, targets, ignore_index, z_loss, reduction)


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100,
                         z_loss: float = 0.0, reduction: str = "mean", chunk_size: int | None = None,
                         backend: str = "auto", vocab_size: int | None = None, softcap: float = 0.0) -> torch.Tensor:
    """Cross-entropy of hidden (N, D) @ weight (V, D)ᵀ against (N,) int64 targets, plus z_loss·lse² per
    non-ignored token, without materialising the (N, V) logits on the Triton path.

    reduction: "mean" over non-ignored tokens, "sum", or "none" ((N,), 0 on ignored tokens). chunk_size: tokens
    per chunk (default: equal chunks of about 4·D rows, a multiple of 256). vocab_size: how many of weight's
    rows are classes (default all); the rows after them pad the vocabulary, are never scored, and get gradient
    0 (pass the model's padded weight whole: its aligned rows keep the GEMMs fast). softcap > 0: the loss of the
    capped logits softcap·tanh(logits / softcap) (Gemma 2's final softcapping), capped inside the kernel. The torch
    backend is the plain reference.
    """
    if not use_triton(backend, hidden, weight):
        return reference(hidden, weight, targets, ignore_index, z_loss, reduction, vocab_size, softcap)
    vocab_size = weight.shape[0] if vocab_size is None else vocab_size
    _check(hidden, weight, targets, reduction, chunk_size, vocab_size, softcap)
    chunk_size = chunk_size if chunk_size is not None else default_chunk_size(hidden.shape[0], hidden.shape[1])
    return linear_cross_entropy_op(hidden, weight, targets, vocab_size, ignore_index, z_loss, float(softcap),
                                   reduction, chunk_size, *needs_grad(hidden, weight))[0]
