"""NF4 storage against bitsandbytes (the library that defines the format) and the dequantisation kernel against
the torch reference, bit for bit: quantize_nf4's four tensors are bitsandbytes' bytes, the reference gives
dequantize_4bit's values, the kernel gives the reference's. Awkward shapes (a short last 64-block, a short last
256-group of absmaxes, one byte), awkward weights (all-zero and constant blocks, a huge outlier, absmaxes spread
over decades), every input and output dtype; the round-trip error bound; one graph under torch.compile; and the
one-line refusal of what cannot be packed."""

from __future__ import annotations

import pytest
import torch

import kiln.kernels.nf4
from kiln.kernels.nf4 import DYNAMIC, KEYS, NF4, dequantize_nf4, quantize_nf4, reference

from kernel_checks import DEVICE, on_gpu, poisoned_allocations

bnb = pytest.importorskip("bitsandbytes.functional")  # a dev dependency on Linux: present wherever CI runs

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
KINDS = ["normal", "extreme", "spread", "constant", "ties"]
# (5, 100): a short last block; (64, 1024): 1024 blocks, 4 absmax groups; (300, 128): 600 blocks, a short last
# group; (2, 30): less than one block.
SHAPES = [(3, 64), (5, 100), (1, 2), (64, 1024), (300, 128), (7, 96), (2, 30)]


