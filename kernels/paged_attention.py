"""Decode attention over a paged KV cache (PagedAttention, Kwon et al. 2023): one new query token per sequence
attends to every cached token of its own sequence, wherever the blocks holding them lie.

The cache is one pool per layer, `k_cache` and `v_cache` of shape (num_blocks, block_size, n_kv_head,
head_dim): token i of sequence s is in slot i % block_size of block `block_tables[s, i // block_size]`, and the
first `context_lens[s]` tokens are its context (the new token's own key and value included, written before the
call). Sequences of any lengths share one launch, with no padding to the longest and no gather of their keys
into a contiguous copy, which is what lets a serving engine batch requests of different lengths every step.

Decoding is memory-bound: each cached key and value is read once per step and used by few queries. One program
takes one (sequence, kv head) and the query heads that share it under GQA, so a key block is loaded once for
its whole group, and walks the sequence's blocks in order with an online softmax (running max and sum in
fp32), never holding more than one block of scores. With a single query token per head the scores are a
multiply and a row sum, not a tensor-core dot, whose tiles would be mostly padding.

Layering: the kernel; the `kiln::paged_attention` custom op that launches it (inference only: it has no
autograd formula, so a backward through it fails with PyTorch's own error), one opaque node under
`torch.compile`; `paged_attention`, which checks the arguments and picks kernel or reference.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kiln.kernels.backend import use_triton
from kiln.kernels.launch import autotune


@autotune([triton.Config({}, num_warps=w) for w in (4, 2, 8)], key=["BLOCK_T", "REP", "BLOCK_D"])
@triton.jit
def _decode_kernel(q_ptr, k_ptr, v_ptr, tables_ptr, lens_ptr, o_ptr,
                   sq_s, sq_h, sk_b, sk_t, sk_h, sv_b, sv_t, sv_h, st_s, so_s, so_h,
                   n_rep, block_size, scale, BLOCK_T: tl.constexpr, REP: tl.constexpr, D: tl.constexpr,
                   BLOCK_D: tl.constexpr):
    seq, kv_head = tl.program_id(0), tl.program_id(1)
    heads = kv_head * n_rep + tl.arange(0, REP)
    head_ok = tl.arange(0, REP) < n_rep
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < D
    q = tl.load(q_ptr + seq * sq_s + heads[:, None] * sq_h + dims[None, :],
                mask=head_ok[:, None] & dim_ok[None, :], other=0.0).to(tl.float32) * scale
    length = tl.load(lens_ptr + seq)
    slots = tl.arange(0, BLOCK_T)  # a block's slots, padded to a power of two
    m = tl.full([REP], float("-inf"), tl.float32)
    total = tl.zeros([REP], tl.float32)
    acc = tl.zeros([REP, BLOCK_D], tl.float32)
    for j in range(0, tl.cdiv(length, block_size)):
        block = tl.load(tables_ptr + seq * st_s + j).to(tl.int64)
        live = (slots < block_size) & (j * block_size + slots < length)
        kv_mask = live[:, None] & dim_ok[None, :]
        k = tl.load(k_ptr + block * sk_b + slots[:, None] * sk_t + kv_head * sk_h + dims[None, :],
                    mask=kv_mask, other=0.0).to(tl.float32)
        v = tl.load(v_ptr + block * sv_b + slots[:, None] * sv_t + kv_head * sv_h + dims[None, :],
                    mask=kv_mask, other=0.0).to(tl.float32)
        scores = tl.sum(q[:, None, :] * k[None, :, :], axis=2)  # (REP, BLOCK_T)
        scores = tl.where(live[None, :], scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        p = tl.exp(scores - m_new[:, None])
        correction = tl.exp(m - m_new)
        total = total * correction + tl.sum(p, axis=1)
        acc = acc * correction[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        m = m_new
    out = acc / total[:, None]
    tl.store(o_ptr + seq * so_s + heads[:, None] * so_h + dims[None, :], out.to(o_ptr.dtype.element_ty),
             mask=head_ok[:, None] & dim_ok[None, :])


def reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
              context_lens: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """The same attention in plain torch, every sequence at once: its keys and values gathered from its blocks
    into a (sequences, longest context) batch, the slots past each context masked out, in q's dtype."""
    S, H, D = q.shape
    n_kv_head, block_size = k_cache.size(2), k_cache.size(1)
    scale = 1 / math.sqrt(D) if scale is None else scale
    longest = int(context_lens.max()) if S else 0
    positions = torch.arange(longest, device=q.device)
    blocks = block_tables.long().gather(1, (positions // block_size).clamp(max=block_tables.size(1) - 1)
                                        .expand(S, -1))
    live = positions[None, :] < context_lens.to(q.device).long()[:, None]  # (S, longest)
    slots = blocks * block_size + positions % block_size  # (S, longest)
    # past its context a row reads its first slot again (masked out below): a slot outside every context may
    # hold anything, NaN included, and 0 x NaN would leak through the softmax's zero weight
    slots = torch.where(live, slots, slots[:, :1])
    k = k_cache.flatten(0, 1)[slots].to(q.dtype).transpose(1, 2)  # (S, H_kv, longest, D)
    v = v_cache.flatten(0, 1)[slots].to(q.dtype).transpose(1, 2)
    if H != n_kv_head:
        k, v = k.repeat_interleave(H // n_kv_head, dim=1), v.repeat_interleave(H // n_kv_head, dim=1)
    out = F.scaled_dot_product_attention(q[:, :, None], k, v, attn_mask=live[:, None, None, :], scale=scale)
    return out[:, :, 0]


def _check(q, k_cache, v_cache, block_tables, context_lens) -> None:
    if q.dim() != 3 or k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"q {tuple(q.shape)}, k_cache {tuple(k_cache.shape)}, v_cache {tuple(v_cache.shape)}: "
                         "expected (sequences, heads, head_dim) and two (blocks, block_size, kv_heads, head_dim)")
    S, H, D = q.shape
    if k_cache.size(3) != D or H % k_cache.size(2):
        raise ValueError(f"q has {H} heads of {D}, the cache {k_cache.size(2)} kv heads of {k_cache.size(3)}: "
                         "expected the same head_dim and heads a multiple of kv heads")
    if block_tables.dim() != 2 or block_tables.size(0) != S or context_lens.shape != (S,):
        raise ValueError(f"block_tables {tuple(block_tables.shape)}, context_lens {tuple(context_lens.shape)}: "
                         f"expected ({S}, max_blocks) and ({S},)")
    if block_tables.dtype.is_floating_point or context_lens.dtype.is_floating_point:
        raise ValueError("block_tables and context_lens: expected integer tensors")


@torch.library.custom_op("kiln::paged_attention", mutates_args=())
def paged_attention_op(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                       context_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """The attention output (sequences, heads, head_dim), contiguous, in q's dtype."""
    S, H, D = q.shape
    n_kv_head, block_size = k_cache.size(2), k_cache.size(1)
    if q.stride(2) != 1 or k_cache.stride(3) != 1 or v_cache.stride(3) != 1:
        q, k_cache, v_cache = q.contiguous(), k_cache.contiguous(), v_cache.contiguous()
    tables, lens = block_tables.to(torch.int32).contiguous(), context_lens.to(torch.int32).contiguous()
    out = torch.empty((S, H, D), dtype=q.dtype, device=q.device)
    if S:
        _decode_kernel[(S, n_kv_head)](
            q, k_cache, v_cache, tables, lens, out,
            q.stride(0), q.stride(1), *k_cache.stride()[:3], *v_cache.stride()[:3], tables.stride(0),
            out.stride(0), out.stride(1), H // n_kv_head, block_size, scale,
            BLOCK_T=triton.next_power_of_2(block_size), REP=triton.next_power_of_2(H // n_kv_head), D=D,
            BLOCK_D=triton.next_power_of_2(D))
    return out


@paged_attention_op.register_fake
def _(q, k_cache, v_cache, block_tables, context_lens, scale):
    return q.new_empty(q.shape)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                    context_lens: torch.Tensor, scale: float | None = None, backend: str = "auto") -> torch.Tensor:
    """Attention of each sequence's one query token (q: sequences x heads x head_dim) over its first
    context_lens[s] cached tokens; (sequences, heads, head_dim) in q's dtype. Every context_lens[s] must be
    at least 1 and its blocks listed in block_tables[s]. Inference only: no backward."""
    _check(q, k_cache, v_cache, block_tables, context_lens)
    if not use_triton(backend, q, k_cache, v_cache):
        return reference(q, k_cache, v_cache, block_tables, context_lens, scale)
    return paged_attention_op(q, k_cache, v_cache, block_tables, context_lens,
                              1 / math.sqrt(q.size(2)) if scale is None else float(scale))
