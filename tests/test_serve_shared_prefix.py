"""Cascade decode attention (serve/shared_prefix.py) against plain attention over each whole context, float64."""

import math

import numpy as np
import pytest
import torch

from kiln.pipeline.serve import shared_prefix


def reference(queries, k, v, tables, lens, block_size):
    """Each row's softmax(q k^T / sqrt(D)) v over its first lens[i] positions, read through its block table."""
    N, H, D = queries.shape
    rep = H // k.size(1)
    out = torch.empty(N, H, D, dtype=torch.float64)
    for i in range(N):
        positions = np.arange(lens[i])
        slots = torch.as_tensor(tables[i, positions // block_size] * block_size + positions % block_size)
        keys = k[slots].double().repeat_interleave(rep, dim=1)  # (L, H, D)
        values = v[slots].double().repeat_interleave(rep, dim=1)
        scores = torch.einsum("hd,lhd->hl", queries[i].double(), keys) / math.sqrt(D)
        out[i] = torch.einsum("hl,lhd->hd", scores.softmax(-1), values)
    return out


def shared_tables(rng, groups, block_size, blocks, system=0):
    """Block tables for groups of rows: every row opens with the same `system` blocks, a group's rows then with
    the same `shared` blocks (a random number, some none), then blocks of their own; each row's length somewhere
    in its last block."""
    tables, lens, next_block = [], [], system
    width = system + max(s + own for _, s, own in groups)
    for size, shared, own in groups:
        prefix = list(range(system)) + list(range(next_block, next_block + shared))
        next_block += shared
        for _ in range(size):
            table = prefix + list(range(next_block, next_block + own))
            next_block += own
            tables.append(table + [0] * (width - len(table)))
            lens.append(int(rng.integers((len(table) - 1) * block_size + 1, len(table) * block_size + 1)))
    assert next_block <= blocks
    return np.array(tables, dtype=np.int64), np.array(lens, dtype=np.int64)


@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (6, 2), (3, 1)])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_cascade_equals_attention_over_the_whole_context(heads, kv_heads, seed, monkeypatch):
    monkeypatch.setattr(shared_prefix, "MIN_ROWS", 2)  # some draws have fewer rows than the engine's threshold
    rng = np.random.default_rng(seed)
    torch.manual_seed(seed)
    block_size, D = int(rng.choice([4, 16])), int(rng.choice([8, 12]))
    # groups (rows, shared blocks, own blocks): GRPO-like groups, a pair sharing one block, singletons; each row
    # ends somewhere in its last own block (a row ending inside shared blocks: the test below)
    groups = [(int(rng.integers(2, 9)), int(rng.integers(3, 7)), int(rng.integers(1, 3))) for _ in range(5)]
    groups += [(2, 1, 1), (1, 0, 2), (1, 0, 1)]
    system = int(rng.integers(0, 3))  # a system prompt every row opens with, or none
    blocks = system + sum(size * own + shared for size, shared, own in groups)
    tables, lens = shared_tables(rng, groups, block_size, blocks, system)
    perm = rng.permutation(len(lens))  # groups' rows interleaved, as a batch's arrival order has them
    tables, lens = tables[perm], lens[perm]
    # slots outside every context hold NaN, as a freed block's may: no padding may read them
    outside = torch.ones(blocks * block_size, dtype=torch.bool)
    for table, length in zip(tables, lens):
        positions = np.arange(length)
        outside[table[positions // block_size] * block_size + positions % block_size] = False
    k = torch.randn(blocks * block_size, kv_heads, D).masked_fill(outside[:, None, None], math.nan)
    v = torch.randn(blocks * block_size, kv_heads, D).masked_fill(outside[:, None, None], math.nan)
    queries = torch.randn(len(lens), heads, D)
    arrays = shared_prefix.plan(tables, lens, block_size)
    assert arrays is not None
    got = shared_prefix.attend(queries.double(), k.double(), v.double(),
                               {name: torch.as_tensor(a) for name, a in arrays.items()})
    torch.testing.assert_close(got, reference(queries, k, v, tables, lens, block_size), rtol=1e-10, atol=1e-10)
    # in float32 (the cache's dtype on a CPU), as the engine runs it
    got = shared_prefix.attend(queries, k, v, {name: torch.as_tensor(a) for name, a in arrays.items()})
    torch.testing.assert_close(got.double(), reference(queries, k, v, tables, lens, block_size), rtol=1e-5,
                               atol=1e-5)


def test_groups_share_only_blocks_every_row_fills(monkeypatch):
    """Three rows agree on two blocks, but the third's context ends inside the second: the first two share both,
    the third goes alone with its one full block."""
    monkeypatch.setattr(shared_prefix, "WORTH", 1.0)  # this small case would keep the plain path
    monkeypatch.setattr(shared_prefix, "MIN_ROWS", 2)
    tables = np.array([[5, 6, 7], [5, 6, 8], [5, 6, 9]], dtype=np.int64)
    lens = np.array([40, 40, 20], dtype=np.int64)  # block size 16
    arrays = shared_prefix.plan(tables, lens, 16)
    assert arrays["groups"].tolist() == [[0, 1], [2, 2]] and arrays["places"].tolist() == [0, 1, 2]
    assert arrays["prefix_lens"].tolist() == [32, 16] and arrays["suffix_lens"].tolist() == [8, 8, 4]
    assert arrays["prefix_slots"][0].tolist() == list(range(80, 112))
    assert arrays["prefix_slots"][1].tolist() == list(range(80, 96)) + [80] * 16  # padded with its first slot
    assert arrays["suffix_slots"][2].tolist() == [96, 97, 98, 99] + [99] * 4


def test_a_system_prompt_shared_by_groups_splits_them_at_their_own_prompts(monkeypatch):
    """Two groups of samples and two lone prompts behind one system prompt (block 0): each group shares its
    whole prompt, the lone ones the system prompt."""
    monkeypatch.setattr(shared_prefix, "WORTH", 1.0)
    monkeypatch.setattr(shared_prefix, "MIN_ROWS", 2)
    tables = np.array([[0, 1, 2, 10], [0, 5, 20, 0], [0, 1, 2, 11], [0, 3, 4, 12], [0, 3, 4, 13], [0, 6, 21, 0],
                       [0, 1, 2, 14]])
    lens = np.array([50, 40, 50, 50, 50, 40, 50])
    arrays = shared_prefix.plan(tables, lens, 16)
    groups = {tuple(sorted(set(g))): length for g, length in zip(arrays["groups"].tolist(), arrays["prefix_lens"])}
    assert groups == {(0, 2, 6): 48, (3, 4): 48, (1, 5): 16}


def test_grpo_shaped_batches_take_the_cascade():
    """64 prompts x 8 samples a few tokens into their completions share most of their context."""
    block_size, tables, lens = 16, [], []
    for g in range(64):
        prompt = list(range(g * 100, g * 100 + 6))  # 6 full prompt blocks
        for j in range(8):
            tables.append(prompt + [10_000 + 8 * g + j])
            lens.append(6 * block_size + 5)
    arrays = shared_prefix.plan(np.array(tables), np.array(lens), block_size)
    assert arrays is not None and arrays["groups"].shape == (64, 8)
    assert (arrays["prefix_lens"] == 96).all() and (arrays["suffix_lens"] == 5).all()


def test_nothing_shared_keeps_the_plain_path():
    n = 2 * shared_prefix.MIN_ROWS
    lens = np.full(n, 30)
    assert shared_prefix.plan(np.arange(2 * n).reshape(n, 2), lens, 16) is None  # no block in common
    # rows sharing their first block of long contexts: the saving is too small to pay
    tables = np.array([[0, 4 * i + 1, 4 * i + 2, 4 * i + 3] for i in range(n)])
    assert shared_prefix.plan(tables, np.full(n, 64), 16) is None
    # the same rows sharing three blocks pay, but not below MIN_ROWS rows
    tables[:, 1:3] = [1, 2]
    assert shared_prefix.plan(tables, np.full(n, 64), 16) is not None
    assert shared_prefix.plan(tables[:shared_prefix.MIN_ROWS - 1], np.full(shared_prefix.MIN_ROWS - 1, 64), 16) is None
