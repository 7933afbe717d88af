"""Continuous batching over a paged KV cache: requests wait, run and finish, and every step runs whatever the
running requests need next, up to a token budget.

A request's state is its tokens (prompt, then what it generated) and how many of them have keys and values in
the cache (`computed`). What it needs next is always tokens[computed:]: the rest of its prompt while it
prefills (in chunks, when the budget is short), then one token a step while it decodes. A step takes every
decoding request first (one token each, so a long prompt never stalls the requests already answering), then
prefill chunks of the others in arrival order until `max_batch_tokens`; runs them as one flat batch through
the model (`kv_cache.PagedKVCache`); samples a token for each request whose chunk reached its end; and lets
finished requests go, so their blocks serve new requests in the very next step.

Blocks: a request admitted from the queue gets blocks for its whole prompt at once (`blocks.BlockPool`,
sharing any cached prefix, whose tokens it then skips), and one more block whenever decoding fills the last.
When the pool cannot give that block, the newest running request is preempted: its blocks go back and it
rejoins the front of the queue with its tokens so far, to be recomputed (its shared prefix most likely still
cached). A request is never refused for memory it could have once others finish; one that could never fit
(more blocks than the pool) is refused when it is added.

Sampling is per request: its own temperature, top-k, top-p and generator (seeded per request), so what a
request draws does not depend on which others share its steps; greedy (temperature 0) is the argmax, the
same tokens `kiln generate` gives.
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, field

import torch

from kiln.model.generate import sample_next
from kiln.pipeline.serve.blocks import BlockPool
from kiln.pipeline.serve.kv_cache import PagedKVCache, Segment


@dataclass(frozen=True)
class Sampling:
    max_tokens: int
    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None
    stop_ids: tuple[int, ...] = ()


@dataclass
class Request:
    prompt: list[int]
    sampling: Sampling
    id: str = ""
    output: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" (a stop id, kept in output) | "length" | "abort"
    # the engine's
    table: list[int] = field(default_factory=list)
    computed: int = 0
    order: int = 0
    generator: torch.Generator | None = None

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output


@dataclass
class StepStats:
    tokens: int = 0  # fed through the model this step
    prefill_tokens: int = 0
    decodes: int = 0
    preempted: int = 0


class Engine:
    """`model` (a GPT in eval mode) serving requests from a pool of `num_blocks` blocks of `block_size` tokens."""

    def __init__(self, model, num_blocks: int, block_size: int = 16, max_batch_tokens: int = 256,
                 prefix_caching: bool = True, dtype: torch.dtype | None = None, backend: str = "auto"):
        if max_batch_tokens < 1:
            raise ValueError(f"max_batch_tokens={max_batch_tokens}: expected a positive integer")
        self.model, self.max_batch_tokens, self.prefix_caching = model, max_batch_tokens, prefix_caching
        device = next(p.device for p in model.parameters())
        dtype = dtype or next(p.dtype for p in model.parameters() if p.is_floating_point())
        self.pool = BlockPool(num_blocks, block_size)
        self.cache = PagedKVCache(model.config, num_blocks, block_size, device, dtype, backend)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.counter = itertools.count()
        self.prefill_tokens = 0  # computed, over the engine's life: what prefix caching saves shows here
        self.last_stats = StepStats()
        self.preemptions = 0
        self.aborted = 0

    def add(self, request: Request) -> Request:
        """Queue a request (checked: it must fit the model's context and, alone, the pool)."""
        max_len = self.model.config.max_seq_len
        s = request.sampling
        if not request.prompt:
            raise ValueError("prompt: expected at least one token")
        if s.max_tokens < 1 or len(request.prompt) + s.max_tokens - 1 > max_len:
            raise ValueError(f"prompt of {len(request.prompt)} tokens + max_tokens={s.max_tokens}: the model's "
                             f"context is {max_len} tokens")
        if self.pool.blocks_for(len(request.prompt) + s.max_tokens) > self.pool.num_blocks:
            raise ValueError(f"prompt + max_tokens need more than the cache's {self.pool.num_blocks} blocks")
        request.order = next(self.counter)
        if s.seed is not None:
            request.generator = torch.Generator(device=self.cache.device).manual_seed(s.seed)
        self.waiting.append(request)
        return request

    def abort(self, request: Request) -> None:
        """Stop a request now (a client that went away): its blocks go back at once."""
        if request in self.waiting:
            self.waiting.remove(request)
        if request in self.running:
            self.running.remove(request)
            self.pool.release(request.table)
        request.finish_reason = request.finish_reason or "abort"
        self.aborted += 1

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _preempt(self) -> Request:
        victim = max(self.running, key=lambda r: r.order)
        self.running.remove(victim)
        self.pool.release(victim.table)
        victim.computed = 0
        self.waiting.appendleft(victim)
        return victim

    def _admit(self) -> bool:
        request = self.waiting[0]
        tokens = request.tokens
        got = self.pool.allocate(tokens if self.prefix_caching else [], reserve=len(tokens))
        if got is None:
            return False
        request.table, request.computed = got
        self.running.append(self.waiting.popleft())
        self.running.sort(key=lambda r: r.order)
        return True

    def _schedule(self, stats: StepStats) -> list[tuple[Request, int]]:
        """(request, tokens to feed) for this step, decodes first; blocks made ready for all of them."""
        batch: list[tuple[Request, int]] = []
        for request in list(self.running):  # decodes: one token each, every step
            if request not in self.running or len(request.tokens) - request.computed != 1:
                continue
            while not self.pool.grow(request.table, len(request.tokens)):
                stats.preempted += 1
                if self._preempt() is request:
                    break
            else:
                batch.append((request, 1))
        budget = self.max_batch_tokens - len(batch)
        while self.waiting and budget > 0 and self._admit():
            pass
        for request in self.running:  # prefills, oldest first, within the budget
            left = len(request.tokens) - request.computed
            if left > 1 and budget > 0:
                batch.append((request, min(left, budget)))
                budget -= batch[-1][1]
        return batch

    @torch.no_grad()
    def step(self) -> list[tuple[Request, int]]:
        """Run one step; return (request, new token) for each request that got a token (finished ones too)."""
        stats = StepStats()
        batch = self._schedule(stats)
        if not batch:
            if self.waiting and not self.running:
                raise RuntimeError("the pool cannot hold the first waiting request")  # add() prevents this
            return []
        segments = [Segment(r.table, r.computed, n) for r, n in batch]
        ids = torch.tensor([t for r, n in batch for t in r.tokens[r.computed:r.computed + n]],
                           device=self.cache.device)[None]
        self.cache.begin(segments)
        logits = self.model(ids, cache=self.cache)[0]  # the last new token's of each segment
        events = []
        for (request, n), row in zip(batch, logits):
            if n > 1 or request.computed < len(request.prompt):
                stats.prefill_tokens += n
            else:
                stats.decodes += 1
            request.computed += n
            stats.tokens += n
            if self.prefix_caching:
                self.pool.commit(request.table, request.tokens[:request.computed])
            if request.computed < len(request.tokens):
                continue  # a prefill chunk short of the end: no token yet
            s = request.sampling
            token = int(sample_next(row[None], s.temperature, s.top_k, s.top_p, request.generator)[0])
            request.output.append(token)
            events.append((request, token))
            if token in s.stop_ids:
                request.finish_reason = "stop"
            elif len(request.output) >= s.max_tokens:
                request.finish_reason = "length"
            if request.finish_reason:
                self.running.remove(request)
                self.pool.release(request.table)
        self.prefill_tokens += stats.prefill_tokens
        self.preemptions += stats.preempted
        self.last_stats = stats
        return events

    def run(self, requests: list[Request]) -> list[Request]:
        """Add `requests` and step until every one has finished (tests, `kiln generate`)."""
        for request in requests:
            self.add(request)
        while self.has_work():
            self.step()
        return requests
