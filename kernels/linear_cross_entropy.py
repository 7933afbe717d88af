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

Chunk size: rows are split into equal chunks of at most 4·D rows, so a logits chunk holds at most 4·V·D
elements, four times the LM head itself, however many tokens there are. The bound trades memory against the
cost of chunking: each chunk reads the weight twice and reads and writes grad_weight (about 4·V·D elements of
traffic) against about six passes over its own chunk·V logits (written by the matmul, read twice and written
by the kernel, read by the two gradient matmuls); at 4·D rows the weight traffic is a sixth of the logits'.
Smaller chunks make it dominate (Liger's default, chunk·V ≈ N·D, gives 128-row chunks at 8k × 50k × 768, 64 of
them), and a matmul with 4·D ≥ 2048 rows (D ≥ 512) is in cuBLAS's efficient range. For 8k tokens, a 50k
vocabulary and D = 768 this is 3 chunks of 2731 rows (275 MB of bf16 logits each) instead of all 8192 rows.
grad_weight accumulates in the weight's dtype (each chunk's product is summed in fp32 inside the matmul and
rounded once when added), so bf16 pays one rounding per chunk; few, large chunks keep that small.

Layering: the cross-entropy kernel (kernels/cross_entropy.py) and torch's matmuls; the custom ops
`kiln::linear_cross_entropy` (the chunked forward, gradients included) and `kiln::linear_cross_entropy_backward`
("none"'s second pass), one opaque node each under `torch.compile`; `linear_cross_entropy`, which checks the
arguments, settles the chunk size and which gradients autograd will want, and picks the op or the reference.
"""

from __future__ import annotations

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


def default_chunk_size(n_tokens: int, d_model: int) -> int:
    """Equal chunks of at most 4·d_model rows (see the module docstring for why)."""
    n_chunks = max(1, triton.cdiv(n_tokens, 4 * d_model))
    return max(1, triton.cdiv(n_tokens, n_chunks))


def _check(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, reduction: str,
           chunk_size: int | None) -> None:
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"linear_cross_entropy: hidden (N, D) and weight (V, D) expected, got "
                         f"{tuple(hidden.shape)} and {tuple(weight.shape)}")
    if hidden.dtype != weight.dtype:
        raise ValueError(f"linear_cross_entropy: hidden is {hidden.dtype} but weight is {weight.dtype}; cast one "
                         "(e.g. weight.to(hidden.dtype), which autograd differentiates)")
    check_args(targets, hidden.shape[0], reduction)
    if chunk_size is not None and chunk_size < 1:
        raise ValueError(f"linear_cross_entropy: chunk_size must be a positive number of tokens, got {chunk_size}")


def _chunked_pass(hidden, weight, targets, ignore_index, z_loss, row_scale, chunk_size, want_dhidden, want_dweight):
    """Loss per token (fp32) and, if asked, grad_hidden and grad_weight with row_scale folded in, one chunk of
    tokens at a time. Each chunk's logits buffer becomes its gradient in place and is dropped after use."""
    n = hidden.shape[0]
    loss = torch.empty(n, dtype=torch.float32, device=hidden.device)
    dhidden = torch.empty_like(hidden) if want_dhidden else None
    dweight = torch.empty_like(weight) if want_dweight else None
    if dweight is not None and n == 0:
        dweight.zero_()
    # Under the model's autocast the matmuls would change dtype under the out= buffers; the caller's dtypes rule.
    with torch.autocast(hidden.device.type, enabled=False):
        for start in range(0, n, chunk_size):
            rows = slice(start, start + chunk_size)
            h = hidden[rows]
            logits = h @ weight.T
            scale = row_scale[rows] if row_scale.dim() else row_scale
            grad = logits if (want_dhidden or want_dweight) else None
            loss_and_grad_rows(logits, targets[rows], loss[rows], grad, ignore_index, z_loss, scale)
            if dhidden is not None:
                torch.mm(logits, weight, out=dhidden[rows])
            if dweight is not None:
                # beta=0 on the first chunk overwrites the uninitialised buffer (NaNs in it are ignored).
                dweight.addmm_(logits.T, h, beta=0.0 if start == 0 else 1.0)
    return loss, dhidden, dweight


def _empty(like: torch.Tensor, wanted: bool) -> torch.Tensor:
    return like.new_empty(like.shape if wanted else (0,))


@torch.library.custom_op("kiln::linear_cross_entropy", mutates_args=())
def linear_cross_entropy_op(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, ignore_index: int,
                            z_loss: float, reduction: str, chunk_size: int, grad_hidden: bool,
                            grad_weight: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(the loss reduced as asked; d loss / d hidden and d loss / d weight for an upstream gradient of 1, each
    only when asked and the reduction is not "none", else an empty tensor)."""
    hidden, weight, targets = hidden.contiguous(), weight.contiguous(), targets.contiguous()
    n_valid = (targets != ignore_index).sum()
    one = torch.ones((), device=hidden.device)
    if reduction == "none":
        grad_hidden = grad_weight = False  # the backward op runs the chunks again with each row's own scale
    scale = 1.0 / n_valid if reduction == "mean" else one
    loss, dh, dw = _chunked_pass(hidden, weight, targets, ignore_index, z_loss, scale, chunk_size, grad_hidden,
                                 grad_weight)
    return (reduce(loss, n_valid, reduction, loss_dtype(hidden.dtype)),
            hidden.new_empty(0) if dh is None else dh, weight.new_empty(0) if dw is None else dw)


@linear_cross_entropy_op.register_fake
def _(hidden, weight, targets, ignore_index, z_loss, reduction, chunk_size, grad_hidden, grad_weight):
    chunked = reduction != "none"
    return (reduced_loss(hidden, hidden.shape[0], reduction), _empty(hidden, chunked and grad_hidden),
            _empty(weight, chunked and grad_weight))


@torch.library.custom_op("kiln::linear_cross_entropy_backward", mutates_args=())
def linear_cross_entropy_backward_op(grad_out: torch.Tensor, hidden: torch.Tensor, weight: torch.Tensor,
                                     targets: torch.Tensor, ignore_index: int, z_loss: float, chunk_size: int,
                                     grad_hidden: bool, grad_weight: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """reduction="none"'s gradients: the chunks again, each row's upstream gradient folded into the kernel's
    scale (empty where not asked)."""
    hidden, weight, targets = hidden.contiguous(), weight.contiguous(), targets.contiguous()
    _, dh, dw = _chunked_pass(hidden, weight, targets, ignore_index, z_loss, grad_out, chunk_size, grad_hidden,
                              grad_weight)
    return hidden.new_empty(0) if dh is None else dh, weight.new_empty(0) if dw is None else dw


@linear_cross_entropy_backward_op.register_fake
def _(grad_out, hidden, weight, targets, ignore_index, z_loss, chunk_size, grad_hidden, grad_weight):
    return _empty(hidden, grad_hidden), _empty(weight, grad_weight)


def _setup_context(ctx, inputs, output):
    hidden, weight, targets, ignore_index, z_loss, reduction, chunk_size, grad_hidden, grad_weight = inputs
    ctx.reduction = reduction
    ctx.args = (ignore_index, z_loss, chunk_size, grad_hidden, grad_weight)  # the backward op's, after the tensors
    if reduction == "none":
        ctx.save_for_backward(hidden, weight, targets)
    else:
        ctx.save_for_backward(output[1], output[2])


def _backward(ctx, grad_out, _dh, _dw):
    if ctx.reduction == "none":
        dh, dw = linear_cross_entropy_backward_op(grad_out, *ctx.saved_tensors, *ctx.args)
    else:
        dh, dw = (scaled(g, grad_out) for g in ctx.saved_tensors)
    grad_hidden, grad_weight = ctx.args[3:]
    return dh if grad_hidden else None, dw if grad_weight else None, None, None, None, None, None, None, None


linear_cross_entropy_op.register_autograd(_backward, setup_context=_setup_context)


def reference(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100,
              z_loss: float = 0.0, reduction: str = "mean") -> torch.Tensor:
    """The full logits F.linear(hidden, weight), then the plain cross-entropy reference."""
    return ce_reference(F.linear(hidden, weight), targets, ignore_index, z_loss, reduction)


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100,
                         z_loss: float = 0.0, reduction: str = "mean", chunk_size: int | None = None,
                         backend: str = "auto") -> torch.Tensor:
    """Cross-entropy of hidden (N, D) @ weight (V, D)ᵀ against (N,) int64 targets, plus z_loss·lse² per
    non-ignored token, without materialising the (N, V) logits on the Triton path.

    reduction: "mean" over non-ignored tokens, "sum", or "none" ((N,), 0 on ignored tokens). chunk_size: tokens
    per chunk (default: equal chunks of at most 4·D rows). The torch backend is the plain reference.
    """
    if not use_triton(backend, hidden, weight):
        return reference(hidden, weight, targets, ignore_index, z_loss, reduction)
    _check(hidden, weight, targets, reduction, chunk_size)
    chunk_size = chunk_size if chunk_size is not None else default_chunk_size(hidden.shape[0], hidden.shape[1])
    return linear_cross_entropy_op(hidden, weight, targets, ignore_index, z_loss, reduction, chunk_size,
                                   *needs_grad(hidden, weight))[0]
