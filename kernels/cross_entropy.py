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
stored gradient by the upstream gradient (a scalar for "mean"/"sum", one value per row for "none"). It is
torch's multiply, not an in-place kernel: under `torch.compile` inductor writes it over the stored gradient
(nothing else reads it), and an op's autograd formula may not overwrite a tensor the forward returned
(`torch.library.opcheck` refuses it); eagerly it costs a second gradient-sized buffer for a moment. The kernel
can also write the gradient over the logits themselves (Liger-Kernel's trick), which makes
the loss cost no memory beyond the logits; linear_cross_entropy does so on each of its private logits chunks.
The public op does not: a `torch.library` op that overwrote its input could not have an autograd formula
(PyTorch refuses one for a mutating op), and a caller's logits may be saved by another op. The "mean" divisor
is read from device memory, not passed as a Python number, so the launch never waits for the GPU to count the
valid rows.

Rows whose target is ignore_index get loss 0 and gradient 0, as in F.cross_entropy. The loss comes back in
fp32 for bf16/fp16 logits (the model already computes its loss in fp32) and in the logits' dtype otherwise;
the gradient is in the logits' dtype.

Layering: the kernel; the custom op `kiln::cross_entropy` (loss and gradient), one opaque node under
`torch.compile`; `cross_entropy`, which checks the arguments and picks the op or the reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kiln.kernels.backend import use_triton
from kiln.kernels.launch import autotune

REDUCTIONS = ("mean", "sum", "none")

# Vocabulary entries a program handles per step of its walk along a row, and the warps sharing them: the
# first (8192 over 16 warps, 16 fp32 values a thread) was the hand-picked setting. Blocks wider than a row's
# next power of two are pruned. The interpreter walks 1k-entry blocks, so a test's 1000-entry row is one
# block and a 50304-entry row many, partial last one included.
CONFIGS = [triton.Config({"BLOCK": b}, num_warps=w) for b, w in ((8192, 16), (4096, 8), (4096, 16), (8192, 8),
                                                                  (8192, 32), (16384, 16), (16384, 32))]


def _prune(configs, named_args, **kwargs):
    widest = max(triton.next_power_of_2(named_args["row_stride"]), 1024)
    return [c for c in configs if c.kwargs["BLOCK"] <= widest] or configs[:1]


@triton.jit
def _tanh(x):
    # from the sigmoid, which every Triton backend (and the interpreter) has; |error| ~ 1e-7 in fp32
    return 2.0 * tl.sigmoid(2.0 * x) - 1.0


# The kernel may write the gradient over the logits (grad_ptr == logits_ptr): each timed candidate gets the
# logits back first.
@autotune(CONFIGS, key=["n_cols", "row_stride", "COMPUTE_GRAD", "SOFTCAP"], interpreter=triton.Config({"BLOCK": 1024}),
          prune_configs_by={"early_config_prune": _prune}, restore_value=["grad_ptr"])
@triton.jit
def _cross_entropy_fwd(logits_ptr, grad_ptr, targets_ptr, loss_ptr, scale_ptr, scale_stride, n_cols, row_stride,
                       ignore_index, z_loss, softcap, COMPUTE_GRAD: tl.constexpr, SOFTCAP: tl.constexpr,
                       BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    logits_ptr += row * row_stride
    grad_ptr += row * row_stride
    cols = tl.arange(0, BLOCK)
    target = tl.load(targets_ptr + row)

    if target == ignore_index:
        tl.store(loss_ptr + row, 0.0)
        if COMPUTE_GRAD:
            for start in range(0, row_stride, BLOCK):
                offs = start + cols
                tl.store(grad_ptr + offs, tl.zeros([BLOCK], dtype=grad_ptr.dtype.element_ty), mask=offs < row_stride)
        return
    tl.device_assert((target >= 0) & (target < n_cols), "cross_entropy: target out of range")

    # Online log-sum-exp: when a block raises the running max, the sum so far is rescaled to the new max.
    m = float("-inf")
    d = 0.0
    for start in range(0, n_cols, BLOCK):
        offs = start + cols
        x = tl.load(logits_ptr + offs, mask=offs < n_cols, other=float("-inf")).to(tl.float32)
        if SOFTCAP:  # the masked columns stay -inf (a capped -inf would be -softcap, inside the softmax)
            x = tl.where(offs < n_cols, softcap * _tanh(x / softcap), float("-inf"))
        m_new = tl.maximum(m, tl.max(x, axis=0))
        d = d * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), axis=0)
        m = m_new
    lse = m + tl.log(d)
    # Read before the second walk, which may overwrite the logits with the gradient.
    x_target = tl.load(logits_ptr + target).to(tl.float32)
    if SOFTCAP:
        x_target = softcap * _tanh(x_target / softcap)
    tl.store(loss_ptr + row, lse - x_target + z_loss * lse * lse)

    if COMPUTE_GRAD:
        scale = tl.load(scale_ptr + row * scale_stride).to(tl.float32)
        # d/dx (z·lse²) = 2·z·lse·softmax(x), so the z-loss only stretches the softmax term.
        softmax_coef = 1.0 + 2.0 * z_loss * lse
        # The padding columns [n_cols, row_stride) get gradient 0: they are outside the softmax.
        for start in range(0, row_stride, BLOCK):
            offs = start + cols
            x = tl.load(logits_ptr + offs, mask=offs < n_cols, other=float("-inf")).to(tl.float32)
            if SOFTCAP:
                # d(cap·tanh(x/cap))/dx = 1 - tanh²: the gradient w.r.t. the capped logit, times that
                t = _tanh(x / softcap)
                g = tl.exp(tl.where(offs < n_cols, softcap * t, float("-inf")) - lse) * softmax_coef
                g = tl.where(offs == target, g - 1.0, g) * scale * (1.0 - t * t)
            else:
                g = tl.exp(x - lse) * softmax_coef
                g = tl.where(offs == target, g - 1.0, g) * scale
            tl.store(grad_ptr + offs, g.to(grad_ptr.dtype.element_ty), mask=offs < row_stride)


