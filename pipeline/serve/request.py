"""A request to the engine: its prompt, how to sample it, what it generated so far and where it stands."""

from __future__ import annotations

import enum
import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kiln.pipeline.serve.grammar import Grammar

# What `kiln generate` and `kiln chat` sample with unless told otherwise (serve/text_model.py's Sampling; their
# --help quotes these). evaluate's samples are greedy, set by the eval section, so its report is the same every run.
TOOLS_TEMPERATURE, TOOLS_TOP_K, TOOLS_TOP_P = 0.8, None, 0.95
# The hottest sampling kiln generate, chat and serve accept: OpenAI's API bound. Past it a trained model's
# distribution is close to uniform noise, and a huge value (1e308) overflows the sampler's float32 to inf.
MAX_TEMPERATURE = 2.0


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int
    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None
    stop_ids: frozenset[int] = frozenset()
    # log-probabilities to report (the model's log-softmax at temperature 1 over the whole vocabulary), with this
    # many likeliest alternatives each: of every generated token (`logprobs`), of every prompt token after the
    # first (`prompt_logprobs`: the prompt is then computed whole, never taken from the prefix cache). None: none.
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    # what the logits get before the draw (serve/logits_processors.py): (token id, bias) pairs added, OpenAI's
    # penalties over the output's tokens, vLLM's over the prompt's and the output's, and the stop ids held back
    # until the output has min_tokens
    logit_bias: tuple[tuple[int, float], ...] = ()
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0

    @property
    def processes(self) -> bool:
        """Whether its logits are processed before the draw."""
        return bool(self.logit_bias or self.presence_penalty or self.frequency_penalty or self.min_tokens
                    or self.repetition_penalty != 1)

    def __post_init__(self):
        # a set: every sampled token is looked up in it (GRPO's and the bench's hold hundreds). Equal sets are one
        # object while any request holds it, so what is keyed on a request's set (the runner's counts of stop ids,
        # serve/input_batch.py) finds it by identity, not by comparing hundreds of ids per request.
        stop_ids = frozenset(self.stop_ids)
        object.__setattr__(self, "stop_ids", _STOP_SETS.setdefault(stop_ids, stop_ids))


_STOP_SETS: weakref.WeakValueDictionary[frozenset[int], frozenset[int]] = weakref.WeakValueDictionary()

# A token's log-probability and its likeliest alternatives, (token id, log-probability) best first
Logprob = tuple[float, list[tuple[int, float]]]


class RequestStatus(enum.Enum):
    """Where a request stands. A finished status's value is its OpenAI `finish_reason`."""

    WAITING = "waiting"  # queued, or preempted and queued again at the front
    RUNNING = "running"  # holding blocks, scheduled every step
    FINISHED_STOPPED = "stop"  # a stop id came out (it is kept in the output)
    FINISHED_LENGTH = "length"  # max_tokens came out
    FINISHED_ABORTED = "abort"  # the client went away
    FINISHED_REFUSED = "refused"  # the engine would not take it (`Request.error` says why)

    @property
    def finished(self) -> bool:
        return self._value_ in FINISHED  # by value: a member's own hash is a Python call, asked per request per step


FINISHED = frozenset(s.value for s in RequestStatus if s.name.startswith("FINISHED"))


@dataclass(eq=False)  # a request is itself: two with the same prompt and sampling are still two
class Request:
    prompt: list[int]
    sampling: SamplingParams
    id: str = ""
    output: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    error: str | None = None  # why it was refused
    # the scheduler's books
    table: list[int] = field(default_factory=list)  # the blocks holding its tokens' keys and values
    computed: int = 0  # tokens whose keys and values are in the cache
    draft_computed: int = 0  # the same in the draft model's cache (speculative decoding)
    order: int = 0  # arrival: preemption takes the newest
    block_keys: list[bytes] = field(default_factory=list)  # prefix-cache keys of its full blocks hashed so far
    # Other samples of the same prompt (a request's `n`, a GRPO group). They are never queued: when this request's
    # prompt has been computed they fork onto its blocks and draw their first tokens from its last prompt
    # position's logits, so the prompt is computed once for all of them.
    forks: list[Request] = field(default_factory=list)
    # with `sampling.logprobs`: one per output token; with `sampling.prompt_logprobs`: one per prompt position but
    # the last, position p's for token p + 1
    logprobs: list[Logprob] = field(default_factory=list)
    prompt_logprobs: list[Logprob] = field(default_factory=list)
    # the runner's: the sampler's noise key (its seed, or a random one for an unseeded request), set at its first
    # draw (an attribute: a dictionary keyed on requests cost a lookup per request every step)
    noise_key: int | None = None
    slot: int = -1  # its row in the runner's InputBatch while it runs (serve/input_batch.py)
    grammar: Grammar | None = None  # structured output: the tokens allowed next (serve/grammar.py)

    @property
    def processed(self) -> bool:
        """Whether its logits are processed before each draw (a grammar, or its sampling's asks)."""
        return self.grammar is not None or self.sampling.processes

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    @property
    def length(self) -> int:  # len(tokens), without building the list: the scheduler asks every step
        return len(self.prompt) + len(self.output)

    def token(self, i: int) -> int:
        """tokens[i] for 0 <= i < length, without building the list."""
        n = len(self.prompt)
        return self.prompt[i] if i < n else self.output[i - n]

    def token_slice(self, start: int, stop: int) -> list[int]:
        """tokens[start:stop], without building the whole list (a decode needs one token of it every step)."""
        n = len(self.prompt)
        if stop <= n:
            return self.prompt[start:stop]
        if start >= n:
            return self.output[start - n:stop - n]
        return self.prompt[start:] + self.output[:stop - n]

    @property
    def finish_reason(self) -> str | None:
        return self.status.value if self.status.finished else None


def fork_groups(requests: list[Request], n: int) -> list[Request]:
    """Make each run of `n` requests (samples of one prompt, in order) its first request with the others as its
    forks; return those first requests, which are what an engine is given."""
    for k in range(0, len(requests), n):
        requests[k].forks = requests[k + 1:k + n]
    return requests[::n]
