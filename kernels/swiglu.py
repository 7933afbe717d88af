"""SwiGLU's gating, h = silu(gate) · up, as one elementwise pass forward and one backward.

Eager PyTorch writes silu(gate) to memory, reads it back for the product, and autograd keeps it for backward:
an extra (tokens, d_ff) tensor per layer, the widest activation in the MLP. Here the forward reads gate and up
and writes h; nothing else is stored. Backward saves only gate and up (which the matmuls around the MLP keep
alive anyway) and recomputes sigmoid(gate) and silu(gate) from gate, trading a few flops, which are free in a
memory-bound op, for that tensor. Both kernels treat the tensors as flat arrays (the op is elementwise, so
shape does not matter), mask the last block, and compute in fp32 whatever the storage dtype.

Layering: the kernels; the `kiln::swiglu` and `kiln::swiglu_backward` custom ops that launch them (what
`torch.compile` keeps as one node each); `swiglu`, which checks the arguments and picks kernels or reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kiln.kernels.backend import use_triton
from kiln.kernels.launch import ELEMENTWISE_CONFIGS, autotune


# Keyed on n's next power of two, not n: a server's steps and SFT's batches bring new token counts all the time,
# and keying on n re-ran the tuner (five configs timed) at each one: on the H200 (2026-11-26) the engine's first
# decode steps at each batch size took seconds.
@autotune(ELEMENTWISE_CONFIGS, key=["N_BUCKET"])
@triton.jit
def _swiglu_fwd(gate_ptr, up_ptr, h_ptr, n, N_BUCKET, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    gate = tl.load(gate_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(up_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    h = gate * tl.sigmoid(gate) * up
    tl.store(h_ptr + offs, h.to(h_ptr.dtype.element_ty), mask=mask)


@autotune(ELEMENTWISE_CONFIGS, key=["N_BUCKET"])
@triton.jit
def _swiglu_bwd(dh_ptr, gate_ptr, up_ptr, dgate_ptr, dup_ptr, n, N_BUCKET, BLOCK: tl.constexpr):
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


def _grid(n: int):
    return lambda meta: (triton.cdiv(n, meta["BLOCK"]),)


@torch.library.custom_op("kiln::swiglu", mutates_args=())
def swiglu_op(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) · up, contiguous, in gate's dtype."""
    gate, up = gate.contiguous(), up.contiguous()
    h = torch.empty_like(gate)
    if n := gate.numel():
        _swiglu_fwd[_grid(n)](gate, up, h, n, triton.next_power_of_2(n))
    return h


@swiglu_op.register_fake
def _(gate, up):
    return gate.new_empty(gate.shape)


@torch.library.custom_op("kiln::swiglu_backward", mutates_args=())
def swiglu_backward_op(dh: torch.Tensor, gate: torch.Tensor,
                       up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(dgate, dup), contiguous, in gate's dtype; silu(gate) is recomputed from gate, never stored."""
    dh, gate, up = dh.contiguous(), gate.contiguous(), up.contiguous()
    dgate, dup = torch.empty_like(gate), torch.empty_like(up)
    if n := gate.numel():
        _swiglu_bwd[_grid(n)](dh, gate, up, dgate, dup, n, triton.next_power_of_2(n))
    return dgate, dup


@swiglu_backward_op.register_fake
def _(dh, gate, up):
    return gate.new_empty(gate.shape), up.new_empty(up.shape)


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _backward(ctx, dh):
    return swiglu_backward_op(dh, *ctx.saved_tensors)


swiglu_op.register_autograd(_backward, setup_context=_setup_context)


def reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) · up, computed in at least fp32 and returned in gate's dtype."""
    compute = torch.promote_types(gate.dtype, torch.float32)
    g = gate.to(compute)
    return (g * torch.sigmoid(g) * up.to(compute)).to(gate.dtype)


def swiglu(gate: torch.Tensor, up: torch.Tensor, backend: str = "auto") -> torch.Tensor:
    """silu(gate) · up elementwise, for gate and up of the same (any) shape."""
    if not use_triton(backend, gate, up):
        return reference(gate, up)
    if gate.shape != up.shape or gate.dtype != up.dtype:
        raise ValueError(f"swiglu: gate {tuple(gate.shape)} {gate.dtype} and up {tuple(up.shape)} {up.dtype} "
                         "must have the same shape and dtype")
    return swiglu_op(gate, up)
