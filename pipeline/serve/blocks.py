"""The paged KV cache's bookkeeping (PagedAttention, Kwon et al. 2023): which fixed-size blocks of cache
memory each sequence's tokens live in, which are free, and which full blocks several requests share.

A sequence holds a block table, its blocks in token order: token i lives in slot i % block_size of block
table[i // block_size]. Blocks come from one pool and go back to it when their last user leaves, so the cache
holds what running requests need (within one block each) instead of max_seq_len for every row.

Prefix caching: a block whose block_size tokens are all computed gets a key, a 128-bit BLAKE2b digest of its
parent's key and its token ids, so equal keys mean equal whole prefixes. A shared block is another request's
keys and values, so a key two prompts could be made to share would answer one client from another's prompt:
Python's hash() of ints and tuples is not randomised, and 16-token blocks with equal hash((parent, tokens)) are
found in minutes (the class of vLLM's CVE-2025-25183); matching a given block's digest takes about 2^128 tries.
A new request walks its prompt's full blocks and takes every block already cached under the same key,
sharing it (a reference count) instead of computing it again. Only full blocks are shared and a full block is
never written again, so sharing needs no copy-on-write; a sequence's last, partly filled block is its own.
Freed blocks keep their key and content and wait in the free list, oldest first: a later request can still
find them there until the pool hands them out again (least recently freed first).
"""

from __future__ import annotations

import struct
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from hashlib import blake2b


class BlockPool:
    """`num_blocks` blocks of `block_size` token slots: allocation, sharing by prefix, release."""

    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks={num_blocks}, block_size={block_size}: expected positive integers")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.refs = [0] * num_blocks
        self.keys: list[bytes | None] = [None] * num_blocks
        self.cached: dict[bytes, int] = {}  # key -> block holding that prefix
        self._pack = struct.Struct(f"<{block_size}i").pack  # a block's token ids as 4 bytes each (ids < 2^31)
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))  # refs == 0, oldest first

    def in_use(self) -> int:
        """Blocks some sequence holds (a shared block counts once)."""
        return self.num_blocks - len(self.free)

    def available(self) -> int:
        return len(self.free)

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def _take(self) -> int:
        block, _ = self.free.popitem(last=False)
        if (key := self.keys[block]) is not None:  # its old content is overwritten: forget the prefix
            del self.cached[key]
            self.keys[block] = None
        self.refs[block] = 1
        return block

    def _share(self, blocks: list[int]) -> None:
        refs, free = self.refs, self.free  # (a fork shares a whole prompt's blocks: one call, not one a block)
        for block in blocks:
            if not refs[block]:
                del free[block]
            refs[block] += 1

    def prefix_keys(self, tokens: Sequence[int], known: list[bytes] | None = None) -> list[bytes]:
        """The key of each full block of `tokens`, in order. `known`, the keys of its first blocks found before
        (a sequence only grows), is extended in place and returned, so that only the new blocks are hashed."""
        keys, B, pack = ([] if known is None else known), self.block_size, self._pack
        # every input is the parent's 16 bytes (none for the first block) then 4 * B: no two prefixes read alike
        parent = keys[-1] if keys else b""
        for start in range(len(keys) * B, len(tokens) - B + 1, B):
            parent = blake2b(parent + pack(*tokens[start:start + B]), digest_size=16).digest()
            keys.append(parent)
        return keys

    def allocate(self, tokens: Sequence[int], reserve: int, filling: Mapping[bytes, int] | None = None,
                 known: list[bytes] | None = None) -> tuple[list[int], int] | None:
        """A block table for a new sequence of `tokens` with room for `reserve` tokens in all, and how many of
        its leading tokens are cached already (a multiple of block_size, never the whole prompt: its last
        token must run to give the next one's logits). `filling` (key -> block): blocks that other sequences'
        chunks fill in the step being planned, shared as if cached (the step writes every chunk's keys and
        values before any chunk reads them). `known`: as in `prefix_keys`, the sequence's own keys, extended in
        place. None, with nothing taken, when the pool is short."""
        keys = self.prefix_keys(tokens[:len(tokens) - 1], known)
        shared, filling = [], filling or {}
        for key in keys:
            if (block := self.cached.get(key, filling.get(key))) is None:
                break
            shared.append(block)
        fresh = self.blocks_for(max(reserve, len(tokens))) - len(shared)
        # a cached block taken from the free list is one fewer block for the fresh ones
        reclaimed = sum(self.refs[b] == 0 for b in shared)
        if fresh > self.available() - reclaimed:
            return None
        self._share(shared)
        return shared + [self._take() for _ in range(fresh)], len(shared) * self.block_size

    def fork(self, table: list[int], tokens: int) -> tuple[list[int], tuple[int, int, int] | None] | None:
        """A table for a new sequence whose first `tokens` tokens are those `table` holds: the full blocks shared,
        a partly filled last block replaced by a fresh one, with (source, copy, its filled slots) for the cache to
        copy (the original's owner writes on into its own). None, with nothing taken, when the pool has no block
        for it."""
        full, partial = divmod(tokens, self.block_size)
        if partial and not self.available():
            return None
        shared = table[:full]
        self._share(shared)
        if not partial:
            return shared, None
        copy = self._take()
        return shared + [copy], (table[full], copy, partial)

    def grow(self, table: list[int], tokens: int) -> bool:
        """Extend `table` to hold `tokens` tokens; False, with the table unchanged, when the pool is short."""
        need = self.blocks_for(tokens) - len(table)
        if need > self.available():
            return False
        table.extend(self._take() for _ in range(max(need, 0)))
        return True

    def shrink(self, table: list[int], tokens: int) -> None:
        """Give back the blocks of `table` past what `tokens` tokens need (room a rejected draft took)."""
        keep = self.blocks_for(tokens)
        if len(table) > keep:
            tail = table[keep:]
            del table[keep:]
            self.release(tail)

    def commit(self, table: list[int], tokens: Sequence[int], known: list[bytes] | None = None) -> None:
        """Register the full blocks of `table` whose KV for `tokens` (the sequence so far) is now computed, so
        later requests can share them; `known` as in `prefix_keys`. A block already registered, or whose prefix
        another block holds, is left as it is."""
        keys = self.prefix_keys(tokens, known)[:len(tokens) // self.block_size]
        for block, key in zip(table, keys):
            if self.keys[block] is None and key not in self.cached:
                self.keys[block] = key
                self.cached[key] = block

    def reset(self) -> None:
        """Forget every cached prefix (the weights that computed them changed); only with no block in use."""
        if self.in_use():
            raise RuntimeError(f"{self.in_use()} blocks are in use: a reset would pull cached prefixes from under them")
        self.keys = [None] * self.num_blocks
        self.cached.clear()

    def release(self, table: list[int]) -> None:
        """Give a finished or preempted sequence's blocks back. The tail goes to the free list first, so it is
        reused before the prefix, which other requests are likelier to share."""
        for block in reversed(table):
            self.refs[block] -= 1
            if self.refs[block] == 0:
                self.free[block] = None
            elif self.refs[block] < 0:
                raise RuntimeError(f"block {block} released more often than taken")
        table.clear()
