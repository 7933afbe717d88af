"""The running requests' per-slot rows the model runner packs a step from, kept across steps (vLLM v1's
`InputBatch` and `BlockTable`).

A running request holds a slot: one row of numpy arrays with its block table (padded to the longest table a
sequence can have) and its sampling settings (temperature, top-k, top-p, the sampler's noise key, whether it
asks for log-probabilities). A step's arrays are then a few fancy-indexing calls over the plan's slots instead
of a Python pass per request per array: at GRPO's width (hundreds of running sequences) that per-request
Python was most of a step's host time.

The rows follow the scheduler's diff (`Scheduler.take_changes`): a request whose blocks went back (finished,
preempted, aborted) frees its slot; one whose block table changed (admitted, forked, grown by a block,
shrunk after a rejected draft) has its row rewritten, taking a slot if it has none. Nothing else changes a row,
so a slot's row is exactly its request's table and settings for every step it runs in.
"""

from __future__ import annotations

import numpy as np

from kiln.pipeline.serve.request import Request


def slots_of(tables: np.ndarray, positions: np.ndarray, block_size: int) -> np.ndarray:
    """The pool slot (block x block_size + offset) of each position, each read in the block table beside it
    (`tables` holds one table row per position, or broadcasts to them along its second-to-last axis): vLLM's
    slot mapping."""
    # one flat gather: each table row's first index plus the position's block (take_along_axis broadcasts the
    # tables to every position first, several times slower at GRPO's width)
    width = tables.shape[-1]
    rows = np.arange(0, tables.size, width).reshape(tables.shape[:-1])
    return tables.reshape(-1)[rows + positions // block_size] * block_size + positions % block_size


class InputBatch:
    """Slots for running requests, `max_blocks` block-table columns each, for a vocabulary of `vocab_size`."""

    def __init__(self, max_blocks: int, vocab_size: int, capacity: int = 64):
        self.max_blocks, self.vocab_size = max_blocks, vocab_size
        self.capacity = 0
        self.free: list[int] = []  # slots not held; the last is taken first (the lowest, until slots come back)
        self._grow(capacity)

    # each slot's row: (name, dtype, columns; 0 for one value a slot)
    ROWS = (("tables", np.int64, "max_blocks"), ("table_len", np.int64, 0), ("temperature", np.float32, 0),
            ("top_k", np.int64, 0), ("top_p", np.float32, 0), ("keys", np.int64, 0), ("logprobs", bool, 0))

    def _grow(self, capacity: int) -> None:
        old, self.capacity = self.capacity, max(capacity, 2 * self.capacity)
        for name, dtype, columns in self.ROWS:
            shape = (self.capacity, getattr(self, columns)) if columns else (self.capacity,)
            array = np.zeros(shape, dtype=dtype)
            if old:
                array[:old] = getattr(self, name)
            setattr(self, name, array)
        self.free = list(range(self.capacity - 1, old - 1, -1)) + self.free

    def release(self, request: Request) -> None:
        """Free `request`'s slot (its blocks went back); a request without one is left as it is."""
        if request.slot >= 0:
            self.free.append(request.slot)
            request.slot = -1

    def write(self, request: Request, key: int) -> None:
        """Write `request`'s block table into its slot, taking a slot (and writing its sampling settings, with
        the sampler's noise `key`) if it holds none."""
        if request.slot < 0:
            if not self.free:
                self._grow(2 * self.capacity)
            slot = request.slot = self.free.pop()
            s = request.sampling
            self.temperature[slot] = s.temperature
            self.top_k[slot] = s.top_k or self.vocab_size
            self.top_p[slot] = 1.0 if s.top_p is None else s.top_p
            self.keys[slot] = key
            self.logprobs[slot] = s.logprobs is not None or s.prompt_logprobs is not None
        n = len(request.table)
        self.tables[request.slot, :n] = request.table
        self.table_len[request.slot] = n

    def slots(self, requests: list[Request]) -> np.ndarray:
        """The slots of `requests` (each must hold one), in order."""
        slots = np.fromiter((r.slot for r in requests), np.int64, len(requests))
        if len(slots) and slots.min() < 0:
            raise RuntimeError("a scheduled request holds no slot: the scheduler's changes were not applied")
        return slots

    def block_tables(self, slots: np.ndarray, ends: np.ndarray, block_size: int) -> np.ndarray:
        """The block tables of `slots`, (len(slots), their longest table), zero-padded; each must hold its
        sequence's first ends[i] tokens."""
        lens = self.table_len[slots]
        if len(slots) and (ends > lens * block_size).any():
            i = int(np.argmax(ends > lens * block_size))
            raise ValueError(f"a sequence of {ends[i]} tokens does not fit its {lens[i]} blocks")
        return self.tables[slots, :int(lens.max()) if len(slots) else 0]
