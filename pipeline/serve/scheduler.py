"""What each engine step runs: requests wait and run, blocks are found for them, and the step's plan is made.

The scheduler decides and keeps the books; it touches no tensor. `schedule()` returns the plan of a step (which
requests feed which of their tokens, and how many draft tokens each decode verifies), the model runner
(serve/runner.py) runs it, and `update()` applies the tokens that came back (serve/step.py holds what passes
between them). What changed for the runner since the last step (requests whose blocks went back, block tables
that changed, forks' block copies) is kept as a diff that the engine hands it before each step
(`take_changes`), so the runner never rereads every running request's table.

A request's state is its tokens (prompt, then what it generated) and how many of them have keys and values in
the cache (`computed`). What it needs next is always tokens[computed:]: the rest of its prompt while it
prefills (in chunks, when the budget is short), then one token a step while it decodes. A step takes every
decoding request first (one token each, so a long prompt never stalls the requests already answering), then
prefill chunks until `max_batch_tokens`, the prompts already being computed before newly admitted ones, each in
arrival order; a request whose chunk reaches the end of
its tokens gets a new token; finished requests go, so their blocks serve new requests in the very next step.

Blocks: a request admitted from the queue gets blocks for its whole prompt at once (`blocks.BlockPool`,
sharing any cached prefix, whose tokens it then skips), and one more block whenever decoding fills the last.
A prompt block that an earlier chunk of the same step fills is shared as if cached (the step writes every
chunk's keys and values before any chunk reads them), so requests that arrive together behind one prompt
compute it once and start in the same step. When the pool cannot
give a decoding request its next block, the newest running request is preempted: its blocks go back and it
rejoins the front of the queue with its tokens so far, to be recomputed (its shared prefix most likely still
cached). A request is never refused for memory it could have once others finish; one that could never fit
(more blocks than the pool) is refused when it is added.

Forks (`Request.forks`: `n` samples of a prompt, a GRPO group) are never queued: the step that computes their
request's last prompt token also samples their first tokens from its row, and they start running on its
blocks, the full ones shared and the partly filled last one copied, so a group costs one prefill.
"""

from __future__ import annotations

import itertools
from collections import deque

from kiln.pipeline.serve.blocks import BlockPool
from kiln.pipeline.serve.request import Request, RequestStatus
from kiln.pipeline.serve.step import Changes, ScheduledSequence, StepResult