def _stride(scale: torch.Tensor) -> int:
    return scale.stride(0) if scale.dim() else 0


def loss_and_grad_rows(logits: torch.Tensor, targets: torch.Tensor, loss: torch.Tensor, grad: torch.Tensor | None,
                       ignore_index: int, z_loss: float, row_scale: torch.Tensor, n_classes: int | None = None,
                       softcap: float = 0.0) -> None:
    """Launch the forward kernel on contiguous (n, V) logits: the per-row loss into `loss` (fp32, (n,)) and,
    when `grad` is given, d loss_row / d logits · row_scale into it (`grad` may be `logits` itself).
    `row_scale` is a scalar tensor or one value per row (any stride). `n_classes` (default V): only the first
    n_classes columns are classes; the rest pad each row (to keep rows 16-byte aligned) and get gradient 0.
    `softcap` > 0: the loss of the capped logits softcap·tanh(logits / softcap), its gradient w.r.t. the raw ones."""
    n, v = logits.shape
    if n == 0:
        return
    _cross_entropy_fwd[(n,)](logits, logits if grad is None else grad, targets, loss, row_scale, _stride(row_scale),
                             v if n_classes is None else n_classes, v, ignore_index, z_loss, float(softcap),
                             COMPUTE_GRAD=grad is not None, SOFTCAP=softcap > 0)


def scaled(grad: torch.Tensor, upstream: torch.Tensor) -> torch.Tensor:
    """A gradient for an upstream gradient of 1, times the real one (a scalar, or one value per row), in the
    gradient's dtype."""
    return (grad * (upstream[:, None] if upstream.dim() else upstream)).to(grad.dtype)


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


def reduced_loss(like: torch.Tensor, n: int, reduction: str) -> torch.Tensor:
    """An empty loss of the shape and dtype a reduction of n rows gives (for fake implementations)."""
    return like.new_empty((n,) if reduction == "none" else (), dtype=loss_dtype(like.dtype))


@torch.library.custom_op("kiln::cross_entropy", mutates_args=())
def cross_entropy_op(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int, z_loss: float, reduction: str,
                     compute_grad: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(the loss reduced as asked; d loss / d logits for an upstream gradient of 1 when compute_grad, contiguous,
    else an empty tensor)."""
    logits, targets = logits.contiguous(), targets.contiguous()
    n_valid = (targets != ignore_index).sum()
    grad = torch.empty_like(logits) if compute_grad else logits.new_empty(0)
    # "none" leaves every row unscaled: its backward multiplies each row by its own upstream gradient.
    scale = 1.0 / n_valid if reduction == "mean" else torch.ones((), device=logits.device)
    loss_rows = torch.empty(logits.shape[0], dtype=torch.float32, device=logits.device)
    loss_and_grad_rows(logits, targets, loss_rows, grad if compute_grad else None, ignore_index, z_loss, scale)
    return reduce(loss_rows, n_valid, reduction, loss_dtype(logits.dtype)), grad


@cross_entropy_op.register_fake
def _(logits, targets, ignore_index, z_loss, reduction, compute_grad):
    grad = logits.new_empty(logits.shape if compute_grad else (0,))
    return reduced_loss(logits, logits.shape[0], reduction), grad


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(output[1])


def _backward(ctx, grad_out, _dgrad):
    (grad,) = ctx.saved_tensors
    return scaled(grad, grad_out), None, None, None, None, None


cross_entropy_op.register_autograd(_backward, setup_context=_setup_context)


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


def needs_grad(*tensors: torch.Tensor) -> list[bool]:
    """Which of `tensors` autograd will ask a gradient for: what a fused op must compute in its forward."""
    return [torch.is_grad_enabled() and t.requires_grad for t in tensors]


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100, z_loss: float = 0.0,
                  reduction: str = "mean", backend: str = "auto") -> torch.Tensor:
    """Cross-entropy of (N, V) logits against (N,) int64 targets, plus z_loss·lse² per non-ignored row.

    reduction: "mean" over non-ignored rows, "sum", or "none" ((N,), 0 on ignored rows).
    """
    if not use_triton(backend, logits):
        return reference(logits, targets, ignore_index, z_loss, reduction)
    if logits.dim() != 2:
        raise ValueError(f"cross_entropy: logits must be (N, V), got {tuple(logits.shape)}")
    check_args(targets, logits.shape[0], reduction)
    return cross_entropy_op(logits, targets, ignore_index, z_loss, reduction, *needs_grad(logits))[0]
