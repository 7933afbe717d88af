"""4-bit NormalFloat storage (QLoRA, Dettmers et al. 2023) as bitsandbytes lays it out, and one Triton kernel
that turns it back into fp32/bf16/fp16 weights.

The format, for a weight of n elements taken flat in row-major order (`quantize_nf4`):
- `packed` (uint8, n/2): one 4-bit code per weight, two per byte, the even-indexed weight in the high nibble.
  A code picks one of the 16 NF4 values (`NF4`: quantiles of a normal distribution scaled to [-1, 1], with an
  exact 0), the nearest to weight / absmax of its block of BLOCK_SIZE = 64 weights.
- `absmax` (uint8, one per block): the block absmaxes double-quantised. Their mean is taken out (`absmax_offset`,
  float32), then each group of ABSMAX_BLOCK_SIZE = 256 of them is scaled by its own largest magnitude
  (`absmax_scale`, float32, one per group) and coded with bitsandbytes' signed 8-bit dynamic map (`DYNAMIC`).
So a weight costs 4 + 8/64 + 32/(64·256) bits ≈ 0.516 bytes. Against bitsandbytes 0.50 on CPU
(`quantize_4bit(w, blocksize=64, quant_type="nf4", compress_statistics=True)`, tests/test_kernel_nf4.py):
the 4-bit codes, the group scales and the offset are its bytes; each 8-bit absmax code is the nearest value of
its map, which its CPU binary search misses by a code or two for under 1 % of normal weights' absmaxes (more
around outliers); and `reference` gives `dequantize_4bit`'s values bit for bit from the same bytes: absmax =
DYNAMIC[code] · scale + offset and weight = NF4[nibble] · absmax, each product and sum rounded in float32 on
its own, then one cast to the output dtype.

The kernel (`dequantize_nf4`, backend "triton") does both levels in one launch with no intermediate buffer:
each program owns BYTES consecutive packed bytes (2·BYTES weights, 2·BYTES/64 absmax codes), reads them once,
looks its absmax codes, their group scales and the offset up, and writes its weights contiguously (the two
nibbles of a byte are interleaved in registers, so the store is one coalesced run). Weights are independent,
so there is nothing to reduce; the work is bandwidth: ~0.52 bytes in and 2 bytes (bf16) out per weight. 2048
bytes per program keeps 4k programs in flight on a 4096 x 11008 matrix, plenty for an H100's 132 SMs, each
program a long vectorised load and store. Floating-point fusion is off for the launch so the GPU computes the
same roundings as the reference (an FMA would round once where bitsandbytes rounds twice).

The Triton path is a `torch.library` custom op (`kiln::nf4_dequantize`) with a fake implementation, so
`torch.compile(fullgraph=True)` of a QLoRA model keeps it in the graph as one opaque call.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kiln.kernels.backend import use_triton

BLOCK_SIZE = 64
ABSMAX_BLOCK_SIZE = 256
BYTES = 2048  # packed bytes per program: see the module docstring
KEYS = ("packed", "absmax", "absmax_scale", "absmax_offset")

# The NF4 values as bitsandbytes stores them (QLoRA paper, appendix E), in float32.
NF4 = torch.tensor([-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
                    -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
                    0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
                    0.7229568362236023, 1.0], dtype=torch.float32)


def _dynamic_map() -> torch.Tensor:
    """bitsandbytes' signed dynamic 8-bit map (Dettmers 2015): for exponents 10^-6 .. 10^0, 2^i evenly spaced
    fractions in (0.1, 1) each way, plus 0 and 1; 256 values, sorted. Computed as bitsandbytes does (every
    product rounded in float32) so that the values are its own to the bit."""
    values = [0.0, 1.0]
    for i in range(7):
        edges = torch.linspace(0.1, 1, 2**i + 1, dtype=torch.float32)
        means = (edges[:-1] + edges[1:]) / 2.0
        values += (10.0 ** (i - 6) * means).tolist() + (-(10.0 ** (i - 6)) * means).tolist()
    return torch.tensor(sorted(values), dtype=torch.float32)


DYNAMIC = _dynamic_map()


def _blockwise_absmax(flat: torch.Tensor, block: int) -> torch.Tensor:
    """Largest magnitude of each run of `block` elements of the float32 vector `flat` (the last may be short)."""
    full = flat.numel() // block * block
    absmax = flat[:full].view(-1, block).abs().amax(dim=1)
    if full < flat.numel():
        absmax = torch.cat([absmax, flat[full:].abs().amax().view(1)])
    return absmax


def _scaled(flat: torch.Tensor, absmax: torch.Tensor, block: int) -> torch.Tensor:
    """Each element times 1 / its block's absmax, clamped to [-1, 1]; an all-zero block stays zero."""
    index = torch.arange(flat.numel(), device=flat.device) // block
    return (flat * (1.0 / absmax.clamp(min=1e-38))[index]).clamp(-1, 1)


def _nearest(values: torch.Tensor, code: torch.Tensor) -> torch.Tensor:
    """Index of the nearest entry of the sorted `code` (a tie goes to the upper one, as bitsandbytes)."""
    return torch.bucketize(values, (code[:-1] + code[1:]) / 2, out_int32=True).to(torch.uint8)


