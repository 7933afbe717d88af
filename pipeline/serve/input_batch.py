"""The running requests' per-slot rows the model runner packs a step from, kept across steps (vLLM v1's
`InputBatch` and `BlockTable`).

A running request holds a slot: one row of numpy arrays with its block table (padded to the longest table a
sequence can have), its sampling settings (temperature, top-k, top-p, the sampler's noise key, whether it
asks for log-probabilities) and where it stands (its length, the tokens computed, its last token, its prompt's
length and the length at which max_tokens ends it). A step's arrays are then a few fancy-indexing calls over
the plan's slots instead of a Python pass per request per array: at GRPO's width (hundreds of running
sequences) that per-request Python was most of a step's host time.

The rows follow the scheduler's diff (`Scheduler.take_changes`): a request whose blocks went back (finished,
preempted, aborted) frees its slot; one whose block table changed (admitted, forked, grown by a block,
shrunk after a rejected draft) has its table rewritten, taking a slot (and writing its settings and standing)
if it has none. Between those, the runner moves a row's standing on by what each step computed and sampled
(`advance`), as the scheduler's update does to the request; the rows of a step it cannot follow so (one that
verified drafts) it rewrites from their requests before the next step (`stand`). So a slot's row is exactly
its request's for every step it runs in.

The stop ids of every running request are counted by token (`stop_count`), so a step finds the few rows whose
token may end their request (or that reach max_tokens, or fill a block) with array operations, and the
scheduler looks at those alone (`flagged`).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

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
    shift = block_size.bit_length() - 1
    if block_size == 1 << shift:  # a power of two, as blocks usually are: shifts and masks, several times faster
        return (tables.reshape(-1)[rows + (positions >> shift)] << shift) + (positions & (block_size - 1))
    return tables.reshape(-1)[rows + positions // block_size] * block_size + positions % block_size


class InputBatch:
    """Slots for running requests, `max_blocks` block-table columns each, for a vocabulary of `vocab_size`."""

    def __init__(self, max_blocks: int, vocab_size: int, capacity: int = 64):
        self.max_blocks, self.vocab_size = max_blocks, vocab_size
        self.capacity = 0
        self.free: list[int] = []  # slots not held; the last is taken first (the lowest, until slots come back)
        # how many held slots' requests stop at each token id (ids outside the vocabulary are never sampled)
        self.stop_count = np.zeros(vocab_size, np.int64)
        self.stop_ids: list[np.ndarray | None] = []  # each slot's, as counted
        self.holders: list[Request | None] = []  # each slot's request: the processed rows' asks are read from it
        # one array per distinct stop set while a slot holds it (GRPO's hundreds of requests share one)
        self._stop_arrays: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
        self._grow(capacity)

    # each slot's row: (name, dtype, columns; 0 for one value a slot)
    ROWS = (("tables", np.int64, "max_blocks"), ("table_len", np.int64, 0), ("temperature", np.float32, 0),
            ("top_k", np.int64, 0), ("top_p", np.float32, 0), ("keys", np.int64, 0), ("logprobs", bool, 0),
            ("processed", bool, 0), ("grammar", bool, 0),
            ("length", np.int64, 0), ("computed", np.int64, 0), ("last", np.int64, 0), ("prompt_len", np.int64, 0),
            ("limit", np.int64, 0))

    def _grow(self, capacity: int) -> None:
        old, self.capacity = self.capacity, max(capacity, 2 * self.capacity)
        for name, dtype, columns in self.ROWS:
            shape = (self.capacity, getattr(self, columns)) if columns else (self.capacity,)
            array = np.zeros(shape, dtype=dtype)
            if old:
                array[:old] = getattr(self, name)
            setattr(self, name, array)
        self.free = list(range(self.capacity - 1, old - 1, -1)) + self.free
        self.stop_ids += [None] * (self.capacity - old)
        self.holders += [None] * (self.capacity - old)

    def release(self, requests: list[Request]) -> None:
        """Free the slots of `requests` (their blocks went back); a request without one is left as it is."""
        held = [r for r in requests if r.slot >= 0]
        self._count_stops([self.stop_ids[r.slot] for r in held], -1)
        for r in held:
            self.stop_ids[r.slot] = self.holders[r.slot] = None
            self.free.append(r.slot)
            r.slot = -1

    def write(self, requests: list[Request], key: Callable[[Request], int]) -> None:
        """Write each request's block table into its slot, taking a slot (and writing its sampling settings, with
        the sampler's noise key `key(request)`, and where it stands) for one that holds none. Field by field over
        all of them: a GRPO step starts hundreds of forks."""
        new = [r for r in requests if r.slot < 0]
        while len(self.free) < len(new):
            self._grow(2 * self.capacity)
        for r in new:
            r.slot = self.free.pop()
        if new:
            slots, params = self.slots(new), [r.sampling for r in new]
            self.temperature[slots] = [s.temperature for s in params]
            self.top_k[slots] = [s.top_k or self.vocab_size for s in params]
            self.top_p[slots] = [1.0 if s.top_p is None else s.top_p for s in params]
            self.keys[slots] = [key(r) for r in new]
            self.logprobs[slots] = [s.logprobs is not None or s.prompt_logprobs is not None for s in params]
            self.processed[slots] = [r.processed for r in new]
            self.grammar[slots] = [r.grammar is not None for r in new]
            for slot, r in zip(slots.tolist(), new):
                self.holders[slot] = r
            self.prompt_len[slots] = [len(r.prompt) for r in new]
            self.limit[slots] = self.prompt_len[slots] + [s.max_tokens for s in params]
            arrays = {s: self._stop_array(s) for s in {p.stop_ids for p in params}}  # one per distinct set
            stops = [arrays[p.stop_ids] for p in params]
            for slot, array in zip(slots.tolist(), stops):
                self.stop_ids[slot] = array
            self._count_stops(stops, 1)
            self.stand(new)
        for r in requests:
            self.tables[r.slot, :len(r.table)] = r.table
        self.table_len[self.slots(requests)] = [len(r.table) for r in requests]

    def stand(self, requests: list[Request]) -> None:
        """Write where each request stands (its length, tokens computed, last token) into its slot: for one that
        just took its slot, or whose step `advance` could not follow."""
        slots = self.slots(requests)
        self.length[slots] = [r.length for r in requests]
        self.computed[slots] = [r.computed for r in requests]
        self.last[slots] = [r.output[-1] if r.output else r.prompt[-1] for r in requests]

    def _count_stops(self, arrays: list[np.ndarray], sign: int) -> None:
        """Add `sign` to the counts of each array's stop ids, once per array per occurrence (the same set's array
        is one object: grouped by it)."""
        times: dict[int, list] = {}
        for array in arrays:
            times.setdefault(id(array), [array, 0])[1] += 1
        for array, n in times.values():
            self.stop_count[array] += sign * n

    def _stop_array(self, stop_ids: frozenset[int]) -> np.ndarray:
        """The stop ids inside the vocabulary, as an array shared by every slot with the same set."""
        array = self._stop_arrays.get(stop_ids)
        if array is None:
            array = np.array(sorted(t for t in stop_ids if 0 <= t < self.vocab_size), dtype=np.int64)
            self._stop_arrays[stop_ids] = array
        return array

    def advance(self, slots: np.ndarray, counts: np.ndarray | int, sampled: np.ndarray | None,
                tokens: np.ndarray) -> None:
        """Move the rows of `slots` on by a step: counts[i] more tokens computed; the rows `sampled` (indices into
        `slots`; None: every one) got `tokens`, one each."""
        self.computed[slots] += counts
        grown = slots if sampled is None else slots[sampled]
        self.length[grown] += 1
        self.last[grown] = tokens

    def flagged(self, slots: np.ndarray, tokens: np.ndarray, block_size: int) -> np.ndarray:
        """Which of `slots`, each a decode that sampled tokens[i] after its last token, may be done by it (a stop
        id of some running request, max_tokens, or its grammar, fed every token) or fill a block by feeding it:
        the only rows whose request a step of plain decodes changes beyond its output."""
        lengths = self.length[slots]  # before the token
        return np.flatnonzero((self.stop_count[tokens] > 0) | (lengths + 1 >= self.limit[slots])
                              | (lengths % block_size == 0) | self.grammar[slots])

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
