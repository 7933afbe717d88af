"""The model runner: a step's plan in, every request's new tokens out, with one transfer each way.

Everything the step needs on the device (the token ids, the cache's positions, slots and block tables, which
rows sample and with what temperature, top-k and top-p) is packed on the host, mostly by indexing the per-slot
rows it keeps across steps (serve/input_batch.py), and crosses in one copy (`transfer.HostToDevice`); the model
runs the flat batch over the paged cache; `sampler.sample` draws every sampling row's token on the device (its
noise keyed on the request and position, one set of ops for the batch); the tokens come back in one read. A step
with no row to sample reads nothing back.

Speculative decoding (a draft model) keeps its per-request acceptance (serve/speculative.py): each verified
draft reads its row back, so its steps cost more than one transfer; what it saves is target forwards.
"""

from __future__ import annotations

import itertools
import time
import weakref
from dataclasses import dataclass, field

import numpy as np
import torch

from kiln.model.generate import sampling_probs
from kiln.pipeline.serve import logits_processors
from kiln.pipeline.serve.graphs import DecodeGraphs
from kiln.pipeline.serve.kv_cache import PagedKVCache, Segment
from kiln.pipeline.serve.input_batch import InputBatch
from kiln.pipeline.serve.request import Request, RequestStatus
from kiln.pipeline.serve.sampler import sample
from kiln.pipeline.serve.step import Changes, ScheduledSequence, StepResult
from kiln.pipeline.serve.speculative import accept, accept_greedy


