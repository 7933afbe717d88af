"""4-bit NormalFloat storage (QLoRA, Dettmers et al. 2023) byte for byte as bitsandbytes lays it out, and one
Triton kernel that turns it back into fp32/bf16/fp16 weights.

QLoRA keeps the frozen base in 4 bits a weight and dequantises each matrix just before its matmul, forward and
backward; that dequantisation is pure memory traffic, which is why it gets a kernel. The format, for a weight of
n elements taken flat in row-major order (`quantize_nf4`):
- `packed` (uint8, n/2): one 4-bit code per weight, two per byte, the even-indexed weight in the high nibble.
  A code picks one of the 16 NF4 values (`NF4`: quantiles of a normal distribution scaled to [-1, 1], with an
  exact 0), the nearest to weight / absmax of its block of BLOCK_SIZE = 64 weights (the last block may be short).
- `absmax` (uint8, one per block): the block absmaxes double-quantised. Their mean is taken out (`absmax_offset`,
  float32, 0-dim), then each group of ABSMAX_BLOCK_SIZE = 256 of them is divided by its own largest magnitude
  (`absmax_scale`, float32, one per group) and coded with bitsandbytes' signed 8-bit dynamic map (`DYNAMIC`).
So a weight costs 4 + 8/64 + 32/(64·256) bits ≈ 0.516 bytes.

Compared with bitsandbytes 0.50 on CPU (the version requirements.lock pins), `quantize_4bit(w, blocksize=64,
quant_type="nf4", compress_statistics=True)`, in tests/test_kernel_nf4.py: all four tensors are its bytes, for
float32, bfloat16 and float16 weights, down to the order of its roundings (whole blocks multiply by 1 / absmax,
a short last one divides). That includes its one shortcut: its CPU code takes an absmax's 8-bit code from a
table over 65,536 evenly spaced points of [-1, 1] (`_DYNAMIC_TABLE`) instead of searching the map, so near 0,
where the map's steps are finer than the table's, a code can be a neighbour of the nearest one; its error is at
most 2/65,535 of the group's scale more than the nearest code's. bitsandbytes on CUDA picks codes with searches
of its own, so its bytes can differ from these in places. Whatever the bytes, `reference` decodes them as
`dequantize_4bit` does, bit for bit: absmax = DYNAMIC[code] · scale + offset and weight = NF4[nibble] · absmax,
each product and sum rounded in float32 on its own, then one cast to the output dtype.

The kernel (`dequantize_nf4`, backend "triton") does both levels in one launch with no intermediate buffer.
The work is bandwidth, ~0.52 bytes in and 2 bytes (bf16) out per weight, with nothing to reduce, so the tiling
is about moving memory in wide, coalesced transactions and keeping every SM busy. Each program takes BLOCKS
consecutive 64-weight blocks as a (BLOCKS, 32) tile of packed bytes, 32 blocks for bf16/fp16 output and 16 for
fp32, spread over 8 warps so that every thread holds 4 (fp32: 2) consecutive bytes: one load of a contiguous
run per warp, and 8 (4) weights, which are 16 bytes, one vector store. The tile is sized for that: with more
bytes a thread, Triton shuffled the weights between threads through shared memory before storing them (checked
in the PTX for sm_90). A program decodes its blocks' absmaxes once (an 8-bit code, its group's scale, the
offset), looks both nibbles of each byte up in the 16-value table (64 bytes, so it stays in L1), multiplies
them by their block's absmax and interleaves them into the bytes' order. A 4096 x 11008 matrix is 22,016
programs in bf16 (~167 per H100 SM), a 8192 x 28672 one 114,688: many small programs in flight per SM hide the
memory latency. Masks are per block unless the last block is short, so the loads and stores stay vectorised.
Floating-point fusion is off for the launch so the GPU rounds as the reference does (an FMA would round once
where bitsandbytes rounds twice).

The Triton path is a `torch.library` custom op (`kiln::nf4_dequantize`) with a fake implementation, so
`torch.compile(fullgraph=True)` of a QLoRA model keeps it in the graph as one opaque call; eager code launches
the kernel directly, without the op's dispatch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kiln.kernels.backend import interpreting, use_triton

BLOCK_SIZE = 64  # weights per absmax
ABSMAX_BLOCK_SIZE = 256  # absmaxes per float32 scale
NUM_WARPS = 8  # a program's tile: see the module docstring
KEYS = ("packed", "absmax", "absmax_scale", "absmax_offset")

# The 16 NF4 values as bitsandbytes stores them in float32 (QLoRA paper, appendix E; bitsandbytes'
# get_4bit_type("nf4")).
NF4 = torch.tensor([-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
                    -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
                    0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
                    0.7229568362236023, 1.0], dtype=torch.float32)


def _dynamic_map() -> torch.Tensor:
    """bitsandbytes' signed dynamic 8-bit map (create_dynamic_map; Dettmers 2015, arXiv:1511.04561): for the
    exponents 10^-6 .. 10^0, 2^i evenly spaced fractions in (0.1, 1) each way, plus 0 and 1; 256 values, sorted.
    Every product is rounded in float32 as bitsandbytes rounds it, so the values are its own to the bit."""
    values = [0.0, 1.0]
    for i in range(7):
        edges = torch.linspace(0.1, 1, 2**i + 1, dtype=torch.float32)
        means = (edges[:-1] + edges[1:]) / 2.0
        values += (10.0 ** (i - 6) * means).tolist() + (-(10.0 ** (i - 6)) * means).tolist()
    return torch.tensor(sorted(values), dtype=torch.float32)


DYNAMIC = _dynamic_map()


# bitsandbytes' CPU kernel takes the 8-bit code of x in [-1, 1] from a table instead of searching DYNAMIC: entry i
# holds the code nearest to -1 + 2i/65535 (in float32 as its C++ computes it; a midpoint counts for the lower
# code), and x reads the entry of the point nearest to it.
_TABLE_STEPS = 2**16 - 1
_DYNAMIC_TABLE = torch.searchsorted((DYNAMIC[:-1] + DYNAMIC[1:]) * 0.5,
                                    -1.0 + (2.0 * torch.arange(_TABLE_STEPS + 1, dtype=torch.float32)) / _TABLE_STEPS
                                    ).to(torch.uint8)
# bitsandbytes divides by max(absmax, 1e-38) so that an all-zero block scales to zeros instead of NaN.
_TINY = 1e-38


def _nf4_codes(flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """4-bit codes and float32 block absmaxes of the float32 vector `flat`, with bitsandbytes' roundings: whole
    blocks multiply by 1 / absmax, a short last block divides by its absmax (stored at least _TINY)."""
    full = flat.numel() // BLOCK_SIZE * BLOCK_SIZE
    blocks = flat[:full].view(-1, BLOCK_SIZE)
    absmax = blocks.abs().amax(dim=1)
    scaled = (blocks * (1.0 / absmax.clamp(min=_TINY))[:, None]).reshape(-1)
    if full < flat.numel():
        tail = flat[full:].abs().amax().clamp(min=_TINY)
        absmax = torch.cat([absmax, tail.view(1)])
        scaled = torch.cat([scaled, flat[full:] / tail])
    nf4 = NF4.to(flat.device)
    codes = torch.bucketize(scaled.clamp(-1, 1), (nf4[:-1] + nf4[1:]) / 2, out_int32=True)  # a tie goes down
    return codes.to(torch.uint8), absmax


def _absmax_codes(centred: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """8-bit codes and float32 group scales of the centred absmaxes, as bitsandbytes' CPU kernel makes them:
    x · (1 / scale), clamped to [-1, 1], rounded to the nearest of _DYNAMIC_TABLE's points, that point's code;
    a group that is all zero gets scale 0 and code 0."""
    n = centred.numel()
    groups = torch.nn.functional.pad(centred, (0, -n % ABSMAX_BLOCK_SIZE)).view(-1, ABSMAX_BLOCK_SIZE)
    scale = groups.abs().amax(dim=1)
    zero = scale == 0  # such a group holds only zeros, which a scale of 1 leaves alone
    scaled = (groups * (1.0 / torch.where(zero, 1.0, scale))[:, None]).clamp(-1, 1)
    point = ((scaled + 1) * 0.5 * _TABLE_STEPS + 0.5).to(torch.int32)  # truncates, as C's cast does
    codes = _DYNAMIC_TABLE.to(centred.device)[point.long()]
    codes = torch.where(zero[:, None], 0, codes).to(torch.uint8)
    return codes.reshape(-1)[:n], scale


def quantize_nf4(weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """`weight` (float32, bfloat16 or float16, any shape with an even number of elements) in NF4 with
    double-quantised absmaxes, on its own device: {"packed", "absmax", "absmax_scale", "absmax_offset"} (see the
    module docstring), bitsandbytes' bytes (on a GPU the absmaxes' mean can round differently in its last bit)."""
    if weight.numel() % 2 or weight.numel() == 0:
        raise ValueError(f"quantize_nf4: shape {tuple(weight.shape)}: expected a non-empty weight with an even "
                         f"number of elements (two 4-bit codes per byte)")
    if weight.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"quantize_nf4: dtype {weight.dtype}: expected float32, bfloat16 or float16")
    codes, absmax = _nf4_codes(weight.detach().reshape(-1).float())
    offset = absmax.mean()
    absmax_codes, scale = _absmax_codes(absmax - offset)
    return {"packed": (codes[0::2] << 4) | codes[1::2], "absmax": absmax_codes, "absmax_scale": scale,
            "absmax_offset": offset}


def _numel(packed, absmax, absmax_scale, absmax_offset, shape) -> int:
    """The weight's element count, once every tensor is checked to be what quantize_nf4 makes for `shape`."""
    n = 1
    for size in shape:
        n *= size
    blocks = -(-n // BLOCK_SIZE)
    want = {"packed": (packed, torch.uint8, n // 2), "absmax": (absmax, torch.uint8, blocks),
            "absmax_scale": (absmax_scale, torch.float32, -(-blocks // ABSMAX_BLOCK_SIZE)),
            "absmax_offset": (absmax_offset, torch.float32, 1)}
    for name, (t, dtype, numel) in want.items():
        if t.dtype != dtype or t.numel() != numel:
            raise ValueError(f"dequantize_nf4: {name} for shape {tuple(shape)}: expected {numel} x {dtype}, got "
                             f"{t.numel()} x {t.dtype}")
    return n


def reference(packed: torch.Tensor, absmax: torch.Tensor, absmax_scale: torch.Tensor, absmax_offset: torch.Tensor,
              shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Both levels in plain torch, in float32, then cast to `dtype`."""
    n = _numel(packed, absmax, absmax_scale, absmax_offset, shape)
    device = packed.device
    groups = torch.arange(absmax.numel(), device=device) // ABSMAX_BLOCK_SIZE
    block_absmax = DYNAMIC.to(device)[absmax.long()] * absmax_scale[groups] + absmax_offset
    codes = torch.stack([packed >> 4, packed & 0xF], dim=1).reshape(-1).long()
    blocks = torch.arange(n, device=device) // BLOCK_SIZE
    return (NF4.to(device)[codes] * block_absmax[blocks]).to(dtype).reshape(shape)


@triton.jit
def _dequantize_kernel(packed_ptr, absmax_ptr, scale_ptr, offset_ptr, dynamic_ptr, nf4_ptr, out_ptr, n_bytes,
                       BLOCKS: tl.constexpr, BLOCK_SIZE: tl.constexpr, ABSMAX_BLOCK_SIZE: tl.constexpr,
                       WHOLE_BLOCKS: tl.constexpr, ROUND_BF16_BY_HAND: tl.constexpr):
    # 64-bit only for where this program starts; offsets inside its tile fit 32 bits, which keeps the per-element
    # index arithmetic single-word.
    first = tl.program_id(0).to(tl.int64) * BLOCKS
    bytes_left = tl.minimum(n_bytes - first * (BLOCK_SIZE // 2), BLOCKS * (BLOCK_SIZE // 2)).to(tl.int32)
    row = tl.arange(0, BLOCKS)
    live = row * (BLOCK_SIZE // 2) < bytes_left
    code = tl.load(absmax_ptr + first + row, mask=live, other=0).to(tl.int32)
    scale = tl.load(scale_ptr + (first + row) // ABSMAX_BLOCK_SIZE, mask=live, other=0.0)
    block_absmax = (tl.load(dynamic_ptr + code) * scale + tl.load(offset_ptr))[:, None]
    byte = row[:, None] * (BLOCK_SIZE // 2) + tl.arange(0, BLOCK_SIZE // 2)[None, :]
    # A mask that is constant along a block keeps the loads and stores vectorised (a thread's 4 bytes in one load,
    # its 16 bytes of weights in one store); only a weight whose last block is short needs one per byte.
    byte_live = live[:, None] if WHOLE_BLOCKS else byte < bytes_left
    packed = tl.load(packed_ptr + first * (BLOCK_SIZE // 2) + byte, mask=byte_live, other=0).to(tl.int32)
    high = tl.load(nf4_ptr + (packed >> 4)) * block_absmax
    low = tl.load(nf4_ptr + (packed & 0xF)) * block_absmax
    weights = tl.interleave(high, low)  # (BLOCKS, BLOCK_SIZE): weight 2j, then 2j + 1, as the bytes hold them
    if ROUND_BF16_BY_HAND:
        # The interpreter's float32 -> bfloat16 cast truncates; a GPU's, like torch's, rounds to nearest even.
        bits = weights.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        out = bits.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        out = weights.to(out_ptr.dtype.element_ty)
    index = row[:, None] * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)[None, :]
    weight_live = live[:, None] if WHOLE_BLOCKS else index < 2 * bytes_left
    tl.store(out_ptr + first * BLOCK_SIZE + index, out, mask=weight_live)


_TABLES: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}


def _launch(packed: torch.Tensor, absmax: torch.Tensor, absmax_scale: torch.Tensor, absmax_offset: torch.Tensor,
            shape: list[int], dtype: torch.dtype) -> torch.Tensor:
    n = _numel(packed, absmax, absmax_scale, absmax_offset, shape)
    if packed.device not in _TABLES:  # copied to the device once, not on every call
        _TABLES[packed.device] = DYNAMIC.to(packed.device), NF4.to(packed.device)
    out = torch.empty(n, dtype=dtype, device=packed.device)
    # Each thread's bytes decode to one 16-byte store: 4 bytes (8 weights) for a 2-byte dtype, 2 for fp32.
    blocks = NUM_WARPS * 32 * (8 // out.element_size()) // (BLOCK_SIZE // 2)
    grid = (triton.cdiv(absmax.numel(), blocks),)
    _dequantize_kernel[grid](packed, absmax, absmax_scale, absmax_offset, *_TABLES[packed.device], out, n // 2,
                             BLOCKS=blocks, BLOCK_SIZE=BLOCK_SIZE, ABSMAX_BLOCK_SIZE=ABSMAX_BLOCK_SIZE,
                             WHOLE_BLOCKS=n % BLOCK_SIZE == 0,
                             ROUND_BF16_BY_HAND=interpreting() and dtype == torch.bfloat16,
                             num_warps=NUM_WARPS, enable_fp_fusion=False)
    return out.view(shape)


@torch.library.custom_op("kiln::nf4_dequantize", mutates_args=())
def _dequantize_op(packed: torch.Tensor, absmax: torch.Tensor, absmax_scale: torch.Tensor,
                   absmax_offset: torch.Tensor, shape: list[int], dtype: torch.dtype) -> torch.Tensor:
    return _launch(packed, absmax, absmax_scale, absmax_offset, shape, dtype)


@_dequantize_op.register_fake
def _(packed, absmax, absmax_scale, absmax_offset, shape, dtype):
    return packed.new_empty(shape, dtype=dtype)


def dequantize_nf4(packed: torch.Tensor, absmax: torch.Tensor, absmax_scale: torch.Tensor,
                   absmax_offset: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype,
                   backend: str = "auto") -> torch.Tensor:
    """The weight of `shape` in `dtype` from quantize_nf4's tensors: the Triton kernel for CUDA tensors (auto),
    or in the interpreter (triton), else the plain-torch reference."""
    if not use_triton(backend, packed):
        return reference(packed, absmax, absmax_scale, absmax_offset, tuple(shape), dtype)
    # Under torch.compile the op keeps the launch in the graph; eagerly it would only add dispatch time.
    launch = _dequantize_op if torch.compiler.is_compiling() else _launch
    return launch(packed, absmax, absmax_scale, absmax_offset, list(shape), dtype)
