"""FlashAttention kernels: output and q/k/v gradients against float64 plain-torch attention, with GQA/MQA head
counts, causal and full masks, sequences that end inside a block, head dims 16/24/64/128, strided inputs, and
unequal forward/backward tiles.

In the interpreter the kernels use 16-row tiles, so T=17 is one full block plus a one-row block and T=129 is
eight full blocks plus one row: every test crosses block boundaries and the causal diagonal. The interpreter
is slow for attention (T=129 costs seconds per case), so T=129 runs only with D=16 and few head counts. On a
GPU (128/64-row tiles) the main test also runs a real model's attention: T up to 2048, D 64 and 128, MHA and
GQA, and sequences of 1000 and 1531 that end inside a block.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import triton

import kiln.kernels.flash_attention as fa
from kiln.kernels.flash_attention import flash_attention, reference

from kernel_checks import DEVICE, assert_close, on_gpu, poisoned_allocations, record_launches

DTYPES = [torch.float32, torch.bfloat16]


def inputs(B, H, H_kv, T, D, dtype, seed=0, device=DEVICE):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, T, D, generator=g).to(device, dtype)
    k = torch.randn(B, H_kv, T, D, generator=g).to(device, dtype)
    v = torch.randn(B, H_kv, T, D, generator=g).to(device, dtype)
    do = torch.randn(B, H, T, D, generator=g).to(device, dtype)
    return q, k, v, do


def check_against_reference(q, k, v, do, causal, dtype, scale=None, grad_scale=1.0, segments=None):
    """Triton output and all three gradients vs the float64 reference on the same (rounded) values."""
    want_inputs = [x.detach().double().requires_grad_() for x in (q, k, v)]
    want = reference(*want_inputs, causal=causal, scale=scale, segments=segments)
    want_grads = torch.autograd.grad(want, want_inputs, do.double())

    q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
    with poisoned_allocations():
        got = flash_attention(q, k, v, causal=causal, scale=scale, backend="triton", segments=segments)
        got_grads = torch.autograd.grad(got, (q, k, v), do)
    assert got.dtype == dtype
    assert_close(got, want, dtype, "o")
    for name, g, w in zip(("dq", "dk", "dv"), got_grads, want_grads):
        assert_close(g, w, dtype, name, scale=grad_scale)


# bf16 gradients: P and dS are rounded to bf16 before their matmuls (as on tensor cores), and dQ/dK/dV are sums
# of those rounded terms (dK, dV over every query row of every head in the kv head's group), with cancellation,
# so an element's error follows the size of its terms rather than its own size. Measured worst case over these
# shapes and two seeds: 1.2x the bf16 tolerance (dK, MQA with 4 heads); at the GPU-only shapes, run in the
# interpreter with the GPU's tiles, 1.06x (dQ, T=2048). 2x leaves room for the GPU's different accumulation
# order. The bf16 output and every fp32 result pass unscaled (fp32 worst: 0.13x; 0.23x at the GPU shapes).
GRAD_SCALE = {torch.float32: 1.0, torch.bfloat16: 2.0}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("B,H,H_kv,T,D,causal", [
    (1, 2, 1, 1, 16, True),       # a single position: one partial block
    (2, 4, 2, 17, 16, True),      # GQA, one full and one one-row block
    (1, 3, 3, 17, 16, False),     # plain multi-head, no mask: the padded keys alone must be masked
    (1, 4, 1, 17, 24, True),      # MQA; head dim not a power of two (padded to 32, masked)
    (1, 2, 1, 129, 16, True),     # nine blocks: every causal block pattern, last block one row
    (1, 1, 1, 129, 16, False),
    (1, 2, 1, 17, 64, True),
    (1, 4, 2, 17, 128, False),
    (1, 2, 2, 17, 128, True),
    *on_gpu(
        (2, 12, 12, 1024, 64, True),  # GPT-2 small's attention
        (2, 12, 12, 2048, 64, True),
        (2, 32, 8, 2048, 128, True),  # Llama-style GQA
        (2, 12, 12, 1531, 64, True),  # ends inside a block of every tile size
        (1, 32, 8, 1000, 128, False),  # full mask, GQA
    ),
])
def test_matches_reference(B, H, H_kv, T, D, causal, dtype):
    check_against_reference(*inputs(B, H, H_kv, T, D, dtype), causal, dtype, grad_scale=GRAD_SCALE[dtype])


@pytest.mark.parametrize("causal", [True, False])
def test_custom_scale(causal):
    check_against_reference(*inputs(1, 2, 1, 17, 16, torch.float32), causal, torch.float32, scale=0.3)


@pytest.mark.parametrize("wide", [(32, 16), (16, 32)], ids=["more_rows", "more_keys"])
def test_unequal_tiles(monkeypatch, wide):
    """On a GPU BLOCK_M != BLOCK_N (forward 128 query rows x 64 keys); here every kernel gets unequal tiles both
    ways round, so the causal loop ends of the forward and dQ kernels are computed with a key block that starts
    inside a query block's rows (more rows) and one that runs past them (more keys), and the dK/dV programs walk
    query blocks that start at their first key rather than on a multiple of BLOCK_M."""
    tiles = [triton.Config({"BLOCK_M": m, "BLOCK_N": n}) for m, n in (wide, wide[::-1])]
    for kernel, config in ((fa._forward_kernel, tiles[0]), (fa._dkdv_kernel, tiles[1]), (fa._dq_kernel, tiles[1])):
        monkeypatch.setattr(kernel, "configs", [config])
    for causal in (True, False):
        check_against_reference(*inputs(1, 4, 2, 57, 16, torch.float32), causal, torch.float32)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_strided_inputs(dtype):
    """The model's layout: (B, T, H, D) projections transposed to (B, H, T, D) without a copy; v also a slice of
    a wider tensor, and the upstream gradient a transpose, so every stride the kernels take is exercised."""
    B, H, H_kv, T, D = 2, 4, 2, 17, 16
    q, k, v, do = inputs(B, H, H_kv, T, D, dtype)
    q, k, do = (x.transpose(1, 2).contiguous().transpose(1, 2) for x in (q, k, do))
    v = torch.cat((v, v), dim=-1)[..., D:]
    assert not any(x.is_contiguous() for x in (q, k, v, do))
    check_against_reference(q, k, v, do, True, dtype, grad_scale=GRAD_SCALE[dtype])


def test_reference_matches_sdpa():
    """The reference itself against torch's scaled_dot_product_attention, in float64 (GQA by repeating k/v)."""
    q, k, v, _ = inputs(2, 4, 2, 33, 16, torch.float64)
    for causal in (True, False):
        want = F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1),
                                              is_causal=causal)
        torch.testing.assert_close(reference(q, k, v, causal), want, atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_torch_backend_is_reference(dtype):
    q, k, v, do = inputs(2, 4, 2, 9, 16, dtype)
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    got, want = flash_attention(q, k, v, backend="torch"), reference(q, k, v)
    torch.testing.assert_close(got, want, atol=0, rtol=0)
    for a, b in zip(torch.autograd.grad(got, (q, k, v), do), torch.autograd.grad(want, (q, k, v), do)):
        torch.testing.assert_close(a, b, atol=0, rtol=0)


@pytest.mark.parametrize("device", ["cpu", *on_gpu("cuda")])
def test_auto_uses_kernels_only_on_cuda(monkeypatch, device):
    launched = record_launches(monkeypatch, fa, "flash_attention_op")
    q, k, v, _ = inputs(1, 2, 1, 5, 16, torch.float32, device=device)
    assert_close(flash_attention(q, k, v, causal=False), reference(q.double(), k.double(), v.double(), causal=False),
                 torch.float32)
    assert bool(launched) == (device == "cuda")


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_bad_inputs(backend):
    q, k, v, _ = inputs(1, 4, 2, 5, 16, torch.float32)
    with pytest.raises(ValueError, match="must divide"):
        flash_attention(q, k[:, :1].expand(1, 3, 5, 16), v[:, :1].expand(1, 3, 5, 16), backend=backend)
    with pytest.raises(ValueError, match="must both be"):
        flash_attention(q, k[:, :, :4], v[:, :, :4], backend=backend)
    with pytest.raises(ValueError, match="share a dtype"):
        flash_attention(q, k.double(), v.double(), backend=backend)
    with pytest.raises(ValueError, match=r"\(B, H, T, D\)"):
        flash_attention(q[0], k[0], v[0], backend=backend)


def segment_ids(B, T, bounds_per_row):
    """(B, T) int32 segment ids from each row's segment starts (packed documents; the rest of a row one segment)."""
    out = torch.zeros(B, T, dtype=torch.int32)
    for b, starts in enumerate(bounds_per_row):
        for i, start in enumerate(starts):
            out[b, start:] = i + 1
    return out.to(DEVICE)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("B,H,H_kv,T,D,causal,starts", [
    (2, 4, 2, 33, 16, True, [[5, 16, 17, 30], [20]]),  # documents ending inside, at and across 16-row blocks
    (1, 2, 1, 33, 24, False, [[1, 32]]),                 # full attention within segments, one-token ones
    (1, 2, 2, 17, 16, True, [[]]),                       # one segment: plain causal attention
])
def test_segments_match_reference_and_one_call_per_document(B, H, H_kv, T, D, causal, starts, dtype):
    """Packed documents (`segments`): each token attends within its own segment only. Against the float64
    reference with the segment mask, and the reference against one attention per document, so a key block that
    holds no key a row may see (the row's max still -inf) is covered."""
    segments = segment_ids(B, T, starts)
    q, k, v, do = inputs(B, H, H_kv, T, D, dtype, seed=3)
    check_against_reference(q, k, v, do, causal, dtype, grad_scale=GRAD_SCALE[dtype], segments=segments)
    q64, k64, v64 = (x.double() for x in (q, k, v))
    whole = reference(q64, k64, v64, causal=causal, segments=segments)
    for b in range(B):
        cuts = [0, *starts[b], T]
        for lo, hi in zip(cuts, cuts[1:]):
            alone = reference(q64[b:b + 1, :, lo:hi], k64[b:b + 1, :, lo:hi], v64[b:b + 1, :, lo:hi], causal=causal)
            torch.testing.assert_close(whole[b:b + 1, :, lo:hi], alone, rtol=1e-12, atol=1e-12)


def test_segments_of_the_wrong_shape_are_refused():
    q, k, v, _ = inputs(1, 2, 1, 8, 16, torch.float32)
    with pytest.raises(ValueError, match=r"segments must be \(B, T\) = \(1, 8\)"):
        flash_attention(q, k, v, segments=torch.zeros(1, 9, dtype=torch.int32, device=DEVICE), backend="triton")
