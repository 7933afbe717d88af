"""Causal (or full) attention without the (T, T) score matrix: FlashAttention-2 forward and backward.

Eager attention writes the scores, the probabilities and, for backward, keeps both: O(T^2) memory per head and
several passes over it. Here one program owns a block of query rows of one (batch, head) and streams the key
and value blocks past it, keeping a running row max and row sum in fp32 (online softmax) so the probabilities
are rescaled instead of stored; with `causal`, key blocks wholly above the diagonal are never loaded, and
those wholly below it (and inside the sequence) go without masks, so only the diagonal and a sequence's last
partial block pay for them (forward and dQ: on an H200 the forward 1.31x faster for it; the dK/dV kernel keeps
one masked loop, since the same split made it 1.2x slower there). Forward saves only the output O and the
per-row log-sum-exp L (fp32, natural log): with L, backward recomputes any block of probabilities exactly as
P = exp(S - L), so nothing of size T^2 is kept.

Backward follows FA-2: a small kernel first computes delta = rowsum(dO * O), the softmax-gradient term that
every key block of a row needs. Then one program per (batch, kv head, key block) holds its K and V blocks and
its dK and dV accumulators in registers while it loops over query blocks; a separate program per (batch, head,
query block) recomputes the same probabilities to accumulate dQ. That recomputes P twice but needs no atomics
and no fp32 dQ buffer, and the result is deterministic.

GQA: query head h reads kv head h // (H // H_kv) (HF's repeat_kv layout) through the index alone; k and v are
never repeated in memory. The dK/dV program of a kv head loops over its group's query heads itself, so their
contributions are summed in registers: no (B, H, T, D) fp32 buffer (which would cost the memory GQA saves)
and no extra reduction pass, at the price of fewer, longer programs (B * H_kv * T / BLOCK_N of them, still
hundreds at training shapes).

Inputs are read through their batch/head/time strides, so the model's (B, T, H, D) -> (B, H, T, D) transposes
need no copy; outputs and gradients take their input's layout (torch.empty_like). fp32 inputs use IEEE fp32
products unless torch allows TF32 matmuls (`torch.set_float32_matmul_precision`), as torch's matmul would.

Packed rows (`segments`, (B, T) int32: the document each token belongs to, `train.doc_mask`): a query sees only
keys of its own segment, as if each document were a sequence of its own. The mask is one compare per score,
taken in every key block (interior ones too); a block wholly of other documents is still loaded, not skipped.
A row's first key blocks may then hold no key it sees, so the online softmax guards its running max there.

Out of scope: attention dropout, and queries offset from the keys (KV-cache decoding, where the causal diagonal
is aligned bottom-right); the model keeps SDPA for those.

Layering: the kernels; the custom ops `kiln::flash_attention` (O and L) and `kiln::flash_attention_backward`
(dQ, dK, dV), one opaque node each under `torch.compile`; `flash_attention`, which checks the arguments and
picks kernels or reference. Tiles, warps and pipeline stages are the GPU's to time among a few candidates
(keyed on head dim, causality and T's next power of two, so a new sequence length tunes again only when it
crosses a power of two).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kiln.kernels.backend import interpreting, use_triton
from kiln.kernels.launch import autotune

# log2(e): scores are exponentiated with exp2, so they are kept in log2 units inside the kernels.
LOG2E = tl.constexpr(1.4426950408889634)

# (BLOCK_M query rows, BLOCK_N key rows) per program, warps and software-pipeline stages. Large tiles feed the
# tensor cores; backward keeps two extra fp32 (BLOCK_N, D) accumulators per program, so its tiles are smaller. A
# candidate that does not fit shared memory is skipped by the tuner. The first of each list was the hand-picked
# setting. In the interpreter, 16-row tiles make small test sequences span several blocks, a partial one too.
FORWARD_CONFIGS = [triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=st)
                   for m, n, w, st in ((128, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 3), (64, 64, 4, 3),
                                       (128, 32, 4, 4), (64, 32, 4, 4))]
BACKWARD_CONFIGS = [triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=st)
                    for m, n, w, st in ((64, 64, 4, 2), (64, 64, 8, 2), (32, 64, 4, 2), (64, 128, 8, 2),
                                        (128, 64, 8, 2), (32, 32, 4, 3))]
INTERPRETER_CONFIG = triton.Config({"BLOCK_M": 16, "BLOCK_N": 16})
TUNING_KEY = ["D", "CAUSAL", "T_BUCKET", "SEGMENTS"]
DELTA_ROWS = 64  # rows per program of the backward's small rowsum(dO * O) kernel

# Triton's interpreter stores bfloat16 as raw uint16 and its tl.dot multiplies the bit patterns
# (triton-lang/triton#11584), so interpreted dots take fp32 operands. A bf16 x bf16 product is exact in fp32, so
# this is the tensor cores' arithmetic, not a looser one. Read when the module is imported, as Triton does.
F32_DOT_OPERANDS = tl.constexpr(interpreting())


@triton.jit
def _dot(a, b, PRECISION: tl.constexpr):
    if F32_DOT_OPERANDS:
        a, b = a.to(tl.float32), b.to(tl.float32)
    return tl.dot(a, b, input_precision=PRECISION)


@triton.jit
def _load_rows(ptrs, rows, cols, T, D: tl.constexpr, BLOCK_D: tl.constexpr, MASKED: tl.constexpr):
    """A (rows, BLOCK_D) tile. Unmasked tiles lie wholly inside the sequence, so with a power-of-two head dim
    their loads carry no mask at all and vectorize."""
    if MASKED:
        return tl.load(ptrs, mask=(rows[:, None] < T) & (cols[None, :] < D), other=0.0)
    if BLOCK_D == D:
        return tl.load(ptrs)
    return tl.load(ptrs, mask=cols[None, :] < D, other=0.0)


@triton.jit
def _key_block(q, k_ptrs, v_ptrs, start_n, offs_n, rows, cols, T, sk_t, sv_t, qk_scale, seg_q, seg_row,
               D: tl.constexpr, BLOCK_D: tl.constexpr, CAUSAL: tl.constexpr, PRECISION: tl.constexpr,
               MASKED: tl.constexpr, SEGMENTS: tl.constexpr):
    """The key/value block at start_n and the scaled scores of the query rows against it; a masked block's
    invisible scores (keys past T, or above the causal diagonal) are -inf, and with SEGMENTS every block's scores
    against keys of another segment than the row's (`seg_q`; the keys' read from `seg_row`)."""
    keys = start_n + offs_n
    k = _load_rows(k_ptrs + start_n * sk_t, keys, cols, T, D, BLOCK_D, MASKED)
    v = _load_rows(v_ptrs + start_n * sv_t, keys, cols, T, D, BLOCK_D, MASKED)
    s = _dot(q, tl.trans(k), PRECISION) * qk_scale
    if MASKED:
        visible = keys[None, :] < T
        if CAUSAL:
            visible = visible & (keys[None, :] <= rows[:, None])
        s = tl.where(visible, s, float("-inf"))
    if SEGMENTS:
        seg_k = tl.load(seg_row + keys, mask=keys < T, other=-1)
        s = tl.where(seg_q[:, None] == seg_k[None, :], s, float("-inf"))
    return k, v, s


@triton.jit
def _interior_end(start_m, T, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr):
    """Where a query block's key loop stops needing masks: key blocks before it are inside the sequence and,
    with `causal`, wholly left of the block's first row, so every row sees all of their keys."""
    if CAUSAL:
        return (start_m // BLOCK_N) * BLOCK_N
    return (T // BLOCK_N) * BLOCK_N


@triton.jit
def _online_softmax(acc, m_i, l_i, s, v, PRECISION: tl.constexpr, SEGMENTS: tl.constexpr):
    """Fold one block of scores (log2 units) into the running max, sum and output."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    if SEGMENTS:  # a row that has seen no key of its segment yet: its max is still -inf
        m_new = tl.where(m_new == float("-inf"), -1e30, m_new)
    p = tl.exp2(s - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, PRECISION)
    return acc, m_new, l_i


@autotune(FORWARD_CONFIGS, key=TUNING_KEY, interpreter=INTERPRETER_CONFIG)
@triton.jit
def _forward_kernel(q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, seg_ptr,
                    sq_b, sq_h, sq_t, sk_b, sk_h, sk_t, sv_b, sv_h, sv_t, so_b, so_h, so_t,
                    H, T, T_BUCKET, GROUP, qk_scale,
                    D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    CAUSAL: tl.constexpr, PRECISION: tl.constexpr, SEGMENTS: tl.constexpr):
    start_m = tl.program_id(0) * BLOCK_M
    bh = tl.program_id(1)
    # int64 offsets: B*H*T*D passes 2**31 at long contexts.
    b, h = (bh // H).to(tl.int64), (bh % H).to(tl.int64)
    kv_h = h // GROUP
    rows = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    cols = tl.arange(0, BLOCK_D)
    row_mask = (rows[:, None] < T) & (cols[None, :] < D)
    q = tl.load(q_ptr + b * sq_b + h * sq_h + rows[:, None] * sq_t + cols[None, :], mask=row_mask, other=0.0)
    k_ptrs = k_ptr + b * sk_b + kv_h * sk_h + offs_n[:, None] * sk_t + cols[None, :]
    v_ptrs = v_ptr + b * sv_b + kv_h * sv_h + offs_n[:, None] * sv_t + cols[None, :]
    seg_row = seg_ptr + b * T
    seg_q = rows
    if SEGMENTS:
        seg_q = tl.load(seg_row + rows, mask=rows < T, other=-2)

    # Without segments every row, padding rows included, sees key 0 in the first block, so the running max is
    # finite from then on and exp2 never sees -inf - -inf (with them, _online_softmax guards it). Interior key blocks skip the masks; the diagonal and the sequence's
    # last partial block take them.
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    interior = _interior_end(start_m, T, BLOCK_N, CAUSAL)
    end = T
    if CAUSAL:
        end = tl.minimum(T, start_m + BLOCK_M)
    for start_n in range(0, interior, BLOCK_N):
        k, v, s = _key_block(q, k_ptrs, v_ptrs, start_n, offs_n, rows, cols, T, sk_t, sv_t, qk_scale, seg_q,
                             seg_row, D, BLOCK_D, CAUSAL, PRECISION, False, SEGMENTS)
        acc, m_i, l_i = _online_softmax(acc, m_i, l_i, s, v, PRECISION, SEGMENTS)
    for start_n in range(interior, end, BLOCK_N):
        k, v, s = _key_block(q, k_ptrs, v_ptrs, start_n, offs_n, rows, cols, T, sk_t, sv_t, qk_scale, seg_q,
                             seg_row, D, BLOCK_D, CAUSAL, PRECISION, True, SEGMENTS)
        acc, m_i, l_i = _online_softmax(acc, m_i, l_i, s, v, PRECISION, SEGMENTS)

    o = (acc / l_i[:, None]).to(o_ptr.dtype.element_ty)
    tl.store(o_ptr + b * so_b + h * so_h + rows[:, None] * so_t + cols[None, :], o, mask=row_mask)
    lse = (m_i + tl.log2(l_i)) / LOG2E  # back to natural log
    tl.store(lse_ptr + bh.to(tl.int64) * T + rows, lse, mask=rows < T)


@triton.jit
def _delta_kernel(o_ptr, do_ptr, delta_ptr, so_b, so_h, so_t, sdo_b, sdo_h, sdo_t, H, T,
                  D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    bh = tl.program_id(1)
    b, h = (bh // H).to(tl.int64), (bh % H).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    mask = (rows[:, None] < T) & (cols[None, :] < D)
    o = tl.load(o_ptr + b * so_b + h * so_h + rows[:, None] * so_t + cols[None, :], mask=mask, other=0.0)
    do = tl.load(do_ptr + b * sdo_b + h * sdo_h + rows[:, None] * sdo_t + cols[None, :], mask=mask, other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    tl.store(delta_ptr + bh.to(tl.int64) * T + rows, delta, mask=rows < T)


@autotune(BACKWARD_CONFIGS, key=TUNING_KEY, interpreter=INTERPRETER_CONFIG)
@triton.jit
def _dkdv_kernel(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dk_ptr, dv_ptr, seg_ptr,
                 sq_b, sq_h, sq_t, sk_b, sk_h, sk_t, sv_b, sv_h, sv_t, sdo_b, sdo_h, sdo_t,
                 sdk_b, sdk_h, sdk_t, sdv_b, sdv_h, sdv_t,
                 H, T, T_BUCKET, GROUP, qk_scale, scale,
                 D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 CAUSAL: tl.constexpr, PRECISION: tl.constexpr, SEGMENTS: tl.constexpr):
    start_n = tl.program_id(0) * BLOCK_N
    bkv = tl.program_id(1)
    H_kv = H // GROUP
    b, kv_h = (bkv // H_kv).to(tl.int64), (bkv % H_kv).to(tl.int64)
    keys = start_n + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_D)
    key_mask = (keys[:, None] < T) & (cols[None, :] < D)
    k = tl.load(k_ptr + b * sk_b + kv_h * sk_h + keys[:, None] * sk_t + cols[None, :], mask=key_mask, other=0.0)
    v = tl.load(v_ptr + b * sv_b + kv_h * sv_h + keys[:, None] * sv_t + cols[None, :], mask=key_mask, other=0.0)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    seg_row = seg_ptr + b * T
    seg_k = keys
    if SEGMENTS:
        seg_k = tl.load(seg_row + keys, mask=keys < T, other=-1)
    # Causal: query rows before this block's first key see none of its keys, so the query blocks start there
    # (they need not line up with the forward's query blocks: every row is masked on its own).
    first = 0
    if CAUSAL:
        first = start_n
    for g in range(GROUP):
        h = kv_h * GROUP + g
        q_ptrs = q_ptr + b * sq_b + h * sq_h + offs_m[:, None] * sq_t + cols[None, :]
        do_ptrs = do_ptr + b * sdo_b + h * sdo_h + offs_m[:, None] * sdo_t + cols[None, :]
        lse_ptrs, delta_ptrs = lse_ptr + (b * H + h) * T + offs_m, delta_ptr + (b * H + h) * T + offs_m
        for start_m in range(first, T, BLOCK_M):
            rows = start_m + offs_m
            row_mask = (rows[:, None] < T) & (cols[None, :] < D)
            q = tl.load(q_ptrs + start_m * sq_t, mask=row_mask, other=0.0)
            do = tl.load(do_ptrs + start_m * sdo_t, mask=row_mask, other=0.0)
            lse = tl.load(lse_ptrs + start_m, mask=rows < T, other=0.0) * LOG2E
            delta = tl.load(delta_ptrs + start_m, mask=rows < T, other=0.0)
            # Transposed tiles (keys x queries), so dK and dV accumulate without transposing P.
            s_t = _dot(k, tl.trans(q), PRECISION) * qk_scale
            visible = (keys[:, None] < T) & (rows[None, :] < T)
            if CAUSAL:
                visible = visible & (keys[:, None] <= rows[None, :])
            if SEGMENTS:
                visible = visible & (seg_k[:, None] == tl.load(seg_row + rows, mask=rows < T, other=-2)[None, :])
            p_t = tl.exp2(tl.where(visible, s_t - lse[None, :], float("-inf")))
            dv += _dot(p_t.to(do.dtype), do, PRECISION)
            dp_t = _dot(v, tl.trans(do), PRECISION)
            ds_t = p_t * (dp_t - delta[None, :])
            dk += _dot(ds_t.to(q.dtype), q, PRECISION)
    dk_ptrs = dk_ptr + b * sdk_b + kv_h * sdk_h + keys[:, None] * sdk_t + cols[None, :]
    dv_ptrs = dv_ptr + b * sdv_b + kv_h * sdv_h + keys[:, None] * sdv_t + cols[None, :]
    tl.store(dk_ptrs, (dk * scale).to(dk_ptr.dtype.element_ty), mask=key_mask)
    tl.store(dv_ptrs, dv.to(dv_ptr.dtype.element_ty), mask=key_mask)


@triton.jit
def _dq_block(dq, q, do, lse, delta, k_ptrs, v_ptrs, start_n, offs_n, rows, cols, T, sk_t, sv_t, qk_scale, seg_q,
              seg_row, D: tl.constexpr, BLOCK_D: tl.constexpr, CAUSAL: tl.constexpr, PRECISION: tl.constexpr,
              MASKED: tl.constexpr, SEGMENTS: tl.constexpr):
    """dQ's sum over one key block: the probabilities recomputed from L, then dS = P * (dP - delta)."""
    k, v, s = _key_block(q, k_ptrs, v_ptrs, start_n, offs_n, rows, cols, T, sk_t, sv_t, qk_scale, seg_q, seg_row,
                         D, BLOCK_D, CAUSAL, PRECISION, MASKED, SEGMENTS)
    p = tl.exp2(s - lse[:, None])
    dp = _dot(do, tl.trans(v), PRECISION)
    ds = p * (dp - delta[:, None])
    return dq + _dot(ds.to(k.dtype), k, PRECISION)


@autotune(BACKWARD_CONFIGS, key=TUNING_KEY, interpreter=INTERPRETER_CONFIG)
@triton.jit
def _dq_kernel(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr, seg_ptr,
               sq_b, sq_h, sq_t, sk_b, sk_h, sk_t, sv_b, sv_h, sv_t, sdo_b, sdo_h, sdo_t, sdq_b, sdq_h, sdq_t,
               H, T, T_BUCKET, GROUP, qk_scale, scale,
               D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               CAUSAL: tl.constexpr, PRECISION: tl.constexpr, SEGMENTS: tl.constexpr):
    start_m = tl.program_id(0) * BLOCK_M
    bh = tl.program_id(1)
    b, h = (bh // H).to(tl.int64), (bh % H).to(tl.int64)
    kv_h = h // GROUP
    rows = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    cols = tl.arange(0, BLOCK_D)
    row_mask = (rows[:, None] < T) & (cols[None, :] < D)
    q = tl.load(q_ptr + b * sq_b + h * sq_h + rows[:, None] * sq_t + cols[None, :], mask=row_mask, other=0.0)
    do = tl.load(do_ptr + b * sdo_b + h * sdo_h + rows[:, None] * sdo_t + cols[None, :], mask=row_mask, other=0.0)
    lse = tl.load(lse_ptr + bh.to(tl.int64) * T + rows, mask=rows < T, other=0.0) * LOG2E
    delta = tl.load(delta_ptr + bh.to(tl.int64) * T + rows, mask=rows < T, other=0.0)
    k_ptrs = k_ptr + b * sk_b + kv_h * sk_h + offs_n[:, None] * sk_t + cols[None, :]
    v_ptrs = v_ptr + b * sv_b + kv_h * sv_h + offs_n[:, None] * sv_t + cols[None, :]
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    seg_row = seg_ptr + b * T
    seg_q = rows
    if SEGMENTS:
        seg_q = tl.load(seg_row + rows, mask=rows < T, other=-2)
    interior = _interior_end(start_m, T, BLOCK_N, CAUSAL)
    end = T
    if CAUSAL:
        end = tl.minimum(T, start_m + BLOCK_M)
    for start_n in range(0, interior, BLOCK_N):
        dq = _dq_block(dq, q, do, lse, delta, k_ptrs, v_ptrs, start_n, offs_n, rows, cols, T, sk_t, sv_t, qk_scale,
                       seg_q, seg_row, D, BLOCK_D, CAUSAL, PRECISION, False, SEGMENTS)
    for start_n in range(interior, end, BLOCK_N):
        dq = _dq_block(dq, q, do, lse, delta, k_ptrs, v_ptrs, start_n, offs_n, rows, cols, T, sk_t, sv_t, qk_scale,
                       seg_q, seg_row, D, BLOCK_D, CAUSAL, PRECISION, True, SEGMENTS)
    dq_ptrs = dq_ptr + b * sdq_b + h * sdq_h + rows[:, None] * sdq_t + cols[None, :]
    tl.store(dq_ptrs, (dq * scale).to(dq_ptr.dtype.element_ty), mask=row_mask)


def _precision(dtype: torch.dtype) -> str:
    """tl.dot's input_precision: it only changes fp32 products; "tf32" is Triton's own default for the rest."""
    return "ieee" if dtype == torch.float32 and torch.get_float32_matmul_precision() == "highest" else "tf32"


def _strides(x: torch.Tensor) -> tuple[int, int, int]:
    return x.stride(0), x.stride(1), x.stride(2)


def _unit_last_stride(x: torch.Tensor) -> torch.Tensor:
    """The kernels step along D with stride 1 (vector loads); copy only a tensor that does not."""
    return x if x.stride(-1) == 1 else x.contiguous()


def _block_d(D: int) -> int:
    # Head dims that are not powers of two are padded (and masked); tl.dot needs at least 16 along K.
    return max(16, triton.next_power_of_2(D))


def _grid(blocks: str, T: int, programs: int):
    return lambda meta: (triton.cdiv(T, meta[blocks]), programs)


def _segments(segments: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    """The kernels' segment ids: contiguous int32 (B, T), or a placeholder they never read."""
    if segments is None:
        return like.new_empty(0, dtype=torch.int32)
    return segments.to(torch.int32).contiguous()


@torch.library.custom_op("kiln::flash_attention", mutates_args=())
def flash_attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                       scale: float, segments: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(O in q's layout and dtype; L, the rows' natural-log log-sum-exp, fp32 (B, H, T))."""
    q, k, v = (_unit_last_stride(x) for x in (q, k, v))
    B, H, T, D = q.shape
    o = torch.empty_like(q)
    lse = torch.empty((B, H, T), dtype=torch.float32, device=q.device)
    if q.numel() == 0:
        return o, lse
    _forward_kernel[_grid("BLOCK_M", T, B * H)](
        q, k, v, o, lse, _segments(segments, q), *_strides(q), *_strides(k), *_strides(v), *_strides(o),
        H, T, triton.next_power_of_2(T), H // k.size(1), scale * LOG2E.value,
        D=D, BLOCK_D=_block_d(D), CAUSAL=causal, PRECISION=_precision(q.dtype), SEGMENTS=segments is not None)
    return o, lse


@flash_attention_op.register_fake
def _(q, k, v, causal, scale, segments=None):
    B, H, T, _ = q.shape
    return torch.empty_like(_unit_last_stride(q)), q.new_empty((B, H, T), dtype=torch.float32)


@torch.library.custom_op("kiln::flash_attention_backward", mutates_args=())
def flash_attention_backward_op(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
                                lse: torch.Tensor, causal: bool, scale: float,
                                segments: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dQ, dK, dV), each in its input's layout and dtype."""
    q, k, v, do = (_unit_last_stride(x) for x in (q, k, v, do))
    B, H, T, D = q.shape
    H_kv = k.size(1)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    if q.numel() == 0:
        return dq, dk, dv
    block_d = _block_d(D)
    delta = torch.empty_like(lse)
    _delta_kernel[(triton.cdiv(T, DELTA_ROWS), B * H)](
        o, do, delta, *_strides(o), *_strides(do), H, T, D=D, BLOCK_D=block_d, BLOCK_M=DELTA_ROWS)
    common = {"D": D, "BLOCK_D": block_d, "CAUSAL": causal, "PRECISION": _precision(q.dtype),
              "SEGMENTS": segments is not None}
    sizes = (H, T, triton.next_power_of_2(T), H // H_kv, scale * LOG2E.value, scale)
    seg = _segments(segments, q)
    _dkdv_kernel[_grid("BLOCK_N", T, B * H_kv)](
        q, k, v, do, lse, delta, dk, dv, seg, *_strides(q), *_strides(k), *_strides(v), *_strides(do),
        *_strides(dk), *_strides(dv), *sizes, **common)
    _dq_kernel[_grid("BLOCK_M", T, B * H)](
        q, k, v, do, lse, delta, dq, seg, *_strides(q), *_strides(k), *_strides(v), *_strides(do), *_strides(dq),
        *sizes, **common)
    return dq, dk, dv


@flash_attention_backward_op.register_fake
def _(do, q, k, v, o, lse, causal, scale, segments=None):
    return tuple(torch.empty_like(_unit_last_stride(x)) for x in (q, k, v))


def _setup_context(ctx, inputs, output):
    q, k, v, causal, scale, segments = inputs
    ctx.save_for_backward(q, k, v, *output, segments)
    ctx.causal, ctx.scale = causal, scale


def _backward(ctx, do, _dlse):
    *tensors, segments = ctx.saved_tensors
    dq, dk, dv = flash_attention_backward_op(do, *tensors, ctx.causal, ctx.scale, segments)
    return dq, dk, dv, None, None, None


flash_attention_op.register_autograd(_backward, setup_context=_setup_context)


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True,
              scale: float | None = None, segments: torch.Tensor | None = None) -> torch.Tensor:
    """Plain torch: softmax(q k^T * scale, causal mask) v, with k and v repeated per query head for GQA; with
    `segments` (B, T), scores between tokens of different segments masked too."""
    T, D = q.shape[-2:]
    scale = D ** -0.5 if scale is None else scale
    group = q.size(1) // k.size(1)
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    compute = torch.promote_types(q.dtype, torch.float32)  # fp32 for bf16/fp16, float64 stays float64
    s = (q @ k.transpose(-2, -1)).to(compute) * scale
    if causal:
        above = torch.ones(T, T, dtype=torch.bool, device=q.device).triu(1)
        s = s.masked_fill(above, float("-inf"))
    if segments is not None:
        s = s.masked_fill((segments[:, None, :, None] != segments[:, None, None, :]), float("-inf"))
    return s.softmax(dim=-1).to(v.dtype) @ v


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"q, k, v must be (B, H, T, D), got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    B, H, T, D = q.shape
    if k.shape != v.shape or k.size(0) != B or k.size(2) != T or k.size(3) != D:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must both be (B, H_kv, T, D) "
                         f"with q's B, T, D {tuple(q.shape)}")
    if k.size(1) == 0 or H % k.size(1):
        raise ValueError(f"kv heads {k.size(1)} must divide query heads {H}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")


def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True,
                    scale: float | None = None, backend: str = "auto",
                    segments: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of q (B, H, T, D) over k, v (B, H_kv, T, D), H_kv dividing H; returns (B, H, T, D) in q's dtype.

    Query head h attends with kv head h // (H // H_kv). `scale` multiplies the scores (default 1/sqrt(D));
    `causal` lets position i see keys 0..i only; `segments` (B, T) integers: position i sees only keys of its own
    segment (packed documents).
    """
    _check(q, k, v)
    if segments is not None and segments.shape != (q.size(0), q.size(2)):
        raise ValueError(f"segments must be (B, T) = {(q.size(0), q.size(2))}, got {tuple(segments.shape)}")
    scale = q.size(-1) ** -0.5 if scale is None else float(scale)
    if use_triton(backend, q, k, v):
        return flash_attention_op(q, k, v, causal, scale, segments)[0]
    return reference(q, k, v, causal, scale, segments)