class Scheduler:
    def __init__(self, pool: BlockPool, max_seq_len: int, max_batch_tokens: int = 256, prefix_caching: bool = True,
                 speculate: int = 0):
        if max_batch_tokens < 1 or speculate < 0:
            raise ValueError(f"max_batch_tokens={max_batch_tokens}, speculate={speculate}: expected positive integers")
        self.pool, self.max_seq_len, self.max_batch_tokens = pool, max_seq_len, max_batch_tokens
        self.prefix_caching, self.speculate = prefix_caching, speculate
        self.waiting: deque[Request] = deque()
        # in arrival order (`Request.order`); a dict, so a request leaves it in constant time
        self.running: dict[Request, None] = {}
        self.counter = itertools.count()
        self.prefill_tokens = 0  # computed, over the engine's life: what prefix caching saves shows here
        self.preemptions = 0
        self.aborted = 0
        self.drafted = self.accepted = 0  # draft tokens verified and kept: the acceptance rate
        self.parents: dict[Request, Request] = {}  # a fork not yet started -> the request it forks from
        self.changes = Changes()  # for the runner, since it last asked (`take_changes`)
        self.unsorted = False  # requests were added to `running` out of arrival order
        # The steady state (GRPO's, a loaded server's between arrivals): a step of plain decodes of every running
        # request leaves the next step's plan known, the same less the requests that finished, after blocks for
        # the ones that filled theirs. Set by such a step's update (the plan, its requests, the ones that filled
        # their last block, the places of the finished), taken by the next `schedule`.
        self.decoding: tuple[list[ScheduledSequence], list[Request], list[Request], list[int]] | None = None
        # a reused plan and its requests, which its update need not gather again
        self.planned: tuple[list[ScheduledSequence], list[Request]] = ([], [])

    def add(self, request: Request) -> Request:
        """Queue a request and its forks (checked: each must fit the model's context and, alone, the pool; the
        forks must have its prompt)."""
        for r in (request, *request.forks):
            self._check(r)
            if r.forks and r is not request or r.prompt != request.prompt:
                raise ValueError("forks: expected samples of the request's own prompt, with no forks of their own")
        for r in (request, *request.forks):
            r.order = next(self.counter)
            r.status = RequestStatus.WAITING
        self.parents.update(dict.fromkeys(request.forks, request))
        self.waiting.append(request)
        return request

    def _check(self, request: Request) -> None:
        s = request.sampling
        if not request.prompt:
            raise ValueError("prompt: expected at least one token")
        if s.max_tokens < 1 or len(request.prompt) + s.max_tokens - 1 > self.max_seq_len:
            raise ValueError(f"prompt of {len(request.prompt)} tokens + max_tokens={s.max_tokens}: the model's "
                             f"context is {self.max_seq_len} tokens")
        if self.pool.blocks_for(len(request.prompt) + s.max_tokens) > self.pool.num_blocks:
            raise ValueError(f"prompt + max_tokens need more than the cache's {self.pool.num_blocks} blocks")
        if self.speculate and (s.logprobs is not None or s.prompt_logprobs is not None):
            raise ValueError("logprobs: not reported with speculative decoding (a draft model)")
        if self.speculate and request.processed:
            raise ValueError("structured outputs, logit_bias, penalties and min_tokens: not applied with speculative "
                             "decoding (a draft model)")

    def abort(self, request: Request) -> None:
        """Stop a request now (a client that went away): its blocks go back at once. A fork not started yet
        leaves its request's forks; a request with forks waiting on its prompt hands them to the first of them,
        which takes its place."""
        if (parent := self.parents.pop(request, None)) is not None:
            parent.forks.remove(request)
        elif request.forks:
            heir, heir.forks, request.forks = request.forks[0], request.forks[1:], []
            del self.parents[heir]
            self.parents.update(dict.fromkeys(heir.forks, heir))
            if request in self.waiting:
                self.waiting[self.waiting.index(request)] = heir
            else:
                self.waiting.appendleft(heir)
        if request in self.waiting:
            self.waiting.remove(request)
        if request in self.running:
            self._release(request)
            self.decoding = None  # the next plan is made in full, without it
        if not request.status.finished:
            request.status = RequestStatus.FINISHED_ABORTED
        self.aborted += 1

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def take_changes(self) -> Changes:
        """What changed for the runner since the last call (serve/step.py)."""
        changes, self.changes = self.changes, Changes()
        return changes

    def _release(self, request: Request) -> None:
        del self.running[request]
        self.pool.release(request.table)
        self.changes.released.append(request)

    def schedule(self) -> list[ScheduledSequence]:
        """This step's plan: decodes, then the chunks of the prompts being computed (oldest first), then newly
        admitted requests, within the token budget; blocks made ready for all of it."""
        self.changes.dropped, self.planned = None, ([], [])  # (not holding finished requests past their step)
        if self.decoding is not None:
            steady, self.decoding = self._decode_again(*self.decoding), None
            if steady is not None:
                return steady
        plan: list[ScheduledSequence] = []
        prefilling = []
        room = self.pool.block_size
        running = RequestStatus.RUNNING
        for request in list(self.running):  # decodes: one token each (and the draft's), every step
            # one preempted by an earlier request's growth this step is waiting again (a status check, where a
            # search of the running list would make the step quadratic in the batch)
            if request.status is not running:
                continue
            length = len(request.prompt) + len(request.output)
            if length - request.computed != 1:
                prefilling.append(request)
                continue
            lookahead = self.lookahead(request) if self.speculate else 0
            if length + lookahead > len(request.table) * room and not self._grow(request, length + lookahead):
                continue  # it was the newest: its own blocks went back
            plan.append(ScheduledSequence(request, 1, lookahead))
        budget = self.max_batch_tokens - len(plan)
        filling: dict[bytes, int] = {}  # the prompt blocks this step's chunks fill (key -> block): shared as cached
        for request in prefilling:  # prefills, oldest first, within the budget
            if request.status is not running:  # preempted by a decode's growth since
                continue
            count = max(0, min(request.length - request.computed, budget))
            if count:
                plan.append(ScheduledSequence(request, count))
                budget -= count
            if self.waiting:
                self._filling(request, count, filling)
        if budget > 0 and self.waiting:
            plan += self._admit(budget, filling)
        if not plan and self.waiting and not self.running:
            raise RuntimeError("the pool cannot hold the first waiting request")  # add() prevents this
        return plan

    def _decode_again(self, plan: list[ScheduledSequence], requests: list[Request], filled: list[Request],
                      finished: list[int]) -> list[ScheduledSequence] | None:
        """The plan of a step that follows one of plain decodes of every running request (`decoding`): the same
        decodes less the requests that finished (at `finished` in it, ascending), the ones that filled their last
        block given one more. None when that is not this step's plan (requests arrived or were preempted); then
        `schedule` plans it in full. (An abort since makes it so too.)"""
        running = RequestStatus.RUNNING
        for request in filled:  # in the order the full schedule grows them (skipping any a growth preempted)
            if request.status is running and not self._grow(request, request.length):
                return None  # it was the newest: it waits again
        if self.waiting:  # requests arrived, or a growth preempted one
            return None
        plan, requests = plan.copy(), requests.copy()
        for i in reversed(finished):  # a few places out of hundreds: no pass over the rest
            del plan[i], requests[i]
        self.planned, self.changes.dropped = (plan, requests), finished
        return plan

    def _grow(self, request: Request, tokens: int) -> bool:
        """Give `request` blocks for `tokens` tokens, preempting the newest running requests while the pool is
        short; False when `request` itself was the one preempted."""
        while not self.pool.grow(request.table, tokens):
            self.preemptions += 1
            if self._preempt() is request:
                return False
        self.changes.retabled.append(request)
        return True

    def lookahead(self, request: Request) -> int:
        """How many draft tokens this request's next decode verifies: `speculate`, fewer near its end."""
        if not self.speculate:
            return 0
        room = min(request.sampling.max_tokens - len(request.output), self.max_seq_len + 1 - request.length)
        return max(0, min(self.speculate, room - 1))

    def update(self, plan: list[ScheduledSequence], result: StepResult) -> list[tuple[Request, int]]:
        """Apply a step's tokens; return (request, new token) for each token that came out (finished ones too).

        Each plain decode's output grows by its token, and only the flagged ones can have stopped, reached
        max_tokens or filled a block; the special sequences go through `_apply`. The flagged and the special are
        applied in the plan's order, as the blocks they free and take must be. At GRPO's width this runs over
        hundreds of requests a step, so it touches nothing else of the plain decodes."""
        tokens, n = result.decoded, len(plan)
        if len(tokens) != n:
            raise ValueError(f"a step of {n} sequences got {len(tokens)} results")
        forked, lps, fork_lps, prompt_lps = result.forked, result.logprobs, result.fork_logprobs, result.prompt_logprobs
        more, drafted = result.more, result.drafted
        requests = self.planned[1] if plan is self.planned[0] else [seq.request for seq in plan]
        B, events, filled, finished = self.pool.block_size, [], [], []
        running = RequestStatus.RUNNING
        flagged = iter(result.flagged)
        f, start = next(flagged, n), 0
        for end in (*result.special, n):  # the plain decodes before each special sequence, then it
            part = list(zip(requests[start:end], tokens[start:end]))
            for request, token in part:
                request.output.append(token)
                request.computed += 1
            events += part
            while f < end:
                request = requests[f]
                self._decoded_one(request, tokens[f])
                if request.status is not running:
                    finished.append(f)
                elif request.computed % B == 0:
                    filled.append(request)  # its next token starts a block
                f = next(flagged, n)
            if end < n:
                new = ([tokens[end]] if tokens[end] >= 0 else []) + (more[end] if more else [])
                self._apply(plan[end], new, drafted[end] if drafted else 0, forked and forked[end] or [],
                            lps[end] if lps else None, fork_lps[end] if fork_lps else None,
                            prompt_lps[end] if prompt_lps else None, events)
            start = end + 1
        self._sort_running()  # forks started
        if not result.special and n == len(self.running) + len(finished) and not self.speculate:
            self.decoding = (plan, requests, filled, finished)  # every running request decoded
        return events

    def _decoded_one(self, request: Request, token: int) -> None:
        """After a decode appended `token`: finish the request at a stop id, its grammar's end or max_tokens, else
        offer the block it filled for sharing."""
        if stops(request, token):
            request.status = RequestStatus.FINISHED_STOPPED
            self._release(request)
        elif len(request.output) >= request.sampling.max_tokens:
            request.status = RequestStatus.FINISHED_LENGTH
            self._release(request)
        elif request.computed % self.pool.block_size == 0:  # it filled a block
            self._commit(request, request.computed - 1)

    def _apply(self, seq: ScheduledSequence, new: list[int], drafted: int, first: list[int], new_lp, first_lp,
               prompt_lp, events: list) -> None:
        """Apply one sequence's share of a step: its new tokens (`new`, of which `drafted` were verified drafts),
        its forks' first tokens, and the log-probabilities asked for."""
        request, before = seq.request, seq.request.computed
        if seq.count > 1 or request.computed < len(request.prompt):
            self.prefill_tokens += seq.count
        if prompt_lp:  # by position: a prompt computed again (after a preemption) rewrites its own entries
            request.prompt_logprobs[before:before + len(prompt_lp)] = prompt_lp
        if not seq.samples:
            request.computed += seq.count  # a prefill chunk short of the end: no token yet
            self._commit(request, before)
            return
        self.drafted += drafted
        self.accepted += len(new) - 1
        last = request.length - 1  # the position fed this step; the drafts were fed after it
        if request.forks:  # before the request can finish and let its blocks go
            self._fork(request, first, events, first_lp)
        self._finish(request, new, events, new_lp)
        # Every new token but the last is a kept draft, whose keys and values the target computed; the last is fed
        # next step. The draft computed its cache up to the draft before the last it proposed.
        request.computed = request.length - 1
        if drafted:
            request.draft_computed = min(request.computed, last + drafted)
        if request.status.finished:
            return
        held = len(request.table)
        self.pool.shrink(request.table, max(request.computed, len(request.prompt)))
        if len(request.table) != held:
            self.changes.retabled.append(request)
        self._commit(request, before)

    def _finish(self, request: Request, tokens: list[int], events: list, logprobs: list | None = None) -> None:
        """Append `tokens` until a stop id or max_tokens; release the request when it is done."""
        if self._append(request, tokens, events, logprobs):
            self._release(request)

    def _append(self, request: Request, tokens: list[int], events: list, logprobs: list | None = None) -> bool:
        """Append `tokens` (and their `logprobs`, if any) until a stop id or max_tokens; whether that finished
        the request."""
        s = request.sampling
        for i, token in enumerate(tokens):
            request.output.append(token)
            if logprobs is not None:
                request.logprobs.append(logprobs[i])
            events.append((request, token))
            if stops(request, token):
                request.status = RequestStatus.FINISHED_STOPPED
            elif len(request.output) >= s.max_tokens:
                request.status = RequestStatus.FINISHED_LENGTH
            if request.status.finished:
                return True
        return False

    def _fork(self, parent: Request, tokens: list[int], events: list, logprobs: list | None = None) -> None:
        """Start `parent`'s forks, its prompt now computed: each shares the prompt's full blocks, takes a copy of
        the partly filled last one (queued in `changes.copies`, made in the cache before the next step's forward)
        and its first token from the parent's last prompt position (`tokens`, drawn by the runner with the fork's
        own sampling). A fork the pool has no block for waits at the front of the queue with that token, as a
        preempted request does, and computes the prompt itself."""
        forks, parent.forks = parent.forks, []
        for i, (fork, token) in enumerate(zip(forks, tokens, strict=True)):
            del self.parents[fork]
            fork.prompt_logprobs = list(parent.prompt_logprobs)  # the same prompt: the same values
            first = None if logprobs is None or logprobs[i] is None else [logprobs[i]]
            got = self.pool.fork(parent.table, len(parent.prompt))
            if got is None:
                if not self._append(fork, [token], events, first):
                    self.waiting.appendleft(fork)
                continue
            fork.table, copy = got
            if copy is not None:
                self.changes.copies.append(copy)
            fork.computed, fork.draft_computed = len(fork.prompt), 0  # a draft model computes its own cache
            # the same prompt: the same keys for its full blocks (a fork's first commit would hash them all again)
            fork.block_keys = parent.block_keys[:len(parent.prompt) // self.pool.block_size]
            fork.status = RequestStatus.RUNNING
            self._start(fork)
            self._finish(fork, [token], events, first)

    def _preempt(self) -> Request:
        victim = next(reversed(self.running))  # the newest
        self._release(victim)
        victim.computed = victim.draft_computed = 0
        victim.status = RequestStatus.WAITING
        self.waiting.appendleft(victim)
        return victim

    def _admit(self, budget: int, filling: dict[bytes, int]) -> list[ScheduledSequence]:
        """Admit waiting requests in arrival order while the step has room, each with its first chunk. A prompt
        block that a chunk planned before it fills in this step is shared as if cached (`filling`): the step
        writes every chunk's keys and values before any chunk attends (`PagedKVCache.attend`), so requests that
        arrive together behind one prompt (GRPO's groups, clients behind one system prompt) compute it once and
        start together, where waiting for it to be cached would cost a step. (A chunk that stops short of a
        block has used up the step's budget: nothing is admitted after it, so no request shares a block that a
        later step fills.) One the pool cannot hold stops admission, so that smaller requests behind it never
        starve it."""
        plan = []
        while self.waiting and budget > 0:
            request = self.waiting.popleft()
            tokens = request.tokens
            # a prompt whose log-probabilities are asked for is computed whole: no cached prefix to take
            sharing = self.prefix_caching and request.sampling.prompt_logprobs is None
            got = self.pool.allocate(tokens, len(tokens), filling, request.block_keys) if sharing else \
                self.pool.allocate([], len(tokens))
            if got is None:
                self.waiting.appendleft(request)
                break
            request.table, request.computed = got
            request.draft_computed = 0  # the draft's cache of a shared prefix may not be whole: it recomputes
            request.status = RequestStatus.RUNNING
            self._start(request)
            plan.append(ScheduledSequence(request, min(len(tokens) - request.computed, budget)))
            budget -= plan[-1].count
            self._filling(request, plan[-1].count, filling)
        self._sort_running()
        return plan

    def _start(self, request: Request) -> None:
        """Add `request`, holding its new block table, to the running ones (`_sort_running` puts it in place)."""
        self.running[request] = None
        self.changes.retabled.append(request)
        self.unsorted = True

    def _sort_running(self) -> None:
        if self.unsorted:
            self.running = dict.fromkeys(sorted(self.running, key=lambda r: r.order))
            self.unsorted = False

    def _filling(self, request: Request, count: int, filling: dict[bytes, int]) -> None:
        """Add the prompt blocks that `request`'s chunk of `count` tokens fills this step to `filling` (key -> the
        block), for requests admitted after it to share. The keys are the request's own (`Request.block_keys`,
        extended here): a long prompt in chunks is hashed once, not every step."""
        B = self.pool.block_size
        if self.prefix_caching and request.computed < len(request.prompt) and (request.computed + count) // B:
            keys = self.pool.prefix_keys(request.prompt[:len(request.prompt) - 1], request.block_keys)
            first = request.computed // B
            filling.update((key, request.table[i]) for i, key in enumerate(keys[first:(request.computed + count) // B],
                                                                           first))

    def _commit(self, request: Request, before: int) -> None:
        """Offer the request's computed full blocks for sharing, when this step filled one; only the blocks not
        hashed before are (`Request.block_keys`)."""
        if self.prefix_caching and request.computed // self.pool.block_size > before // self.pool.block_size:
            self.pool.commit(request.table, request.token_slice(0, request.computed), request.block_keys)


def stops(request: Request, token: int) -> bool:
    """Whether `token`, just appended, ends `request`: a stop id, or its grammar fed it and has ended (nothing more
    may follow)."""
    return token in request.sampling.stop_ids or request.grammar is not None and request.grammar.advance(token)
