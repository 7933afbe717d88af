"""Paged decode attention: the kernel against a float64 attention over each sequence's contiguous keys (built
apart from the paged reference), blocks scattered through the pool in random order, sequences of different
lengths in one launch (a partial last block, one token, a whole table), GQA, block sizes and head dims that
are not powers of two, and pool slots outside every context filled with NaN, which must never be read."""

from __future__ import annotations

import math

import pytest
import torch

from kiln.kernels.paged_attention import paged_attention, reference

from kernel_checks import DEVICE, assert_close, on_gpu, poisoned_allocations

DTYPES = [torch.float32, torch.bfloat16]


def scattered(lengths: list[int], H_kv: int, D: int, block_size: int, seed: int):
    """Contiguous keys/values per sequence, and the same written into a NaN pool through shuffled block tables."""
    g = torch.Generator().manual_seed(seed)
    blocks = [math.ceil(n / block_size) for n in lengths]
    pool_blocks = sum(blocks) + 3  # spare blocks that nobody owns
    order = torch.randperm(pool_blocks, generator=g).tolist()
    k_cache = torch.full((pool_blocks, block_size, H_kv, D), float("nan"), dtype=torch.float64)
    v_cache = torch.full_like(k_cache, float("nan"))
    tables = torch.zeros(len(lengths), max(blocks), dtype=torch.int32)
    keys, values = [], []
    for s, n in enumerate(lengths):
        k, v = torch.randn(n, H_kv, D, generator=g, dtype=torch.float64), torch.randn(n, H_kv, D, generator=g,
                                                                                    dtype=torch.float64)
        keys.append(k)
        values.append(v)
        for j in range(blocks[s]):
            tables[s, j] = block = order.pop()
            chunk = slice(j * block_size, min((j + 1) * block_size, n))
            k_cache[block, :chunk.stop - chunk.start] = k[chunk]
            v_cache[block, :chunk.stop - chunk.start] = v[chunk]
    return keys, values, k_cache, v_cache, tables


def plain_attention(q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor]) -> torch.Tensor:
    out = []
    for s, (k, v) in enumerate(zip(keys, values)):
        n_rep = q.size(1) // k.size(1)
        k, v = k.repeat_interleave(n_rep, dim=1), v.repeat_interleave(n_rep, dim=1)
        scores = torch.einsum("hd,lhd->hl", q[s], k) / math.sqrt(q.size(2))
        out.append(torch.einsum("hl,lhd->hd", scores.softmax(dim=-1), v))
    return torch.stack(out)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("lengths", "H", "H_kv", "D", "block_size"), [
    ([5, 1, 16, 23], 4, 2, 16, 8),      # a partial block, one token, exactly two blocks, GQA 2
    ([7, 12], 3, 3, 12, 5),             # MHA, head dim and block size not powers of two
    ([33], 8, 1, 32, 16),               # MQA: eight query heads on one kv head
    *on_gpu(([4096, 1, 700, 2049], 32, 8, 128, 16), ([1024] * 16, 12, 12, 64, 32)),
])
def test_paged_decode_matches_attention_over_contiguous_keys(lengths, H, H_kv, D, block_size, dtype):
    keys, values, k_cache, v_cache, tables = scattered(lengths, H_kv, D, block_size, seed=len(lengths) + D)
    q = torch.randn(len(lengths), H, D, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    expected = plain_attention(q, keys, values)
    assert_close(reference(q, k_cache, v_cache, tables, torch.tensor(lengths)), expected, torch.float32,
                 "reference")
    with poisoned_allocations():
        got = paged_attention(q.to(DEVICE, dtype), k_cache.to(DEVICE, dtype), v_cache.to(DEVICE, dtype),
                              tables.to(DEVICE), torch.tensor(lengths, device=DEVICE), backend="triton")
    assert got.dtype == dtype
    assert_close(got.cpu(), expected, dtype)


def test_auto_backend_runs_the_reference_on_cpu_and_bad_shapes_say_what_was_expected():
    keys, values, k_cache, v_cache, tables = scattered([3, 6], 2, 8, 4, seed=1)
    q = torch.randn(2, 4, 8, dtype=torch.float64)
    got = paged_attention(q, k_cache, v_cache, tables, torch.tensor([3, 6]))  # auto on CPU: the torch reference
    assert_close(got, plain_attention(q, keys, values), torch.float32)
    with pytest.raises(ValueError, match="heads a multiple of kv heads"):
        paged_attention(torch.randn(2, 3, 8), k_cache, v_cache, tables, torch.tensor([3, 6]))
    with pytest.raises(ValueError, match=r"expected \(2, max_blocks\) and \(2,\)"):
        paged_attention(q, k_cache, v_cache, tables[:1], torch.tensor([3, 6]))
