"""RMSNorm, y = x / sqrt(mean(x², -1) + eps) · weight, in one pass over memory forward and one backward.

Written as torch ops the norm is several kernels (square, mean, rsqrt, two multiplies, a cast), each a round
trip through memory in a memory-bound op; fusing them is the whole win. (Recent PyTorch also has a fused CUDA
kernel of its own for nn.RMSNorm when x and weight share a dtype.) The forward kernel gives each row of the
flattened (rows, H) input to one program that holds the row in registers (block = next power of two of H,
masked), accumulates in fp32 whatever the input dtype, writes y in x's dtype and saves only the per-row rstd
(fp32, 4 bytes a row) next to x for backward.

Backward needs dx, a per-row quantity, and dweight = Σ_rows dy·x̂, a reduction over every row. Atomics on
dweight would serialise every program on the same H addresses and make the sum's order (and bits) vary run
to run, so instead a fixed number of programs (one per SM on a GPU) each walk a strided set of rows, compute
dx for each row in one pass (x̂ is recomputed from x and the saved rstd, never stored), and keep their own
fp32 partial of dy·x̂ in registers; the (programs, H) partials are then summed by a small torch reduction.

Layering (as Liger-Kernel's): the Triton kernels; the `kiln::rms_norm` and `kiln::rms_norm_backward` custom ops
that launch them (fake implementations for the compiler, the backward op as the forward's autograd formula), so
`torch.compile` keeps each call as one opaque node in its graph; and `rms_norm`, which checks its arguments
and picks the kernels or the plain-torch reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kiln.kernels.backend import use_triton
from kiln.kernels.launch import autotune, calculate_settings, near_derived_warps, sm_count

# Programs for the backward's dweight partials when there is no GPU to count SMs on: more than one, so tests
# in the interpreter exercise the cross-program sum, and few, because each interpreted program is slow.
INTERPRETER_PROGRAMS = 4

# The block is the row's next power of two; how many warps share it is the GPU's to pick, near the derived count.
WARPS = [triton.Config({}, num_warps=w) for w in (4, 2, 8, 16, 32)]
NEAR_DERIVED = {"early_config_prune": near_derived_warps("n_cols")}


@autotune(WARPS, key=["n_cols"], prune_configs_by=NEAR_DERIVED)
@triton.jit
def _rms_norm_fwd(x_ptr, w_ptr, y_ptr, rstd_ptr, stride, n_cols, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride + cols, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    # Masked lanes load 0, so they add nothing to the sum; divide by the true width, not the block.
    rstd = tl.rsqrt(tl.sum(x * x, axis=0) / n_cols + eps)
    tl.store(rstd_ptr + row, rstd)
    tl.store(y_ptr + row * stride + cols, (x * rstd * w).to(y_ptr.dtype.element_ty), mask=mask)


@autotune(WARPS, key=["n_cols"], prune_configs_by=NEAR_DERIVED)
@triton.jit
def _rms_norm_bwd(dy_ptr, x_ptr, w_ptr, rstd_ptr, dx_ptr, dw_partial_ptr, stride, n_rows, n_cols,
                  BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    dw = tl.zeros((BLOCK,), dtype=tl.float32)
    for row in range(pid, n_rows, programs):
        offs = tl.cast(row, tl.int64) * stride + cols
        x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + row)
        x_hat = x * rstd
        g = dy * w
        # d/dx of x·rstd(x): the direct term g·rstd minus the projection of g onto x̂ through rstd's dependence on x.
        dx = rstd * (g - x_hat * (tl.sum(g * x_hat, axis=0) / n_cols))
        tl.store(dx_ptr + offs, dx.to(dx_ptr.dtype.element_ty), mask=mask)
        dw += dy * x_hat
    tl.store(dw_partial_ptr + pid.to(tl.int64) * n_cols + cols, dw, mask=mask)


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(-1, x.shape[-1])


@torch.library.custom_op("kiln::rms_norm", mutates_args=())
def rms_norm_op(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(y in x's shape and dtype, contiguous; rstd, fp32, one per row)."""
    x2 = _rows(x)
    n_rows, n_cols = x2.shape
    y = torch.empty_like(x2)
    rstd = torch.empty(n_rows, dtype=torch.float32, device=x.device)
    if n_rows:
        _rms_norm_fwd[(n_rows,)](x2, weight.contiguous(), y, rstd, x2.stride(0), n_cols, eps,
                                 BLOCK=calculate_settings(n_cols, "rms_norm")[0])
    return y.view(x.shape), rstd


@rms_norm_op.register_fake
def _(x, weight, eps):
    return x.new_empty(x.shape), x.new_empty(x.numel() // x.shape[-1], dtype=torch.float32)


@torch.library.custom_op("kiln::rms_norm_backward", mutates_args=())
def rms_norm_backward_op(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                         rstd: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx in x's shape and dtype, contiguous; dweight in weight's dtype)."""
    x2, dy2 = _rows(x), _rows(dy)
    n_rows, n_cols = x2.shape
    programs = max(1, min(sm_count(x.device) if x.is_cuda else INTERPRETER_PROGRAMS, n_rows))
    dx = torch.empty_like(x2)
    dw_partial = torch.empty(programs, n_cols, dtype=torch.float32, device=x.device)
    _rms_norm_bwd[(programs,)](dy2, x2, weight.contiguous(), rstd, dx, dw_partial, x2.stride(0), n_rows, n_cols,
                               BLOCK=calculate_settings(n_cols, "rms_norm")[0])
    return dx.view(x.shape), dw_partial.sum(0).to(weight.dtype)


@rms_norm_backward_op.register_fake
def _(dy, x, weight, rstd):
    return x.new_empty(x.shape), weight.new_empty(weight.shape)


def _setup_context(ctx, inputs, output):
    x, weight, _ = inputs
    ctx.save_for_backward(x, weight, output[1])


def _backward(ctx, dy, _drstd):
    x, weight, rstd = ctx.saved_tensors
    dx, dweight = rms_norm_backward_op(dy, x, weight, rstd)
    return dx, dweight, None


rms_norm_op.register_autograd(_backward, setup_context=_setup_context)


def reference(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    """torch.nn.RMSNorm(H, eps) with `weight`: computed in at least fp32, returned in x's dtype."""
    compute = torch.promote_types(x.dtype, torch.float32)
    xf = x.to(compute)
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.to(compute)
    return y.to(x.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-5, backend: str = "auto") -> torch.Tensor:
    """RMSNorm over the last dimension of x (any leading shape), scaled by `weight` of shape (H,)."""
    if not use_triton(backend, x, weight):
        return reference(x, weight, eps)
    n_cols = x.shape[-1]
    if weight.shape != (n_cols,):
        raise ValueError(f"rms_norm: weight shape {tuple(weight.shape)} does not match hidden size {n_cols}")
    calculate_settings(n_cols, "rms_norm")  # refuses a row one program cannot hold, before any launch
    return rms_norm_op(x, weight, eps)[0]
