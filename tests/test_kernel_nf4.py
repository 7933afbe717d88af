"""NF4 storage against bitsandbytes (the library that defines the format) and the dequantisation kernel against
the torch reference, bit for bit; awkward shapes (a partial 64-block, a partial 256-group of absmaxes, one
byte), extreme blocks (all zero, one huge outlier), every output dtype; the round-trip error bound; one graph
under torch.compile; and the one-line refusal of what cannot be packed."""

from __future__ import annotations

import pytest
import torch

from kiln.kernels.nf4 import DYNAMIC, KEYS, NF4, dequantize_nf4, quantize_nf4, reference

from kernel_checks import DEVICE, on_gpu, poisoned_allocations

bnb = pytest.importorskip("bitsandbytes.functional")  # a dev dependency on Linux: present wherever CI runs

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
SHAPES = [(3, 64), (5, 100), (1, 2), (64, 1024), (300, 128), (7, 96)]  # (64, 1024): 1024 blocks, 4 groups


def weight(shape, dtype, seed=0, kind="normal") -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(shape, generator=g) * 0.05
    flat = w.view(-1)
    if kind == "extreme" and flat.numel() >= 128:
        flat[:64] = 0  # an all-zero block
        flat[64] = 40.0  # one outlier dwarfs its block and its absmax group
        flat[70:90] = 1e-7
    return w.to(dtype)


def bnb_quantize(w: torch.Tensor):
    q, state = bnb.quantize_4bit(w, blocksize=64, quant_type="nf4", compress_statistics=True)
    return q, state


@pytest.mark.parametrize("kind", ["normal", "extreme"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_quantize_gives_bitsandbytes_bytes(shape, dtype, kind):
    """Codes, group scales and offset are bitsandbytes' bytes. Its 8-bit absmax codes come from a C binary
    search on CPU that can land one code away from the nearest; kiln takes the nearest of bitsandbytes' map
    (checked by brute force here, as bitsandbytes' own fallback path computes it: argmin of the distance)."""
    w = weight(shape, dtype, kind=kind)
    mine = quantize_nf4(w)
    q, state = bnb_quantize(w)
    assert torch.equal(mine["packed"], q.flatten())
    assert torch.equal(mine["absmax_scale"], state.state2.absmax)
    assert torch.equal(mine["absmax_offset"], state.offset)
    flat = w.float().reshape(-1)
    blocks = torch.stack([flat[i:i + 64].abs().max() for i in range(0, flat.numel(), 64)])
    centred = blocks - state.offset
    scale = torch.stack([centred[i:i + 256].abs().max() for i in range(0, len(centred), 256)])
    scaled = (centred * (1.0 / scale.clamp(min=1e-38)).repeat_interleave(256)[:len(centred)]).clamp(-1, 1)
    nearest = (scaled.double()[:, None] - bnb.create_dynamic_map().double()[None]).abs().argmin(dim=1)
    assert torch.equal(mine["absmax"].long(), nearest)
    off = (mine["absmax"] != state.absmax).nonzero().flatten()
    # Where bitsandbytes' search missed, kiln's code is the closer one (a group whose absmaxes are all equal has
    # scale 0, where every code decodes to the offset and bitsandbytes' 0/0 picks code 0).
    code = bnb.create_dynamic_map().double()
    mine_err = (code[mine["absmax"][off].long()] - scaled[off].double()).abs()
    bnb_err = (code[state.absmax[off].long()] - scaled[off].double()).abs()
    assert ((mine_err <= bnb_err) | (scale[off // 256] == 0)).all()
    if kind == "normal":
        assert len(off) <= max(1, len(blocks) // 100), f"{len(off)} of {len(blocks)} absmax codes differ"


@pytest.mark.parametrize("out", DTYPES)
@pytest.mark.parametrize("shape", [(3, 64), (64, 1024), (300, 128), (16, 4160)])
def test_reference_gives_bitsandbytes_values(shape, out):
    """Dequantising bitsandbytes' own bytes: the same values in every output dtype. (Rows of whole 64-blocks, as
    kiln quantises them: bitsandbytes' CPU kernel gives other values when a block spans two rows.)"""
    q, state = bnb_quantize(weight(shape, torch.float32, seed=1))
    state.dtype = out
    want = bnb.dequantize_4bit(q, state)
    got = reference(q.flatten(), state.absmax, state.state2.absmax, state.offset, shape, out)
    assert got.dtype == out and torch.equal(got, want)


@pytest.mark.parametrize("out", DTYPES)
@pytest.mark.parametrize("shape", [(3, 64), (5, 100), (1, 2), (300, 128), (7, 96), (2, 4097 * 2),
                                   *on_gpu((4096, 11008), (8192, 28672))])
def test_kernel_equals_reference_bit_for_bit(shape, out):
    """Fusion is off and bf16 rounds to nearest even by hand, so the kernel's roundings are the reference's."""
    codes = {k: v.to(DEVICE) for k, v in quantize_nf4(weight(shape, torch.float32, seed=2, kind="extreme")).items()}
    want = reference(*(codes[k] for k in KEYS), shape, out)
    with poisoned_allocations():
        got = dequantize_nf4(*(codes[k] for k in KEYS), shape, out, backend="triton")
    assert got.shape == shape and got.dtype == out and not got.isnan().any()
    assert torch.equal(got, want)


@pytest.mark.parametrize("shape", [(64, 256), (3, 64)])
def test_round_trip_error_is_within_half_a_code_gap_of_the_block_absmax(shape):
    """Each weight comes back within half the widest gap between NF4 values times its block's absmax (plus the
    absmax's own 8-bit error), never further: what nearest-value coding promises."""
    w = weight(shape, torch.float32, seed=3).double().reshape(-1)
    codes = quantize_nf4(w.float())
    back = reference(*(codes[k] for k in KEYS), (w.numel(),), torch.float32).double()
    block_absmax = w.view(-1, 64).abs().amax(dim=1).repeat_interleave(64)
    stored_absmax = (DYNAMIC[codes["absmax"].long()].double() * codes["absmax_scale"].double()[0]
                     + codes["absmax_offset"].double()).repeat_interleave(64)
    half_gap = (NF4[1:] - NF4[:-1]).max().double() / 2
    bound = half_gap * stored_absmax + (stored_absmax - block_absmax).abs() + 1e-7
    assert ((back - w).abs() <= bound).all()
    assert (back - w).abs().max() > 0  # lossy: 16 values cannot hold 64 random weights


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_compiles_in_one_graph(backend):
    codes = quantize_nf4(weight((4, 128), torch.float32, seed=4))

    def linear(x):
        return x @ dequantize_nf4(*(codes[k] for k in KEYS), (4, 128), torch.float32, backend=backend).T

    x = torch.randn(3, 128)
    explained = torch._dynamo.explain(linear)(x)
    assert explained.graph_break_count == 0, explained.break_reasons
    assert torch.equal(torch.compile(linear, backend="eager", fullgraph=True)(x), linear(x))


def test_refuses_what_cannot_be_packed():
    with pytest.raises(ValueError, match=r"shape \(3, 5\).*even number"):
        quantize_nf4(torch.randn(3, 5))
    with pytest.raises(ValueError, match="dtype torch.float64"):
        quantize_nf4(torch.randn(4, 4, dtype=torch.float64))
    codes = quantize_nf4(torch.randn(4, 64))
    with pytest.raises(ValueError, match="packed for shape \\(8, 64\\)"):
        dequantize_nf4(*(codes[k] for k in KEYS), (8, 64), torch.float32, backend="torch")
