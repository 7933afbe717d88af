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
A request whose next uncached prompt block is being prefilled by a running request waits for it to be cached
rather than compute it a second time.
When the pool cannot give that block, the newest running request is preempted: its blocks go back and it
rejoins the front of the queue with its tokens so far, to be recomputed (its shared prefix most likely still
cached). A request is never refused for memory it could have once others finish; one that could never fit
(more blocks than the pool) is refused when it is added.

SamplingParams is per request: its own temperature, top-k, top-p and generator (seeded per request), so what a
request draws does not depend on which others share its steps; greedy (temperature 0) is the argmax, the
same tokens `kiln generate` gives.
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, field

import torch

from kiln.model.generate import sampling_probs
from kiln.pipeline.serve.blocks import BlockPool
from kiln.pipeline.serve.kv_cache import PagedKVCache, Segment
from kiln.pipeline.serve.speculative import accept, accept_greedy


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int
    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None
    stop_ids: tuple[int, ...] = ()


@dataclass(eq=False)  # a request is itself: two with the same prompt and sampling are still two
class Request:
    prompt: list[int]
    sampling: SamplingParams
    id: str = ""
    output: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" (a stop id, kept in output) | "length" | "abort"
    # the engine's
    table: list[int] = field(default_factory=list)
    computed: int = 0
    draft_computed: int = 0  # the same in the draft model's cache (speculative decoding)
    order: int = 0
    generator: torch.Generator | None = None

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    @property
    def length(self) -> int:  # len(tokens), without building the list: the scheduler asks every step
        return len(self.prompt) + len(self.output)


