"""Rotary position embedding for q and k in one launch, forward and backward.

Eager PyTorch rotates q and k separately, each through a cast, four products, two sums, a `cat` and a cast
back: about ten elementwise kernels, each a round trip to memory. RoPE does one multiply-add per element, so it
is bound by memory alone, and the least traffic is reading q and k once and writing them once. Each program
takes a block of (batch, position) rows, loads their cos/sin rows once (table row `pos + t`, so a KV-cache
decode step at offset `pos` reads the right angles) and rotates every q head and then every k head with them.
Because the q and k head counts are separate arguments, GQA (fewer k heads) costs nothing extra and needs no
second launch. Rows per program shrink as heads x head_dim grow (one (rows, heads, D/2) tile of at most
TILE_ELEMENTS), so a large model gets a program per row or two and a small one fewer, larger programs.

Backward saves nothing but the cos/sin tables the caller already holds: the rotation is linear, and the
transpose of [[cos, -sin], [sin, cos]] is the same matrix with sin negated, so the gradient runs the forward
kernel again with `BACKWARD` flipping the sign of sin. Inputs are read through their strides (the model's
`(B, H, T, D)` -> `(B, T, H, D)` transposes and fused-projection slices need no copy); outputs are contiguous.
Math is float32 whatever the input dtype; outputs are in the input dtype. The tables get no gradient.

Layering: the kernel; the `kiln::rope` custom op that launches it (forward, and with `backward` its own
gradient), one opaque node under `torch.compile`; `rope`, which checks the arguments and picks kernel or
reference. The tile is derived from the sizes; the GPU times how many warps share it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kiln.kernels.backend import use_triton
from kiln.kernels.launch import autotune

# Elements of one (rows, heads, half head) tile: big enough that a program's loads are wide and many are in
# flight on an H100, small enough to stay in registers. Not tuned on a GPU yet.
TILE_ELEMENTS = 4096


@triton.jit
def _rotate_heads(x_ptr, out_ptr, b, t, rows, row_mask, n_heads, s_b, s_t, s_h, s_d, cos, sin,
                  HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):
    """Rotate every head of a block of (b, t) rows; out is contiguous (B*T, n_heads, 2*HALF)."""
    cols = tl.arange(0, BLOCK_HALF)[None, None, :]
    x_rows = (x_ptr + b * s_b + t * s_t)[:, None, None]
    out_rows = (out_ptr + rows * n_heads * (2 * HALF))[:, None, None]
    dtype = out_ptr.dtype.element_ty
    for h0 in range(0, n_heads, BLOCK_H):
        heads = (h0 + tl.arange(0, BLOCK_H))[None, :, None]
        mask = row_mask[:, None, None] & (heads < n_heads) & (cols < HALF)
        x1_ptrs = x_rows + heads * s_h + cols * s_d
        x1 = tl.load(x1_ptrs, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(x1_ptrs + HALF * s_d, mask=mask, other=0.0).to(tl.float32)
        out1_ptrs = out_rows + heads * (2 * HALF) + cols
        tl.store(out1_ptrs, (x1 * cos - x2 * sin).to(dtype), mask=mask)
        tl.store(out1_ptrs + HALF, (x2 * cos + x1 * sin).to(dtype), mask=mask)


@autotune([triton.Config({}, num_warps=w) for w in (4, 2, 8)], key=["n_q_heads", "n_k_heads", "HALF"])
@triton.jit
def _rope_kernel(q_ptr, k_ptr, q_out_ptr, k_out_ptr, cos_ptr, sin_ptr,
                 n_rows, T, pos, n_q_heads, n_k_heads,
                 sq_b, sq_t, sq_h, sq_d, sk_b, sk_t, sk_h, sk_d, stride_cos, stride_sin,
                 HALF: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr,
                 BLOCK_HALF: tl.constexpr, BACKWARD: tl.constexpr):
    # int64 offsets: B*T*H*D passes 2**31 at long contexts with many heads.
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_mask = rows < n_rows
    b, t = rows // T, rows % T
    cols = tl.arange(0, BLOCK_HALF)
    table_mask = row_mask[:, None] & (cols[None, :] < HALF)
    # Loaded once per row and shared by every q and k head; [:, None, :] broadcasts over the head axis.
    cos = tl.load(cos_ptr + (pos + t)[:, None] * stride_cos + cols[None, :], mask=table_mask, other=0.0)
    sin = tl.load(sin_ptr + (pos + t)[:, None] * stride_sin + cols[None, :], mask=table_mask, other=0.0)
    cos = cos.to(tl.float32)[:, None, :]
    sin = sin.to(tl.float32)[:, None, :]
    if BACKWARD:
        sin = -sin
    _rotate_heads(q_ptr, q_out_ptr, b, t, rows, row_mask, n_q_heads, sq_b, sq_t, sq_h, sq_d, cos, sin,
                  HALF, BLOCK_HQ, BLOCK_HALF)
    _rotate_heads(k_ptr, k_out_ptr, b, t, rows, row_mask, n_k_heads, sk_b, sk_t, sk_h, sk_d, cos, sin,
                  HALF, BLOCK_HK, BLOCK_HALF)


@torch.library.custom_op("kiln::rope", mutates_args=())
def rope_op(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pos: int,
            backward: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """q and k rotated by rows [pos, pos+T) of the tables (by their transpose when `backward`), contiguous."""
    B, T, H, D = q.shape
    H_kv = k.size(2)
    q_out = torch.empty((B, T, H, D), dtype=q.dtype, device=q.device)
    k_out = torch.empty((B, T, H_kv, D), dtype=k.dtype, device=k.device)
    n_rows = B * T
    if n_rows == 0:
        return q_out, k_out
    block_half = triton.next_power_of_2(D // 2)
    max_heads = max(1, TILE_ELEMENTS // block_half)
    block_hq = min(triton.next_power_of_2(H), max_heads)
    block_hk = min(triton.next_power_of_2(H_kv), max_heads)
    block_r = min(triton.next_power_of_2(n_rows), max(1, TILE_ELEMENTS // (block_half * max(block_hq, block_hk))))
    _rope_kernel[(triton.cdiv(n_rows, block_r),)](
        q, k, q_out, k_out, cos, sin, n_rows, T, pos, H, H_kv, *q.stride(), *k.stride(), cos.stride(0),
        sin.stride(0), HALF=D // 2, BLOCK_R=block_r, BLOCK_HQ=block_hq, BLOCK_HK=block_hk, BLOCK_HALF=block_half,
        BACKWARD=backward)
    return q_out, k_out


@rope_op.register_fake
def _(q, k, cos, sin, pos, backward):
    return q.new_empty(q.shape), k.new_empty(k.shape)


def _setup_context(ctx, inputs, output):
    _, _, cos, sin, pos, _ = inputs
    ctx.save_for_backward(cos, sin)
    ctx.pos = pos


def _backward(ctx, dq_rot, dk_rot):
    cos, sin = ctx.saved_tensors
    dq, dk = rope_op(dq_rot, dk_rot, cos, sin, ctx.pos, True)
    return dq, dk, None, None, None, None


rope_op.register_autograd(_backward, setup_context=_setup_context)


def reference(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
              pos: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain torch: the model's rotate_half rotation on (B, T, H, D), angles from table rows [pos, pos+T)."""
    T = q.size(1)

    def rotate(x: torch.Tensor) -> torch.Tensor:
        compute = torch.promote_types(x.dtype, torch.float32)  # fp32 for bf16/fp16, float64 stays float64
        c = cos[pos:pos + T, None, :].to(compute)  # (T, 1, D/2) broadcasts over batch and heads
        s = sin[pos:pos + T, None, :].to(compute)
        x1, x2 = x.to(compute).chunk(2, dim=-1)
        return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).to(x.dtype)

    return rotate(q), rotate(k)