class LogprobsAsked:
    """The log-probabilities a step's requests ask for (`SamplingParams.logprobs`, `prompt_logprobs`): the model's
    log-softmax at temperature 1 over the whole vocabulary, with the k likeliest alternatives, computed on the
    device in the step that has the logits, read back with its tokens. Their rows and targets cross to the
    device with the step's other indices (`indices`, before the forward)."""

    def __init__(self, plan: list[ScheduledSequence], logit_counts: np.ndarray, last: np.ndarray, params: list):
        # sampled rows (indices into the step's sampled requests) whose token's log-probability is asked for
        self.tokens = [(j, p.logprobs) for j, p in enumerate(params) if p.logprobs is not None]
        # prompt positions: (plan index, logits rows, target prompt tokens, k), for the positions the chunk
        # computes whose next token is still the prompt's (the last one's next is sampled)
        self.prompt = []
        for i, seq in enumerate(plan):
            r, k = seq.request, seq.request.sampling.prompt_logprobs
            m = min(seq.count, len(r.prompt) - 1 - r.computed)
            if k is not None and m > 0:
                first = last[i] - logit_counts[i] + 1
                self.prompt.append((i, list(range(first, first + m)), r.prompt[r.computed + 1:r.computed + 1 + m], k))
        self.size = len(plan)
        self.k_tokens = max((k for _, k in self.tokens), default=0)
        self.k_prompt = max((p[3] for p in self.prompt), default=0)

    def indices(self) -> dict[str, np.ndarray]:
        out = {}
        if self.tokens:
            out["logprob_rows"] = np.array([j for j, _ in self.tokens], dtype=np.int64)
        if self.prompt:
            out["prompt_rows"] = np.array([row for p in self.prompt for row in p[1]], dtype=np.int64)
            out["prompt_targets"] = np.array([t for p in self.prompt for t in p[2]], dtype=np.int64)
        return out

    def compute(self, logits: torch.Tensor, new: torch.Tensor | None,
                on_device: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        """The values to read back, flat float64: per part, each row's log-probability, then the k best values and
        their ids."""
        out = []
        if self.tokens:
            rows = on_device["logprob_rows"]
            chosen = logits[on_device["sample_rows"]] if "sample_rows" in on_device else logits
            out += _logprobs(chosen[rows], new[rows], self.k_tokens)
        if self.prompt:
            out += _logprobs(logits[on_device["prompt_rows"]], on_device["prompt_targets"], self.k_prompt)
        return out

    def unpack(self, read: list[float], rows: list[int], fork_rows: list) -> tuple:
        """(logprobs per plan sequence, per fork, prompt logprobs per plan sequence) from the read-back values,
        None where nothing was asked."""
        if not self.tokens and not self.prompt:
            return None, None, None
        sampled = {}  # sampled row -> its token's entry
        if self.tokens:
            got = _entries(read, len(self.tokens), self.k_tokens, [k for _, k in self.tokens])
            sampled = {j: entry for (j, _), entry in zip(self.tokens, got)}
        logprobs = [None] * self.size
        for j, i in enumerate(rows):
            if j in sampled:
                logprobs[i] = [sampled[j]]
        fork_logprobs = [[] for _ in range(self.size)]
        for n, (i, _) in enumerate(fork_rows):
            fork_logprobs[i].append(sampled.get(len(rows) + n))
        prompt_logprobs = [None] * self.size
        if self.prompt:
            at = len(self.tokens) * (1 + 2 * self.k_tokens)  # the prompt positions' values follow the tokens'
            got = iter(_entries(read[at:], sum(len(p[2]) for p in self.prompt), self.k_prompt,
                                [k for _, _, targets, k in self.prompt for _ in targets]))
            for i, _, targets, _ in self.prompt:
                prompt_logprobs[i] = list(itertools.islice(got, len(targets)))
        return logprobs, fork_logprobs, prompt_logprobs


def _entries(read: list[float], n: int, k: int, ks: list[int]) -> list:
    """n (log-probability, [(id, value) x ks[r]]) entries from `read`: n values, then n x k best values, then their
    n x k ids (`_logprobs`' layout)."""
    values, best, ids = read[:n], read[n:n + n * k], read[n + n * k:n + 2 * n * k]
    return [(values[r], [(int(ids[r * k + c]), best[r * k + c]) for c in range(ks[r])]) for r in range(n)]


NOTHING_ASKED = LogprobsAsked([], [], [], [])  # a step without log-probabilities (most): no work at all


def _logprobs(logits: torch.Tensor, targets: torch.Tensor, k: int) -> list[torch.Tensor]:
    """Each row's log-softmax at its target, then its k best values and their ids, flat float64."""
    lp = logits.float().log_softmax(dim=-1)
    out = [lp.gather(1, targets[:, None])[:, 0].double()]
    best = lp.topk(min(k, lp.size(-1)), dim=-1) if k else None
    if best is not None:
        out += [best.values.double().reshape(-1), best.indices.double().reshape(-1)]
    return out


@dataclass
class PackedStep:
    """A step's rows as `ModelRunner._pack` packs them on the host, in the plan's order: what the device runs and
    what reading back applies. `plain_decodes`: every sequence feeds its last token and samples one, nothing else
    asked (the rest is then not packed: `_decode` packs its own)."""

    slots: np.ndarray
    counts: np.ndarray  # new tokens a sequence feeds
    starts: np.ndarray  # its first new token's position
    lengths: np.ndarray  # its tokens so far
    rows: np.ndarray  # the sequences that sample a token
    fork_rows: list[tuple[int, Request]]  # (sequence, fork) for the forks whose first token it draws
    decodes_only: bool
    plain_decodes: bool = True
    tables: np.ndarray | None = None
    logit_counts: np.ndarray | None = None  # logits rows per sequence
    extra: dict[str, np.ndarray] = field(default_factory=dict)  # to the device with the cache's arrays
    settings: dict[str, np.ndarray] | None = None  # the sampler's, None when every row is greedy
    asked: LogprobsAsked = NOTHING_ASKED


class ModelRunner:
    """Runs `model` (and a `draft`, for speculative decoding) over `cache` (and `draft_cache`)."""

    def __init__(self, model, cache: PagedKVCache, draft=None, draft_cache: PagedKVCache | None = None,
                 graph_batch: int = 0):
        self.model, self.cache, self.draft, self.draft_cache = model, cache, draft, draft_cache
        # decode-only steps of up to `graph_batch` sequences replay CUDA graphs (serve/graphs.py): on CUDA with the
        # paged kernel, and without a draft, whose steps have other shapes
        capturable = cache.device.type == "cuda" and cache.triton and draft is None
        self.graphs = DecodeGraphs(model, cache, graph_batch) if graph_batch and capturable else None
        if self.graphs:
            self.graphs.capture_all()
        self.vocab_size = model.config.vocab_size
        self.batch = InputBatch(cache.max_blocks, self.vocab_size)  # the running requests' rows, kept across steps
        # `kiln bench serve` turns this on to split a step's time into the device's and the host's: the device's
        # is read around the forward and sampling and around the forks' block copies (with a device sync on CUDA,
        # which timing costs)
        self.timing, self.device_seconds, self.reads = False, 0.0, 0
        # unseeded requests' noise keys, from torch's seed so that torch.manual_seed makes a run repeat (drawn on
        # the host: a torch draw would be a tensor read every time a request starts)
        self.unseeded = np.random.default_rng(torch.initial_seed())
        # a seeded request's own generator for the speculative path's draws, gone with the request
        self.generators: weakref.WeakKeyDictionary[Request, torch.Generator] = weakref.WeakKeyDictionary()
        # the requests of a step that verified drafts: their rows are rewritten before the next step
        self.stale: list[Request] = []
        # the slots of the last step when it was plain decodes, in its plan's order, and of this step when its
        # plan is that one less a few sequences (`Changes.dropped`): found without a pass over the requests
        self.decoded: np.ndarray | None = None
        self.follows: np.ndarray | None = None

    @property
    def device(self) -> torch.device:
        return self.cache.device

    def apply(self, changes: Changes) -> None:
        """The scheduler's changes since the last step (`Scheduler.take_changes`) into the per-slot rows, and the
        rows of a verified draft's step (which `advance` does not follow) rewritten from their requests; then the
        forks' copies of their prompt's partly filled last block, in the cache: device work, as vLLM's workers
        run a step's blocks_to_copy, timed with the forward (they stand in for the prompt each fork would
        otherwise compute itself)."""
        dropped = changes.dropped  # the plan is the last step's plain decodes less the sequences at these places
        self.follows = None if dropped is None or self.decoded is None else np.delete(self.decoded, dropped)
        self.batch.release(changes.released)
        running = RequestStatus.RUNNING  # not finished or preempted since
        self.batch.write(list({r: None for r in changes.retabled if r.status is running}), self._key)  # once each
        self.batch.stand([r for r in self.stale if r.status is running])
        self.stale = []
        if changes.copies:
            started = self._clock()
            self.cache.copy_blocks(changes.copies)
            if self.timing:
                self.device_seconds += self._clock() - started

    @torch.no_grad()
    def execute(self, plan: list[ScheduledSequence]) -> StepResult:
        """The plan's step: packed on the host (`_pack`), run on the device (`_run`: the forward, the sampler and
        the log-probabilities asked for), its tokens read back in one copy (`_read_back`). Plain decodes take
        `_decode`, a step with drafts to verify `_speculative`."""
        follows, self.follows, self.decoded = self.follows, None, None
        if self.draft is not None and any(seq.lookahead for seq in plan):
            self.stale = [seq.request for seq in plan]
            return self._speculative(plan)
        if follows is not None and len(follows) == len(plan):
            return self._decode(follows)
        step = self._pack(plan)
        if step.plain_decodes:
            return self._decode(step.slots)
        new, values = self._run(step)
        return self._read_back(step, new, values)

    def _pack(self, plan: list[ScheduledSequence]) -> PackedStep:
        """The step's rows from the per-slot rows and the plan: which sequences sample (their chunk ends where
        their tokens do) and which forks start, each row's logits rows, the token ids, and the arrays the device
        needs besides the cache's."""
        n, b = len(plan), self.batch
        requests = [seq.request for seq in plan]
        slots = b.slots(requests)
        counts = np.fromiter((seq.count for seq in plan), np.int64, n)
        starts, lengths = b.computed[slots], b.length[slots]
        rows = np.flatnonzero(starts + counts == lengths)  # the sequences that get a token: their chunk ends there
        # a request whose prompt ends here draws its forks' first tokens from the same row, each its own way
        ending = rows[starts[rows] < b.prompt_len[slots[rows]]].tolist()
        fork_rows = [(i, fork) for i in ending if requests[i].forks for fork in requests[i].forks]
        forks = [fork for _, fork in fork_rows]
        asks = bool(b.logprobs[slots].any()) or any(f.sampling.logprobs is not None for f in forks)
        processed = bool(b.processed[slots[rows]].any()) or any(f.processed for f in forks)
        decodes_only = n == 0 or counts.max() == 1
        step = PackedStep(slots, counts, starts, lengths, rows, fork_rows, decodes_only)
        if n and decodes_only and len(rows) == n and not ending and not asks:
            return step
        step.plain_decodes = False
        step.tables = b.block_tables(slots, starts + counts, self.cache.block_size)
        # each row's logits rows: one, or every position of a prompt whose log-probabilities are asked for
        logit_counts = np.ones(n, np.int64)
        if asks:
            whole = np.fromiter((r.sampling.prompt_logprobs is not None for r in requests), bool, n)
            logit_counts[whole] = counts[whole]
        step.logit_counts = logit_counts
        wide = bool(logit_counts.sum() > n)
        last = np.cumsum(logit_counts) - 1 if wide else np.arange(n)
        # a row that feeds its sequence's last token (a decode) reads it from its slot; the others (prompt
        # chunks, a preempted request's recompute) their tokens from the request
        ids = np.repeat(b.last[slots], counts)
        chunks = np.flatnonzero((counts > 1) | (starts + counts < lengths)).tolist()
        if chunks:
            firsts = (np.cumsum(counts) - counts).tolist()
            for i in chunks:
                ids[firsts[i]:firsts[i] + counts[i]] = requests[i].token_slice(starts[i], starts[i] + counts[i])
        step.extra = {"ids": ids}
        if len(rows) < n or fork_rows or wide:  # the logits rows the sampler reads, when not all in order
            step.extra["sample_rows"] = np.concatenate([last[rows], last[[i for i, _ in fork_rows]]]).astype(np.int64)
        step.settings = self._settings(slots[rows], lengths[rows], forks)
        if step.settings is not None:  # an all-greedy step needs no sampling settings on the device
            step.extra |= step.settings
        sampled = [*(requests[i] for i in rows), *forks]  # the sampler's rows, in its order
        if processed:
            step.extra |= logits_processors.pack(sampled, self.vocab_size)
        if asks:
            step.asked = LogprobsAsked(plan, logit_counts, last, [r.sampling for r in sampled])
            step.extra |= step.asked.indices()
        return step

    def _run(self, step: PackedStep) -> tuple[torch.Tensor | None, list[torch.Tensor]]:
        """The device's part: the forward, the sampled tokens (None when no sequence samples) and the
        log-probabilities asked for, still on the device."""
        rows = None if step.decodes_only else (step.counts, step.logit_counts)
        on_device, logits, started = self._forward(step.starts, step.tables, step.extra, rows)
        new = None
        if len(step.rows):  # (forks draw only beside their request's row)
            chosen = logits[on_device["sample_rows"]] if "sample_rows" in on_device else logits
            if "processed_rows" in on_device:  # (the model's own logits stay for the log-probabilities)
                chosen = logits_processors.process(chosen, on_device)
            new = sample(chosen, step.settings, on_device)
        values = step.asked.compute(logits, new, on_device)
        if self.timing:
            self.device_seconds += self._clock() - started
        return new, values

    def _read_back(self, step: PackedStep, new: torch.Tensor | None, values: list[torch.Tensor]) -> StepResult:
        """The step's one read back (the tokens and the log-probabilities asked for), applied to the per-slot
        rows; the result the scheduler applies."""
        b, n, rows, fork_rows = self.batch, len(step.slots), step.rows, step.fork_rows
        if new is None and not values:  # prompt chunks only, none at its end: each applied on its own
            b.advance(step.slots, step.counts, rows, np.zeros(0, np.int64))
            return StepResult([-1] * n, special=list(range(n)))
        self.reads += 1
        count = len(rows) + len(fork_rows)
        if values:  # the tokens and the log-probabilities in one copy (ids exact in float64)
            read = torch.cat([new.double() if new is not None else values[0].new_zeros(0), *values]).tolist()
            new_tokens = [int(t) for t in read[:count]]
        else:
            read, new_tokens = [], new.tolist()
        sampled = np.array(new_tokens[:len(rows)], dtype=np.int64)
        decoded = np.full(n, -1, np.int64)  # each sequence's token, -1 for a chunk short of its end
        decoded[rows] = sampled
        # the rows the scheduler applies one by one: prompt chunks (the ones ending here start their forks) and
        # rows with log-probabilities; the rest are plain decodes, applied together and flagged as a decode
        # step's are (a grammar's row always: it is fed each token)
        slots = step.slots
        plain = (decoded >= 0) & (step.counts == 1) & (step.starts >= b.prompt_len[slots]) & ~b.logprobs[slots]
        decodes = np.flatnonzero(plain)
        flagged = decodes[b.flagged(slots[decodes], decoded[decodes], self.cache.block_size)].tolist()
        b.advance(slots, step.counts, rows, sampled)
        forked: list[list[int] | None] | None = None
        if fork_rows:
            forked = [None] * n  # a list for each request whose forks start (a few of hundreds), None for the rest
            for (i, _), token in zip(fork_rows, new_tokens[len(rows):]):
                if forked[i] is None:
                    forked[i] = []
                forked[i].append(token)
        logprobs, fork_logprobs, prompt_logprobs = step.asked.unpack(read[count:], rows.tolist(), fork_rows)
        return StepResult(decoded.tolist(), flagged, np.flatnonzero(~plain).tolist(), forked, logprobs=logprobs,
                          fork_logprobs=fork_logprobs, prompt_logprobs=prompt_logprobs)

    def _decode(self, slots: np.ndarray) -> StepResult:
        """A step of plain decodes (the steady state: every sequence feeds its last token and samples one, nothing
        else asked), all from the rows of `slots`: the tokens as they are, and the few rows the scheduler must
        look at (`StepResult.flagged`), found before the rows move on."""
        b = self.batch
        starts, lengths = b.computed[slots], b.length[slots]
        tables = b.block_tables(slots, lengths, self.cache.block_size)
        extra = {"ids": b.last[slots]}
        settings = self._settings(slots, lengths, [])
        if settings is not None:
            extra |= settings
        if b.processed[slots].any():
            extra |= logits_processors.pack([b.holders[s] for s in slots.tolist()], self.vocab_size)
        on_device, logits, started = self._forward(starts, tables, extra)
        if "processed_rows" in on_device:
            logits = logits_processors.process(logits, on_device)
        new = sample(logits, settings, on_device)
        if self.timing:
            self.device_seconds += self._clock() - started
        self.reads += 1
        sampled = new.cpu().numpy()  # the step's one read back
        tokens = sampled.tolist()
        flagged = b.flagged(slots, sampled, self.cache.block_size).tolist()
        b.advance(slots, 1, None, sampled)
        self.decoded = slots
        return StepResult(tokens, flagged)

    def _forward(self, starts: np.ndarray, tables: np.ndarray, extra: dict[str, np.ndarray],
                 rows: tuple[np.ndarray, np.ndarray] | None = None) -> tuple[dict, torch.Tensor, float]:
        """The step's arrays to the device and the model's logits, with the clock read when the device's work
        began: decodes only (`rows` None), replaying a CUDA graph when one is as wide (the ids padded to it), or
        rows of (token counts, logits counts) as `PagedKVCache.begin_rows` takes them."""
        n = len(starts)
        bucket = self.graphs.bucket(n) if self.graphs and rows is None else None
        if bucket:
            extra["ids"] = np.pad(extra["ids"], (0, bucket - n))
        if rows is None:
            on_device = self.cache.begin_decodes(starts, tables, extra, pad_to=bucket or 0)
        else:
            on_device = self.cache.begin_rows(starts, *rows, tables, extra)
        started = self._clock()
        if bucket:
            return on_device, self.graphs.run(on_device)[:n], started
        return on_device, self.model(on_device["ids"][None], cache=self.cache)[0], started

    def _settings(self, slots: np.ndarray, positions: np.ndarray, forks: list[Request]) -> dict | None:
        """The sampled rows' settings for the sampler, from their slots' rows and then the forks' own (a fork has
        no slot until it runs): temperature, top-k (the vocabulary for none), top-p (1 for none), the noise key
        and the position each draws for. None when every row is greedy."""
        b = self.batch
        settings = {"temperature": b.temperature[slots], "top_k": b.top_k[slots], "top_p": b.top_p[slots],
                    "sample_keys": b.keys[slots], "sample_positions": positions}
        if forks:
            own = {"temperature": [f.sampling.temperature for f in forks],
                   "top_k": [f.sampling.top_k or self.vocab_size for f in forks],
                   "top_p": [1.0 if f.sampling.top_p is None else f.sampling.top_p for f in forks],
                   "sample_keys": [self._key(f) for f in forks], "sample_positions": [f.length for f in forks]}
            settings = {name: np.concatenate([a, np.array(own[name], dtype=a.dtype)]) for name, a in settings.items()}
        return settings if (settings["temperature"] > 0).any() else None

    def _clock(self) -> float:
        if self.timing and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def _key(self, request: Request) -> int:
        if request.noise_key is None:
            seed = request.sampling.seed
            seed = int(self.unseeded.integers(-2**63, 2**63 - 1, dtype=np.int64)) if seed is None else seed
            request.noise_key = (seed + 2**63) % 2**64 - 2**63  # its bits as an int64
        return request.noise_key

    def _generator(self, request: Request) -> torch.Generator | None:
        if request.sampling.seed is None:
            return None
        if request not in self.generators:
            self.generators[request] = torch.Generator(device=self.device).manual_seed(request.sampling.seed)
        return self.generators[request]

    def _sample_one(self, request: Request, logits: torch.Tensor) -> tuple[int, torch.Tensor | None]:
        """A token from one row of logits with the request's sampling, and the distribution it came from (None
        when greedy): the speculative path's draws, one request at a time."""
        s = request.sampling
        if s.temperature == 0:
            return int(logits.argmax()), None
        probs = sampling_probs(logits[None], s.temperature, s.top_k, s.top_p)[0]
        return int(torch.multinomial(probs, 1, generator=self._generator(request))), probs

    def _propose(self, plan: list[ScheduledSequence]) -> dict[int, tuple[list[int], list]]:
        """Each decode's draft tokens and the draft's distributions, from batched forwards of the draft: the
        first catches its cache up to the request's last token, each next one feeds the token just drafted."""
        drafts: dict[int, tuple[list[int], list]] = {id(seq.request): ([], []) for seq in plan}
        active = list(plan)
        for round_ in range(max(seq.lookahead for seq in plan)):
            active = [seq for seq in active if seq.lookahead > round_]
            segments, ids = [], []
            for seq in active:
                r = seq.request
                fed = r.tokens + drafts[id(r)][0]
                start = r.draft_computed if round_ == 0 else r.length - 1 + round_
                segments.append(Segment(r.table, start, len(fed) - start))
                ids += fed[start:]
            on_device = self.draft_cache.begin(segments, {"ids": np.array(ids, dtype=np.int64)})
            logits = self.draft(on_device["ids"][None], cache=self.draft_cache)[0]
            for seq, row in zip(active, logits):
                token, probs = self._sample_one(seq.request, row)
                drafts[id(seq.request)][0].append(token)
                drafts[id(seq.request)][1].append(probs)
        return drafts

    def _speculative(self, plan: list[ScheduledSequence]) -> StepResult:
        """A step whose decodes verify draft tokens: the target runs every sequence's tokens and drafts in one
        forward, and each decode keeps the drafts the acceptance rule keeps."""
        drafts = self._propose([seq for seq in plan if seq.lookahead])
        segments, ids = [], []
        for seq in plan:
            r = seq.request
            drafted = drafts.get(id(r), ([], []))[0]
            segments.append(Segment(r.table, r.computed, seq.count + len(drafted), 1 + len(drafted)))
            ids += r.tokens[r.computed:r.computed + seq.count] + drafted
        on_device = self.cache.begin(segments, {"ids": np.array(ids, dtype=np.int64)})
        logits = self.model(on_device["ids"][None], cache=self.cache)[0]
        rows = logits.split([s.logits for s in segments])
        best = logits.argmax(-1).tolist()  # every row's greedy token in one transfer, not one sync per request
        ends = itertools.accumulate(s.logits for s in segments)
        tokens, counts, forked = [], [], []

        def first(request: Request, row: torch.Tensor, end: int) -> int:
            """A token from the sequence's first logits row (its last fed token's), as `request` samples."""
            if request.sampling.temperature == 0:
                return best[end - len(row)]
            return self._sample_one(request, row[0])[0]

        for seq, row, end in zip(plan, rows, ends):
            r, s = seq.request, seq.request.sampling
            drafted, draft_probs = drafts.get(id(r), ([], []))
            counts.append(len(drafted))
            forked.append([first(fork, row, end) for fork in r.forks] if seq.samples else [])
            if not seq.samples:
                tokens.append([])
            elif not drafted:
                tokens.append([first(r, row, end)])
            elif s.temperature == 0:
                tokens.append(accept_greedy(row, drafted))
            else:
                target = sampling_probs(row, s.temperature, s.top_k, s.top_p)
                tokens.append(accept(target, torch.stack(draft_probs), drafted, self._generator(r)))
        # every sequence applied on its own (`special`): a step of drafts is not the steady state of plain decodes
        return StepResult([t[0] if t else -1 for t in tokens], special=list(range(len(plan))), forked=forked,
                          more=[t[1:] for t in tokens], drafted=counts)
