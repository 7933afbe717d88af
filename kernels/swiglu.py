"""SwiGLU's gating, h = silu(gate) · up, as one elementwise pass forward and one backward.

Eager PyTorch writes silu(gate) to memory, reads it back for the product, and autograd keeps it for backward:
an extra (tokens, d_ff) tensor per layer, the widest activation in the MLP. Here the forward reads gate and up
and writes h; nothing else is stored. Backward saves only gate and up (which the matmuls around the MLP keep
alive anyway) and recomputes sigmoid(gate) and silu(gate) from gate, trading a few flops, which are free in a
memory-bound op, for that tensor. Both kernels treat the tensors as flat arrays (the op is elementwise, so
shape does not matter), mask the last block, and compute in fp32 whatever the storage dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kiln.kernels.backend import outside_compile, use_triton

# Elements per program: large enough that each thread moves several 16-byte vectors, so launch and index
# overhead vanish against the memory traffic.
BLOCK = 4096
NUM_WARPS = 8


@triton.jit
def _swiglu_fwd(gate_ptr, up_ptr, h_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    gate = tl.load(gate_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(up_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    h = gate * tl.sigmoid(gate) * up
    tl.store(h_ptr + offs, h.to(h_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_bwd(dh_ptr, gate_ptr, up_ptr, dgate_ptr, dup_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    dh = tl.load(dh_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    gate = tl.load(gate_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(up_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    sig = tl.sigmoid(gate)
    silu = gate * sig
    # silu'(g) = σ(g) + g·σ(g)·(1 − σ(g)) = σ(g)·(1 + g·(1 − σ(g))).
    dgate = dh * up * sig * (1.0 + gate * (1.0 - sig))
    tl.store(dgate_ptr + offs, dgate.to(dgate_ptr.dtype.element_ty), mask=mask)
    tl.store(dup_ptr + offs, (dh * silu).to(dup_ptr.dtype.element_ty), mask=mask)


def _grid(n: int) -> tuple[int]:
    return (triton.cdiv(n, BLOCK),)


class SwiGLUFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        if gate.shape != up.shape or gate.dtype != up.dtype:
            raise ValueError(f"swiglu: gate {tuple(gate.shape)} {gate.dtype} and up {tuple(up.shape)} {up.dtype} "
                             "must have the same shape and dtype")
        gate, up = gate.contiguous(), up.contiguous()
        h = torch.empty_like(gate)
        n = gate.numel()
        if n:
            _swiglu_fwd[_grid(n)](gate, up, h, n, BLOCK=BLOCK, num_warps=NUM_WARPS)
        ctx.save_for_backward(gate, up)
        return h

    @staticmethod
    def backward(ctx, dh: torch.Tensor):
        gate, up = ctx.saved_tensors
        dh = dh.contiguous()
        dgate, dup = torch.empty_like(gate), torch.empty_like(up)
        n = gate.numel()
        if n:
            _swiglu_bwd[_grid(n)](dh, gate, up, dgate, dup, n, BLOCK=BLOCK, num_warps=NUM_WARPS)
        return dgate, dup


_swiglu = outside_compile(SwiGLUFunction.apply)


def reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) · up, computed in at least fp32 and returned in gate's dtype."""
    compute = torch.promote_types(gate.dtype, torch.float32)
    g = gate.to(compute)
    return (g * torch.sigmoid(g) * up.to(compute)).to(gate.dtype)


def swiglu(gate: torch.Tensor, up: torch.Tensor, backend: str = "auto") -> torch.Tensor:
    """silu(gate) · up elementwise, for gate and up of the same (any) shape."""
    if use_triton(backend, gate, up):
        return _swiglu(gate, up)
    return reference(gate, up)