def _check(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pos: int) -> None:
    if q.dim() != 4 or k.dim() != 4:
        raise ValueError(f"q and k must be (B, T, H, D), got shapes {tuple(q.shape)} and {tuple(k.shape)}")
    B, T, _, D = q.shape
    if k.size(0) != B or k.size(1) != T or k.size(3) != D:
        raise ValueError(f"k {tuple(k.shape)} must share B, T and D with q {tuple(q.shape)}")
    if D % 2:
        raise ValueError(f"head dim D={D} must be even: RoPE rotates pairs (x[i], x[i + D/2])")
    for name, table in (("cos", cos), ("sin", sin)):
        if table.dim() != 2 or table.size(1) != D // 2:
            raise ValueError(f"{name} must be (max_positions, D/2={D // 2}), got {tuple(table.shape)}")
    rows = min(cos.size(0), sin.size(0))
    if pos < 0 or pos + T > rows:
        raise ValueError(f"positions [{pos}, {pos + T}) are outside the tables' {rows} rows")


def rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pos: int = 0,
         backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q (B, T, H, D) and k (B, T, H_kv, D) by the angles in rows [pos, pos+T) of cos/sin (max_pos, D/2).

    Returns (q_rot, k_rot) in the inputs' dtypes. The Triton path treats cos/sin as constants (no gradient).
    """
    _check(q, k, cos, sin, pos)
    if use_triton(backend, q, k, cos, sin):
        # The kernel steps through a table row with unit stride.
        return rope_op(q, k, cos.contiguous(), sin.contiguous(), pos, False)
    return reference(q, k, cos, sin, pos)
