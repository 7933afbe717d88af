"""Cross-entropy over a large vocabulary, loss and gradient from one launch, with an optional z-loss.

Eager PyTorch materialises log_softmax (an fp32 copy of the (N, V) logits for bf16 inputs), keeps it for
backward, and then writes the gradient in a second pass: several full passes and one or two extra (N, V)
tensors. Here one program owns one row and walks it in blocks twice. The first walk is an online
log-sum-exp (running max and rescaled sum, in fp32 whatever the storage dtype), so a 128k-entry row never has
to fit in registers. With lse known, the loss of the row is lse − x[target] + z_loss·lse², and the second walk
writes d loss / d logits = softmax·(1 + 2·z_loss·lse) − onehot(target), already multiplied by the reduction's
scale (1/valid rows for "mean"). On a GPU the second read of a row should mostly hit L2 (a row is at most a
few hundred kB and only the rows in flight compete for it); that is expected, not yet measured.

Because the gradient is known in the forward, nothing else is saved: backward is a single multiply of that
stored gradient by the upstream gradient (a scalar for "mean"/"sum", one value per row for "none"), done in
place. The gradient may even be written over the logits themselves (Liger-Kernel's trick), which makes the
loss cost no memory beyond the logits. That destroys the logits, so the public function does it only when the
caller says they are not needed afterwards (`inplace_grad=True`); linear_cross_entropy does so on each of its
private logits chunks. The "mean" divisor is read from device memory, not passed as a Python number, so the
launch never waits for the GPU to count the valid rows.

Rows whose target is ignore_index get loss 0 and gradient 0, as in F.cross_entropy. The loss comes back in
fp32 for bf16/fp16 logits (the model already computes its loss in fp32) and in the logits' dtype otherwise;
the gradient is in the logits' dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kiln.kernels.backend import outside_compile, use_triton

REDUCTIONS = ("mean", "sum", "none")

# Vocabulary entries a program handles per step of its walk along a row: 16 fp32 values a thread at 16 warps,
# enough loads in flight to stream from HBM, few enough to stay in registers. Smaller vocabularies use one
# block of the next power of two.
MAX_BLOCK = 8192
NUM_WARPS = 16

# Elements per program of the backward's elementwise multiply.
SCALE_BLOCK = 4096


@triton.jit
def _cross_entropy_fwd(logits_ptr, grad_ptr, targets_ptr, loss_ptr, scale_ptr, scale_stride, n_cols,
                       ignore_index, z_loss, COMPUTE_GRAD: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    logits_ptr += row * n_cols
    grad_ptr += row * n_cols
    cols = tl.arange(0, BLOCK)
    target = tl.load(targets_ptr + row)

    if target == ignore_index:
        tl.store(loss_ptr + row, 0.0)
        if COMPUTE_GRAD:
            for start in range(0, n_cols, BLOCK):
                offs = start + cols
                tl.store(grad_ptr + offs, tl.zeros([BLOCK], dtype=grad_ptr.dtype.element_ty), mask=offs < n_cols)
        return
    tl.device_assert((target >= 0) & (target < n_cols), "cross_entropy: target out of range")

    # Online log-sum-exp: when a block raises the running max, the sum so far is rescaled to the new max.
    m = float("-inf")
    d = 0.0
    for start in range(0, n_cols, BLOCK):
        offs = start + cols
        x = tl.load(logits_ptr + offs, mask=offs < n_cols, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, axis=0))
        d = d * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), axis=0)
        m = m_new
    lse = m + tl.log(d)
    # Read before the second walk, which may overwrite the logits with the gradient.
    x_target = tl.load(logits_ptr + target).to(tl.float32)
    tl.store(loss_ptr + row, lse - x_target + z_loss * lse * lse)

    if COMPUTE_GRAD:
        scale = tl.load(scale_ptr + row * scale_stride).to(tl.float32)
        # d/dx (z·lse²) = 2·z·lse·softmax(x), so the z-loss only stretches the softmax term.
        softmax_coef = 1.0 + 2.0 * z_loss * lse
        for start in range(0, n_cols, BLOCK):
            offs = start + cols
            mask = offs < n_cols
            x = tl.load(logits_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            g = tl.exp(x - lse) * softmax_coef
            g = tl.where(offs == target, g - 1.0, g) * scale
            tl.store(grad_ptr + offs, g.to(grad_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _scale_rows(x_ptr, scale_ptr, scale_stride, n, n_cols, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    # scale_stride 0 broadcasts one scalar; otherwise each row of the flat (rows, n_cols) array has its own.
    s = tl.load(scale_ptr + (offs // n_cols) * scale_stride, mask=mask, other=0.0).to(tl.float32)
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(x_ptr + offs, (x * s).to(x_ptr.dtype.element_ty), mask=mask)


def _stride(scale: torch.Tensor) -> int:
    return scale.stride(0) if scale.dim() else 0


def loss_and_grad_rows(logits: torch.Tensor, targets: torch.Tensor, loss: torch.Tensor, grad: torch.Tensor | None,
                       ignore_index: int, z_loss: float, row_scale: torch.Tensor) -> None:
    """Launch the forward kernel on contiguous (n, V) logits: the per-row loss into `loss` (fp32, (n,)) and,
    when `grad` is given, d loss_row / d logits · row_scale into it (`grad` may be `logits` itself).
    `row_scale` is a scalar tensor or one value per row (any stride)."""
    n, v = logits.shape
    if n == 0:
        return
    block = min(triton.next_power_of_2(v), MAX_BLOCK)
    _cross_entropy_fwd[(n,)](logits, logits if grad is None else grad, targets, loss, row_scale, _stride(row_scale),
                             v, ignore_index, z_loss, COMPUTE_GRAD=grad is not None, BLOCK=block,
                             num_warps=NUM_WARPS)


def scale_rows_(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x (contiguous, rows first) *= scale in place: a scalar tensor, or one value per row of x (any stride)."""
    n = x.numel()
    if n:
        _scale_rows[(triton.cdiv(n, SCALE_BLOCK),)](x, scale, _stride(scale), n, n // x.shape[0], BLOCK=SCALE_BLOCK,
                                                   num_warps=8)
    # The multiply went through a raw pointer; tell autograd the tensor changed, so that a second backward
    # over the same graph (which would scale it twice) fails loudly instead of returning a wrong gradient.
    torch.autograd.graph.increment_version(x)
    return x