def weight(shape, dtype, seed=0, kind="normal") -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(shape, generator=g) * 0.05
    flat = w.view(-1)
    if kind == "extreme":
        flat[:64] = 0  # an all-zero block (or the whole weight, if it is one block)
        flat[64:66] = 40.0  # an outlier that dwarfs its block and its absmax group
        flat[70:90] = 1e-7
        flat[-2:] = 0
    elif kind == "spread":  # block absmaxes over five decades: absmax codes near 0, where the map is finest
        decades = torch.rand(flat.numel() // 64 + 1, generator=g) * 5 - 4
        flat.mul_((10 ** decades).repeat_interleave(64)[:flat.numel()])
    elif kind == "constant":  # every block the same: every absmax equals their mean, up to its rounding
        flat.copy_(torch.linspace(-1, 1, 64).repeat(flat.numel() // 64 + 1)[:flat.numel()])
    elif kind == "ties":  # float32 weights on a knife edge, where bitsandbytes' order of operations picks the code
        flat.copy_(knife_edges(flat.numel()))
    return w.to(dtype)


def knife_edges(n: int) -> torch.Tensor:
    """A first block of absmax 1 holding the 15 midpoints between NF4 values (ties), and a last block of absmax 3
    holding weights x where x / 3 and x · (1 / 3) round to opposite sides of a midpoint (bitsandbytes divides in
    a short last block and multiplies by the inverse in whole ones)."""
    code = bnb.get_4bit_type("nf4", device="cpu")
    mid = (code[:-1] + code[1:]) / 2
    flat = torch.zeros(n)
    flat[:16] = torch.cat([torch.ones(1), mid])[:n]
    near = ((mid * 3.0).view(torch.int32)[:, None] + torch.arange(-64, 65)).view(torch.float32).reshape(-1)
    edges = near[torch.bucketize(near / 3.0, mid) != torch.bucketize(near * (1.0 / 3.0), mid)]
    last = n - (n % 64 or 64)
    if last >= 64:
        flat[last:last + 1 + len(edges)] = torch.cat([torch.full((1,), 3.0), edges])[:n - last]
    return flat


def bnb_quantize(w: torch.Tensor):
    return bnb.quantize_4bit(w, blocksize=64, quant_type="nf4", compress_statistics=True)


def test_tables_are_bitsandbytes_own():
    assert torch.equal(NF4, bnb.get_4bit_type("nf4", device="cpu"))
    assert torch.equal(DYNAMIC, bnb.create_dynamic_map())


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_quantize_gives_bitsandbytes_bytes(shape, dtype, kind):
    w = weight(shape, dtype, kind=kind)
    mine = quantize_nf4(w)
    q, state = bnb_quantize(w)
    assert list(mine) == list(KEYS)
    assert torch.equal(mine["packed"], q.flatten())
    assert torch.equal(mine["absmax"], state.absmax)
    assert torch.equal(mine["absmax_scale"], state.state2.absmax)
    assert torch.equal(mine["absmax_offset"], state.offset) and mine["absmax_offset"].dim() == 0


def test_absmax_codes_are_bitsandbytes_table_lookups_not_the_nearest_codes():
    """bitsandbytes' CPU code looks the 8-bit absmax codes up in a 65,536-point table; near 0 the map is finer
    than the table, so some codes are not the nearest. kiln's are bitsandbytes' there too, so a nearest-code
    implementation (a plausible rewrite) would fail here rather than drift from bitsandbytes unnoticed."""
    w = weight((256, 256), torch.float32, seed=5, kind="spread")
    mine, (_, state) = quantize_nf4(w), bnb_quantize(w)
    centred = w.view(-1, 64).abs().amax(dim=1) - state.offset
    scaled = centred.view(-1, 256) / state.state2.absmax[:, None]
    nearest = (scaled.reshape(-1, 1).double() - DYNAMIC.double()).abs().argmin(dim=1)
    assert torch.equal(mine["absmax"], state.absmax)
    assert (state.absmax.long() != nearest).any()


# (7, 96) is left out: bitsandbytes' AVX-512 CPU kernel looks absmaxes up per row, which is wrong when a block
# spans two rows (its scalar path, taken when a row is not a multiple of 16 weights, and CUDA's are flat).
@pytest.mark.parametrize("out", DTYPES)
@pytest.mark.parametrize("kind", ["spread", "extreme"])
@pytest.mark.parametrize("shape", [(3, 64), (5, 100), (1, 2), (64, 1024), (300, 128), (2, 30)])
def test_reference_gives_bitsandbytes_values(shape, kind, out):
    q, state = bnb_quantize(weight(shape, torch.float32, seed=1, kind=kind))
    state.dtype = out
    want = bnb.dequantize_4bit(q, state)
    if q.shape[0] == 1:  # one packed byte: bitsandbytes hands back the transpose (a GEMV convention)
        want = want.t()
    got = reference(q.flatten(), state.absmax, state.state2.absmax, state.offset, shape, out)
    assert got.dtype == out and torch.equal(got, want)


@pytest.mark.parametrize("out", DTYPES)
@pytest.mark.parametrize("shape", [(3, 64), (5, 100), (1, 2), (300, 128), (7, 96), (2, 30), (3, 64 * 65 + 10),
                                   *on_gpu((4096, 11008), (8192, 28672), single=True)])
def test_kernel_equals_reference_bit_for_bit(shape, out):
    """Fusion is off and bf16 rounds to nearest even, so the kernel's roundings are the reference's: equality,
    no tolerance. (3, 4170): 196 blocks, so several programs, the last part full and ending in a short block."""
    codes = {k: v.to(DEVICE) for k, v in quantize_nf4(weight(shape, torch.float32, seed=2, kind="extreme")).items()}
    want = reference(*(codes[k] for k in KEYS), shape, out)
    with poisoned_allocations():
        got = dequantize_nf4(*(codes[k] for k in KEYS), shape, out, backend="triton")
    assert got.shape == shape and got.dtype == out and not got.isnan().any()
    assert torch.equal(got, want)


@pytest.mark.parametrize("kind", ["normal", "spread"])
@pytest.mark.parametrize("shape", [(64, 256), (3, 64), (5, 100)])
def test_round_trip_error_is_within_half_a_code_gap_of_the_block_absmax(shape, kind):
    """w = s·a (a its block's absmax) comes back as c·a', c the NF4 value nearest s and a' the absmax decoded
    from 8 bits, so |c·a' - s·a| <= |c - s|·a + |c|·|a' - a| <= half the widest NF4 gap · a + |a' - a|. The
    second term is the absmax's 8-bit error, relative to its 256-group's spread: a block far below the mean can
    decode to a' < 0 ("spread" has such blocks)."""
    w = weight(shape, torch.float32, seed=3, kind=kind).reshape(-1)
    codes = quantize_nf4(w)
    back = reference(*(codes[k] for k in KEYS), (w.numel(),), torch.float32).double()
    true_absmax = torch.nn.functional.pad(w.abs(), (0, -w.numel() % 64)).view(-1, 64).amax(dim=1).double()
    stored_absmax = (DYNAMIC[codes["absmax"].long()].double()
                     * codes["absmax_scale"].double()[torch.arange(len(true_absmax)) // 256]
                     + codes["absmax_offset"].double())
    blocks = torch.arange(w.numel()) // 64
    half_gap = (NF4[1:] - NF4[:-1]).max().double() / 2
    bound = (half_gap * true_absmax + (stored_absmax - true_absmax).abs())[blocks] * (1 + 1e-6)
    error = (back - w.double()).abs()
    assert (error <= bound).all(), f"worst excess {(error - bound).max().item():.3g}"
    assert error.max() > 0  # lossy: 16 values cannot hold 64 random weights


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_compiles_in_one_graph(backend):
    codes = quantize_nf4(weight((4, 128), torch.float32, seed=4).to(DEVICE))

    def linear(x):
        return x @ dequantize_nf4(*(codes[k] for k in KEYS), (4, 128), torch.float32, backend=backend).T

    x = torch.randn(3, 128, device=DEVICE)
    explained = torch._dynamo.explain(linear)(x)
    assert explained.graph_break_count == 0, explained.break_reasons
    assert explained.graph_count == 1
    assert torch.equal(torch.compile(linear, backend="eager", fullgraph=True)(x), linear(x))


def test_auto_runs_the_kernel_only_on_cuda(monkeypatch):
    launched = []
    monkeypatch.setattr(kiln.kernels.nf4, "_launch", lambda *args: launched.append(args) or reference(*args))
    codes = quantize_nf4(weight((2, 64), torch.float32).to(DEVICE))
    dequantize_nf4(*(codes[k] for k in KEYS), (2, 64), torch.bfloat16)
    assert len(launched) == (1 if DEVICE.type == "cuda" else 0)
    dequantize_nf4(*(codes[k] for k in KEYS), (2, 64), torch.bfloat16, backend="triton")
    assert len(launched) == (2 if DEVICE.type == "cuda" else 1)


def test_refuses_what_cannot_be_packed():
    with pytest.raises(ValueError, match=r"shape \(3, 5\).*even number"):
        quantize_nf4(torch.randn(3, 5))
    with pytest.raises(ValueError, match="dtype torch.float64"):
        quantize_nf4(torch.randn(4, 4, dtype=torch.float64))
    codes = quantize_nf4(torch.randn(4, 64))
    with pytest.raises(ValueError, match=r"packed for shape \(8, 64\)"):
        dequantize_nf4(*(codes[k] for k in KEYS), (8, 64), torch.float32, backend="torch")
