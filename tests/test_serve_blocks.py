"""The paged KV cache's block bookkeeping: accounting, prefix sharing, eviction, a short pool."""

import random

import pytest

from kiln.pipeline.serve.blocks import BlockPool


def test_blocks_go_back_and_a_table_holds_its_tokens_within_one_block():
    pool = BlockPool(10, 4)
    table, cached = pool.allocate(list(range(6)), reserve=9)
    assert cached == 0 and len(table) == 3 and pool.in_use() == 3  # 9 tokens: 3 blocks of 4
    assert pool.grow(table, 13) and len(table) == 4
    assert pool.grow(table, 16) and len(table) == 4  # still fits
    pool.release(table)
    assert table == [] and pool.in_use() == 0 and pool.available() == 10


def test_a_common_prefix_is_shared_not_computed_again():
    pool = BlockPool(10, 4)
    system = [7, 7, 1, 2, 3, 4, 5, 6]  # two full blocks
    first, cached = pool.allocate(system + [9, 9], reserve=12)
    assert cached == 0
    pool.commit(first, system + [9, 9])  # its KV is computed: the two full blocks become findable
    second, cached = pool.allocate(system + [8], reserve=12)
    assert cached == 8 and second[:2] == first[:2] and second[2] != first[2]
    assert pool.refs[first[0]] == 2 and pool.in_use() == 3 + 1  # shared blocks count once
    other, cached = pool.allocate([7, 7, 1, 2, 0, 0, 0, 0, 5], reserve=9)  # same first block only
    assert cached == 4 and other[0] == first[0] and other[1] != first[1]
    for table in (first, second, other):
        pool.release(table)
    assert pool.in_use() == 0 and all(r == 0 for r in pool.refs)


def test_a_prompt_that_is_all_cached_still_runs_its_last_token():
    pool = BlockPool(6, 4)
    prompt = list(range(8))
    table, _ = pool.allocate(prompt, reserve=8)
    pool.commit(table, prompt)
    again, cached = pool.allocate(prompt, reserve=8)
    assert cached == 4 and again[0] == table[0] and again[1] != table[1]


def test_freed_blocks_stay_findable_until_the_pool_hands_them_out_again():
    pool = BlockPool(3, 2)
    prompt = [1, 2, 3, 4, 5]
    table, _ = pool.allocate(prompt, reserve=5)
    first = list(table)
    pool.commit(table, prompt)
    pool.release(table)
    assert pool.in_use() == 0
    back, cached = pool.allocate(prompt, reserve=5)
    assert cached == 4 and back[:2] == first[:2]
    pool.release(back)
    filler, _ = pool.allocate([9, 9, 9, 9, 9, 9], reserve=6)  # takes every block: the cached prefixes are gone
    pool.release(filler)
    assert pool.allocate(prompt, reserve=5)[1] == 0 and pool.cached == {}


def test_a_short_pool_refuses_and_takes_nothing():
    pool = BlockPool(4, 4)
    held, _ = pool.allocate(list(range(10)), reserve=12)
    assert pool.allocate([1], reserve=8) is None and pool.in_use() == 3
    table, _ = pool.allocate([1], reserve=4)
    assert not pool.grow(table, 5) and len(table) == 1
    pool.release(held)
    assert pool.grow(table, 5) and len(table) == 2


def test_release_twice_is_a_bug_that_says_so():
    pool = BlockPool(2, 2)
    table, _ = pool.allocate([1, 2], reserve=2)
    copy = list(table)
    pool.release(table)
    with pytest.raises(RuntimeError, match="released more often"):
        pool.release(copy)


@pytest.mark.parametrize("seed", range(5))
def test_random_workloads_keep_the_books_and_end_at_zero(seed):
    """Requests with shared prefixes arrive, grow a token at a time, commit and leave (or are preempted when
    the pool runs short); every block's count always equals the tables holding it."""
    rng = random.Random(seed)
    pool = BlockPool(24, 4)
    prefixes = [[rng.randrange(50) for _ in range(rng.randrange(1, 13))] for _ in range(3)]
    running: list[tuple[list[int], list[int]]] = []
    for _ in range(400):
        if running and rng.random() < 0.3:
            table, tokens = running.pop(rng.randrange(len(running)))
            pool.release(table)
        elif rng.random() < 0.4:
            tokens = rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randrange(1, 6))]
            got = pool.allocate(tokens, reserve=len(tokens) + 1)
            if got is not None:
                table, cached = got
                assert cached % 4 == 0 and cached < len(tokens)
                pool.commit(table, tokens)
                running.append((table, tokens))
        elif running:
            table, tokens = rng.choice(running)
            tokens.append(rng.randrange(50))
            if pool.grow(table, len(tokens) + 1):
                pool.commit(table, tokens)
            else:
                running.remove((table, tokens))
                pool.release(table)  # preempted: recomputed later
        holders = [0] * pool.num_blocks
        for table, tokens in running:
            assert len(table) == pool.blocks_for(len(tokens) + 1)  # within one block of what it holds
            for block in table:
                holders[block] += 1
        assert holders == pool.refs
        assert set(pool.free) == {b for b in range(pool.num_blocks) if holders[b] == 0}
    for table, _ in running:
        pool.release(table)
    assert pool.in_use() == 0


def test_keys_extended_from_known_ones_are_the_keys_hashed_whole():
    """A sequence's block keys are extended as it grows (`Request.block_keys`), never hashed again from the
    start: the extended list equals the whole hash, and a commit of fewer tokens than the known keys cover
    registers only the blocks those tokens fill."""
    pool = BlockPool(8, 4)
    tokens = list(range(100, 130))
    known = pool.prefix_keys(tokens[:9])  # two full blocks
    assert pool.prefix_keys(tokens, known) is known and known == pool.prefix_keys(tokens) and len(known) == 7
    pool.commit(list(range(8)), tokens[:10], list(known))
    assert sorted(pool.cached.values()) == [0, 1] and [pool.cached[k] for k in known[:2]] == [0, 1]


# Two first blocks with equal Python tuple hashes, so equal hash((parent, tokens)) keys (the audit found them by a
# birthday search over CPython's tuple hash in minutes).
COLLIDING = ([7, 7, 7, 7, 7, 7, 7, 7, 7, 977, 199, 525, 830, 231, 1001, 374],
             [7, 7, 7, 7, 7, 7, 7, 7, 7, 21, 999, 329, 183, 527, 799, 0])


def test_a_prompt_crafted_to_collide_with_another_shares_none_of_its_blocks():
    """Sharing a block is reading another request's keys and values: a key two prefixes can be made to share
    gives one client an answer computed from another's prompt."""
    a, b = COLLIDING
    assert a != b and hash((0, tuple(a))) == hash((0, tuple(b)))
    pool = BlockPool(8, 16)
    tail = [300, 41, 600]
    first, _ = pool.allocate(a + tail, reserve=19)
    pool.commit(first, a + tail)
    second, cached = pool.allocate(b + tail, reserve=19)
    assert cached == 0 and not set(first) & set(second)
    assert pool.prefix_keys(a) != pool.prefix_keys(b)