def reduce(loss_rows: torch.Tensor, n_valid: torch.Tensor, reduction: str, dtype: torch.dtype) -> torch.Tensor:
    """The per-row fp32 losses reduced as F.cross_entropy does ("mean": over the non-ignored rows)."""
    if reduction == "mean":
        loss_rows = loss_rows.sum() / n_valid
    elif reduction == "sum":
        loss_rows = loss_rows.sum()
    return loss_rows.to(dtype)


def check_args(targets: torch.Tensor, n: int, reduction: str) -> None:
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction={reduction!r}: expected one of {', '.join(REDUCTIONS)}")
    if targets.shape != (n,) or targets.dtype != torch.int64:
        raise ValueError(f"targets must be int64 of shape ({n},), got {targets.dtype} {tuple(targets.shape)}")


def loss_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


class CrossEntropyFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, ignore_index: int, z_loss: float, reduction: str,
                inplace_grad: bool) -> torch.Tensor:
        if logits.dim() != 2:
            raise ValueError(f"cross_entropy: logits must be (N, V), got {tuple(logits.shape)}")
        check_args(targets, logits.shape[0], reduction)
        logits, targets = logits.contiguous(), targets.contiguous()
        n_valid = (targets != ignore_index).sum()
        grad = None
        if ctx.needs_input_grad[0]:
            grad = logits if inplace_grad else torch.empty_like(logits)
        # "none" leaves every row unscaled: its backward multiplies each row by its own upstream gradient.
        scale = 1.0 / n_valid if reduction == "mean" else torch.ones((), device=logits.device)
        loss_rows = torch.empty(logits.shape[0], dtype=torch.float32, device=logits.device)
        loss_and_grad_rows(logits, targets, loss_rows, grad, ignore_index, z_loss, scale)
        if grad is not None:
            if inplace_grad:
                # Anything else that saved these logits for its backward must now fail, not read a gradient.
                torch.autograd.graph.increment_version(logits)
            ctx.save_for_backward(grad)
        return reduce(loss_rows, n_valid, reduction, loss_dtype(logits.dtype))

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        (grad,) = ctx.saved_tensors
        return scale_rows_(grad, grad_out), None, None, None, None, None


_cross_entropy = outside_compile(CrossEntropyFunction.apply)


def reference(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100, z_loss: float = 0.0,
              reduction: str = "mean") -> torch.Tensor:
    """−log_softmax(logits)[target] + z_loss·logsumexp(logits)², in at least fp32, 0 on ignored rows."""
    check_args(targets, logits.shape[0], reduction)
    logits = logits.to(loss_dtype(logits.dtype))
    valid = targets != ignore_index
    safe_targets = torch.where(valid, targets, 0)
    nll = -logits.log_softmax(-1).gather(1, safe_targets[:, None])[:, 0]
    lse = logits.logsumexp(-1)
    loss = torch.where(valid, nll + z_loss * lse ** 2, 0.0)
    if reduction == "mean":
        return loss.sum() / valid.sum()
    return loss.sum() if reduction == "sum" else loss


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100, z_loss: float = 0.0,
                  reduction: str = "mean", backend: str = "auto", inplace_grad: bool = False) -> torch.Tensor:
    """Cross-entropy of (N, V) logits against (N,) int64 targets, plus z_loss·lse² per non-ignored row.

    reduction: "mean" over non-ignored rows, "sum", or "none" ((N,), 0 on ignored rows). inplace_grad=True
    lets the Triton path overwrite `logits` with the gradient (saves an (N, V) buffer); only for callers that
    never read those logits again, in or outside autograd.
    """
    if use_triton(backend, logits):
        return _cross_entropy(logits, targets, ignore_index, z_loss, reduction, inplace_grad)
    return reference(logits, targets, ignore_index, z_loss, reduction)
