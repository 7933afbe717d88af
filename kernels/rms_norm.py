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
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kiln.kernels.backend import outside_compile, use_triton

# One program holds a whole row in registers (already spilling near this size); LLM hidden sizes (768-16384)
# stay well below, and wider rows would need a loop over column blocks.
MAX_HIDDEN = 65536

# Programs for the backward's dweight partials when there is no GPU to count SMs on: more than one, so tests
# in the interpreter exercise the cross-program sum, and few, because each interpreted program is slow.
INTERPRETER_PROGRAMS = 4


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


def _launch_config(n_cols: int) -> tuple[int, int]:
    if n_cols > MAX_HIDDEN:
        raise ValueError(f"rms_norm: hidden size {n_cols} > {MAX_HIDDEN}, which one program cannot hold in registers")
    block = triton.next_power_of_2(n_cols)
    num_warps = 4 if block <= 2048 else 8 if block <= 8192 else 16
    return block, num_warps


def _backward_programs(x: torch.Tensor, n_rows: int) -> int:
    if x.is_cuda:
        programs = torch.cuda.get_device_properties(x.device).multi_processor_count
    else:
        programs = INTERPRETER_PROGRAMS
    return max(1, min(programs, n_rows))


class RMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        shape = x.shape
        n_cols = shape[-1]
        if weight.shape != (n_cols,):
            raise ValueError(f"rms_norm: weight shape {tuple(weight.shape)} does not match hidden size {n_cols}")
        x2 = x.contiguous().view(-1, n_cols)
        weight = weight.contiguous()
        n_rows = x2.shape[0]
        block, num_warps = _launch_config(n_cols)
        y = torch.empty_like(x2)
        rstd = torch.empty(n_rows, dtype=torch.float32, device=x.device)
        if n_rows:
            _rms_norm_fwd[(n_rows,)](x2, weight, y, rstd, x2.stride(0), n_cols, eps, BLOCK=block,
                                     num_warps=num_warps)
        ctx.save_for_backward(x2, weight, rstd)
        return y.view(shape)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x2, weight, rstd = ctx.saved_tensors
        n_rows, n_cols = x2.shape
        dy2 = dy.contiguous().view(n_rows, n_cols)
        block, num_warps = _launch_config(n_cols)
        programs = _backward_programs(x2, n_rows)
        dx = torch.empty_like(x2)
        dw_partial = torch.empty(programs, n_cols, dtype=torch.float32, device=x2.device)
        _rms_norm_bwd[(programs,)](dy2, x2, weight, rstd, dx, dw_partial, x2.stride(0), n_rows, n_cols,
                                   BLOCK=block, num_warps=num_warps)
        dweight = dw_partial.sum(0).to(weight.dtype)
        return dx.view(dy.shape), dweight, None


_rms_norm = outside_compile(RMSNormFunction.apply)


def reference(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    """torch.nn.RMSNorm(H, eps) with `weight`: computed in at least fp32, returned in x's dtype."""
    compute = torch.promote_types(x.dtype, torch.float32)
    xf = x.to(compute)
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.to(compute)
    return y.to(x.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-5, backend: str = "auto") -> torch.Tensor:
    """RMSNorm over the last dimension of x (any leading shape), scaled by `weight` of shape (H,)."""
    if use_triton(backend, x, weight):
        return _rms_norm(x, weight, eps)
    return reference(x, weight, eps)