class Engine:
    """`model` (a GPT in eval mode) serving requests from a pool of `num_blocks` blocks of `block_size` tokens."""

    def __init__(self, model, num_blocks: int, block_size: int = 16, max_batch_tokens: int = 256,
                 prefix_caching: bool = True, dtype: torch.dtype | None = None, backend: str = "auto",
                 draft=None, speculate: int = 4):
        if max_batch_tokens < 1 or speculate < 1:
            raise ValueError(f"max_batch_tokens={max_batch_tokens}, speculate={speculate}: expected positive integers")
        self.model, self.max_batch_tokens, self.prefix_caching = model, max_batch_tokens, prefix_caching
        device = next(p.device for p in model.parameters())
        dtype = dtype or next(p.dtype for p in model.parameters() if p.is_floating_point())
        self.pool = BlockPool(num_blocks, block_size)
        self.cache = PagedKVCache(model.config, num_blocks, block_size, device, dtype, backend)
        # Speculative decoding: the draft keeps its own cache with the same block tables as the target's.
        self.draft, self.speculate, self.draft_cache = draft, speculate, None
        if draft is not None:
            c, d = model.config, draft.config
            if d.vocab_size != c.vocab_size or d.max_seq_len < c.max_seq_len:
                raise ValueError(f"draft: vocabulary {d.vocab_size} and context {d.max_seq_len}; the model has "
                                 f"{c.vocab_size} and {c.max_seq_len} (the draft needs the same vocabulary and at "
                                 "least its context)")
            self.draft_cache = PagedKVCache(d, num_blocks, block_size, device, dtype, backend)
        self.drafted = self.accepted = 0  # draft tokens proposed and kept: the acceptance rate
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.counter = itertools.count()
        self.prefill_tokens = 0  # computed, over the engine's life: what prefix caching saves shows here
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
        victim.computed = victim.draft_computed = 0
        self.waiting.appendleft(victim)
        return victim

    def _admit(self) -> bool:
        request = self.waiting[0]
        tokens = request.tokens
        if self.prefix_caching and self._prefix_in_flight(tokens):
            return False
        got = self.pool.allocate(tokens if self.prefix_caching else [], reserve=len(tokens))
        if got is None:
            return False
        request.table, request.computed = got
        request.draft_computed = 0  # the draft's cache of a shared prefix may not be whole: it recomputes
        self.running.append(self.waiting.popleft())
        self.running.sort(key=lambda r: r.order)
        return True

    def _prefix_in_flight(self, tokens: list[int]) -> bool:
        """Whether the first full block of `tokens` not yet cached is one a running request is prefilling now: the
        request then waits a step or two for it to be cached instead of computing the same keys and values again
        (requests that share a system prompt and arrive together would all compute it otherwise)."""
        keys = self.pool.prefix_keys(tokens[:len(tokens) - 1])
        needed = next((key for key in keys if key not in self.pool.cached), None)
        if needed is None:
            return False
        B = self.pool.block_size
        return any(needed in self.pool.prefix_keys(r.prompt[:len(r.prompt) - 1])[r.computed // B:]
                   for r in self.running if r.computed < len(r.prompt))

    def _schedule(self) -> list[tuple[Request, int]]:
        """(request, tokens to feed) for this step, decodes first; blocks made ready for all of them."""
        batch: list[tuple[Request, int]] = []
        for request in list(self.running):  # decodes: one token each (and the draft's), every step
            if request not in self.running or request.length - request.computed != 1:
                continue
            while not self.pool.grow(request.table, request.length + self._lookahead(request)):
                self.preemptions += 1
                if self._preempt() is request:
                    break
            else:
                batch.append((request, 1))
        budget = self.max_batch_tokens - len(batch)
        while self.waiting and budget > 0 and self._admit():
            pass
        for request in self.running:  # prefills, oldest first, within the budget
            left = request.length - request.computed
            if left > 1 and budget > 0:
                batch.append((request, min(left, budget)))
                budget -= batch[-1][1]
        return batch

    def _lookahead(self, request: Request) -> int:
        """How many draft tokens this request's next decode verifies: `speculate`, fewer near its end."""
        if self.draft is None:
            return 0
        room = min(request.sampling.max_tokens - len(request.output),
                   self.model.config.max_seq_len + 1 - request.length)
        return max(0, min(self.speculate, room - 1))

    def _sample(self, request: Request, logits: torch.Tensor) -> tuple[int, torch.Tensor | None]:
        """A token from one row of logits with the request's sampling, and the distribution it came from
        (None when greedy)."""
        s = request.sampling
        if s.temperature == 0:
            return int(logits.argmax()), None
        probs = sampling_probs(logits[None], s.temperature, s.top_k, s.top_p)[0]
        return int(torch.multinomial(probs, 1, generator=request.generator)), probs

    def _propose(self, requests: list[Request]) -> dict[int, tuple[list[int], list]]:
        """Each request's draft tokens and the draft's distributions, from batched forwards of the draft: the
        first catches its cache up to the request's last token, each next one feeds the token just drafted."""
        drafts: dict[int, tuple[list[int], list]] = {id(r): ([], []) for r in requests}
        active = list(requests)
        for round_ in range(self.speculate):
            active = [r for r in active if self._lookahead(r) > round_]
            if not active:
                break
            segments, ids = [], []
            for r in active:
                fed = r.tokens + drafts[id(r)][0]
                start = r.draft_computed if round_ == 0 else r.length - 1 + round_
                segments.append(Segment(r.table, start, len(fed) - 1 - start + 1))
                ids += fed[start:]
            self.draft_cache.begin(segments)
            logits = self.draft(torch.tensor(ids, device=self.cache.device)[None], cache=self.draft_cache)[0]
            for r, row in zip(active, logits):
                token, probs = self._sample(r, row)
                drafts[id(r)][0].append(token)
                drafts[id(r)][1].append(probs)
        return drafts

    def _finish(self, request: Request, tokens: list[int], events: list) -> None:
        """Append `tokens` until a stop id or max_tokens; release the request when it is done."""
        s = request.sampling
        for token in tokens:
            request.output.append(token)
            events.append((request, token))
            if token in s.stop_ids:
                request.finish_reason = "stop"
            elif len(request.output) >= s.max_tokens:
                request.finish_reason = "length"
            if request.finish_reason:
                break
        if request.finish_reason:
            self.running.remove(request)
            self.pool.release(request.table)

    @torch.no_grad()
    def step(self) -> list[tuple[Request, int]]:
        """Run one step; return (request, new token) for each request that got a token (finished ones too)."""
        batch = self._schedule()
        if not batch:
            if self.waiting and not self.running:
                raise RuntimeError("the pool cannot hold the first waiting request")  # add() prevents this
            return []
        speculating = [r for r, n in batch if r.length - r.computed == 1 and self._lookahead(r)]  # decodes
        drafts = self._propose(speculating) if speculating else {}
        segments, ids = [], []
        for r, n in batch:
            drafted = drafts.get(id(r), ([], []))[0]
            segments.append(Segment(r.table, r.computed, n + len(drafted), 1 + len(drafted)))
            ids += r.tokens[r.computed:r.computed + n] + drafted
        self.cache.begin(segments)
        logits = self.model(torch.tensor(ids, device=self.cache.device)[None], cache=self.cache)[0]
        rows = logits.split([s.logits for s in segments])
        best = logits.argmax(-1).tolist()  # every row's greedy token in one transfer, not one sync per request
        ends = itertools.accumulate(s.logits for s in segments)
        events = []
        for (request, n), row, end in zip(batch, rows, ends):
            before = request.computed
            if n > 1 or request.computed < len(request.prompt):
                self.prefill_tokens += n
            if request.computed + n < request.length:
                request.computed += n  # a prefill chunk short of the end: no token yet
                self._commit(request, before)
                continue
            drafted, draft_probs = drafts.get(id(request), ([], []))
            if not drafted:
                greedy = request.sampling.temperature == 0
                new = [best[end - 1] if greedy else self._sample(request, row[0])[0]]
            elif request.sampling.temperature == 0:
                new = accept_greedy(row, drafted)
            else:
                target = sampling_probs(row, request.sampling.temperature, request.sampling.top_k,
                                        request.sampling.top_p)
                new = accept(target, torch.stack(draft_probs), drafted, request.generator)
            self.drafted += len(drafted)
            self.accepted += len(new) - 1
            last = request.length - 1  # the position fed this step; the drafts were fed after it
            self._finish(request, new, events)
            # Every new token but the last is a kept draft, whose keys and values the target computed; the last
            # is fed next step. The draft computed its cache up to the draft before the last it proposed.
            request.computed = request.length - 1
            if drafted:
                request.draft_computed = min(request.computed, last + len(drafted))
            if request.finish_reason:
                continue
            self.pool.shrink(request.table, max(request.computed, len(request.prompt)))
            self._commit(request, before)
        return events

    def _commit(self, request: Request, before: int) -> None:
        """Offer the request's computed full blocks for sharing, when this step filled one: `commit` hashes the
        whole sequence, a cost that grows with its length, so not on every step."""
        if self.prefix_caching and request.computed // self.pool.block_size > before // self.pool.block_size:
            self.pool.commit(request.table, request.tokens[:request.computed])

    def run(self, requests: list[Request]) -> list[Request]:
        """Add `requests` and step until every one has finished (tests, `kiln generate`)."""
        for request in requests:
            self.add(request)
        while self.has_work():
            self.step()
        return requests