def quantize_nf4(weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """`weight` (float32, bfloat16 or float16, any shape with an even number of elements) in NF4 with
    double-quantised absmaxes: {"packed", "absmax", "absmax_scale", "absmax_offset"} (see the module docstring)."""
    if weight.numel() % 2 or weight.numel() == 0:
        raise ValueError(f"quantize_nf4: shape {tuple(weight.shape)}: expected a non-empty weight with an even "
                         f"number of elements (two 4-bit codes per byte)")
    if weight.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"quantize_nf4: dtype {weight.dtype}: expected float32, bfloat16 or float16")
    flat = weight.detach().reshape(-1).float()
    absmax = _blockwise_absmax(flat, BLOCK_SIZE)
    codes = _nearest(_scaled(flat, absmax, BLOCK_SIZE), NF4.to(flat.device))
    packed = (codes[0::2] << 4) | codes[1::2]
    offset = absmax.mean()
    centred = absmax - offset
    scale = _blockwise_absmax(centred, ABSMAX_BLOCK_SIZE)
    absmax_codes = _nearest(_scaled(centred, scale, ABSMAX_BLOCK_SIZE), DYNAMIC.to(flat.device))
    return {"packed": packed, "absmax": absmax_codes, "absmax_scale": scale, "absmax_offset": offset}


def _check(packed, absmax, absmax_scale, absmax_offset, shape) -> int:
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
    n = _check(packed, absmax, absmax_scale, absmax_offset, shape)
    device = packed.device
    groups = torch.arange(absmax.numel(), device=device) // ABSMAX_BLOCK_SIZE
    block_absmax = DYNAMIC.to(device)[absmax.long()] * absmax_scale[groups] + absmax_offset
    codes = torch.stack([packed >> 4, packed & 0xF], dim=1).reshape(-1).long()
    blocks = torch.arange(n, device=device) // BLOCK_SIZE
    return (NF4.to(device)[codes] * block_absmax[blocks]).to(dtype).reshape(shape)


@triton.jit
def _dequantize_kernel(packed_ptr, absmax_ptr, scale_ptr, offset_ptr, nf4_ptr, dynamic_ptr, out_ptr, n_bytes,
                       BYTES: tl.constexpr, BLOCK_SIZE: tl.constexpr, ABSMAX_BLOCK_SIZE: tl.constexpr,
                       OUT_BF16: tl.constexpr):
    byte = tl.program_id(0).to(tl.int64) * BYTES + tl.arange(0, BYTES)
    live = byte < n_bytes
    packed = tl.load(packed_ptr + byte, mask=live, other=0).to(tl.int32)
    block = byte // (BLOCK_SIZE // 2)  # both weights of a byte share a block: 64 is even
    code = tl.load(absmax_ptr + block, mask=live, other=0).to(tl.int32)
    scale = tl.load(scale_ptr + block // ABSMAX_BLOCK_SIZE, mask=live, other=0.0)
    block_absmax = tl.load(dynamic_ptr + code) * scale + tl.load(offset_ptr)
    high = tl.load(nf4_ptr + (packed >> 4)) * block_absmax
    low = tl.load(nf4_ptr + (packed & 0xF)) * block_absmax
    pair = tl.reshape(tl.join(high, low), (2 * BYTES,))  # weight 2j then 2j + 1: one contiguous run
    weight = 2 * tl.program_id(0).to(tl.int64) * BYTES + tl.arange(0, 2 * BYTES)
    if OUT_BF16:
        # Round to nearest even by hand: the interpreter's cast truncates, a GPU's rounds; this is both's.
        bits = pair.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        out = bits.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        out = pair.to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + weight, out, mask=weight < 2 * n_bytes)


@torch.library.custom_op("kiln::nf4_dequantize", mutates_args=())
def _dequantize_triton(packed: torch.Tensor, absmax: torch.Tensor, absmax_scale: torch.Tensor,
                       absmax_offset: torch.Tensor, shape: list[int], dtype: torch.dtype) -> torch.Tensor:
    n = _check(packed, absmax, absmax_scale, absmax_offset, shape)
    out = torch.empty(n, dtype=dtype, device=packed.device)
    tables = NF4.to(packed.device), DYNAMIC.to(packed.device)
    grid = (triton.cdiv(n // 2, BYTES),)
    _dequantize_kernel[grid](packed, absmax, absmax_scale, absmax_offset, *tables, out, n // 2, BYTES=BYTES,
                             BLOCK_SIZE=BLOCK_SIZE, ABSMAX_BLOCK_SIZE=ABSMAX_BLOCK_SIZE,
                             OUT_BF16=dtype == torch.bfloat16, enable_fp_fusion=False)
    return out.view(shape)


@_dequantize_triton.register_fake
def _(packed, absmax, absmax_scale, absmax_offset, shape, dtype):
    return packed.new_empty(shape, dtype=dtype)


def dequantize_nf4(packed: torch.Tensor, absmax: torch.Tensor, absmax_scale: torch.Tensor,
                   absmax_offset: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype,
                   backend: str = "auto") -> torch.Tensor:
    """The weight of `shape` in `dtype` from quantize_nf4's tensors: the Triton kernel for CUDA tensors (auto),
    or in the interpreter (triton), else the plain-torch reference."""
    if use_triton(backend, packed):
        return _dequantize_triton(packed, absmax, absmax_scale, absmax_offset.reshape(()), list(shape), dtype)
    return reference(packed, absmax, absmax_scale, absmax_offset, tuple(shape), dtype)
