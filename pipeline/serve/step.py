"""The step contract between the scheduler, the engine and the model runner: what a step runs, what changed
since the last one, and what comes back.

Each step, the scheduler makes a plan (`ScheduledSequence`s), the engine hands the runner the scheduler's
`Changes` since the last step (the runner's only view of the scheduler's books) and then the plan, and the
runner gives back one `StepResult`, which the scheduler applies.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kiln.pipeline.serve.request import Logprob, Request


@dataclass(slots=True)
class ScheduledSequence:
    """One request's share of a step: tokens[computed:computed + count] fed, then `lookahead` draft tokens
    proposed and verified after them (a decode with a draft model)."""

    request: Request
    count: int
    lookahead: int = 0

    @property
    def samples(self) -> bool:
        """Whether this step yields tokens for it: its chunk reaches the end of its tokens."""
        return self.request.computed + self.count == self.request.length


@dataclass(slots=True)
class Changes:
    """What the runner must know before a step's plan runs, since it last asked: requests whose blocks went back
    and requests whose block table changed, in the order it happened (its per-slot rows follow them:
    serve/input_batch.py); `dropped`, set when this step's plan is the last step's plain decodes less the
    sequences at these places (its per-slot arrays then follow from the last step's; None when planned afresh);
    and `copies`, (block, copy, filled slots) for the forks started since, each fork's own copy of its prompt's
    partly filled last block, made in the cache before the fork first decodes."""

    released: list[Request] = field(default_factory=list)
    retabled: list[Request] = field(default_factory=list)
    dropped: list[int] | None = None
    copies: list[tuple[int, int, int]] = field(default_factory=list)


@dataclass
class StepResult:
    """What the runner gives back for a step's plan, per sequence in its order.

    The tokens come back flat: `decoded`, sequence i's first new token (-1 for a chunk short of its end);
    `special`, the sequences that are not plain decodes (prompt chunks, rows with log-probabilities, forks,
    verified drafts), applied one by one; and `flagged`, the plain decodes whose token may end their request or
    that filled a block (a superset, found with array operations), the only others the scheduler looks at. A step
    of plain decodes only (GRPO's and a loaded server's steady state) has no special sequence.

    Per sequence, where any has one (else None): `forked`, the first tokens of its forks (a request whose prompt
    ended this step: `Request.forks`, in their order); `more`, the tokens after its first (a decode that verified
    a draft model's tokens) and `drafted`, how many of all its new tokens were drafts; with log-probabilities
    asked for, each new token's (`logprobs`), each fork's first token's (`fork_logprobs`) and the prompt
    positions' this step computed (`prompt_logprobs`, from the chunk's first position)."""

    decoded: list[int]
    flagged: list[int] = ()
    special: list[int] = ()
    forked: list[list[int] | None] | None = None
    more: list[list[int]] | None = None
    drafted: list[int] | None = None
    logprobs: list[list[Logprob] | None] | None = None
    fork_logprobs: list[list[Logprob | None]] | None = None
    prompt_logprobs: list[list[Logprob] | None] | None = None
