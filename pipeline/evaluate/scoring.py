"""Multiple-choice scoring as lm-evaluation-harness does it: each choice is a (context, continuation) request,
scored by the summed log-probability of the continuation's tokens given the context.

A request is encoded the harness's way: trailing whitespace of the context moves to the continuation (so " Paris"
stays one token), the continuation's tokens are those of context + continuation after the context's tokens, and
the whole follows `<|endoftext|>`, as every document does in pretraining. A request longer than the context
window loses the start of its context; an item with a continuation that alone does not fit is left out and
counted (`too_long`), as the harness refuses such a request rather than score a cut answer. Items are batched
whole (all choices of an item in one forward), their shared context computed once (scoring/answers.py
`score_rows`): each choice sees what it would in a row of its own.

acc picks the choice with the highest summed log-probability; acc_norm divides it by the length of the choice in
characters first, the delimiter not counted (lm_eval/api/task.py, ConfigurableTask.process_results:
`completion_len = np.array([float(len(i)) for i in choices])`), which removes the bias towards short choices and is
the convention of published acc_norm numbers. Ties go to the first choice (numpy's argmax), as in the harness.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from kiln.pipeline.scoring.answers import score_rows
from kiln.pipeline.scoring.rows import IGNORE
from kiln.pipeline.tasks.tasks import MCItem


@dataclass(frozen=True)
class ScoringRequest:
    ids: tuple[int, ...]  # <|endoftext|> + context + continuation, cut to max_seq_len + 1 from the left
    n_target: int         # the continuation: the last n_target ids


def encode_request(tokenizer, eot: int, context: str, continuation: str, max_len: int) -> ScoringRequest | None:
    """`max_len` is the model's context window; the request keeps the last max_len + 1 ids (the last is never
    an input), so a long context loses its start. None when the continuation alone has more than max_len
    tokens: lm-evaluation-harness refuses it (HFLM._loglikelihood_tokens asserts
    `len(continuation_enc) <= self.max_length`)."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    context_ids = tokenizer.encode(context).ids
    target = tokenizer.encode(context + continuation).ids[len(context_ids):]
    if len(target) > max_len:
        return None
    return ScoringRequest(tuple([eot, *context_ids, *target][-(max_len + 1):]), len(target))


def score_requests(model, requests: list[ScoringRequest], groups: list[int],
                   batch_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed log-probability (N,) float64, greedy (N,) bool) of each request's continuation, under the caller's
    autocast; greedy = every continuation token is the model's argmax. `groups` are the sizes of consecutive runs
    of requests that share their context, computed once (an item's choices); a batch holds whole groups up to
    `batch_rows` rows (at least one group)."""
    width = max((len(r.ids) for r in requests), default=1) - 1
    x = torch.zeros(len(requests), width, dtype=torch.long)
    y = torch.full((len(requests), width), IGNORE, dtype=torch.long)
    for i, r in enumerate(requests):
        n = len(r.ids) - 1
        x[i, :n] = torch.tensor(r.ids[:-1])
        if r.n_target:
            y[i, n - r.n_target:n] = torch.tensor(r.ids[-r.n_target:])
    return score_rows(model, x, y, batch_rows, 0, groups, greedy=True)


class ChoiceTask:
    """Items encoded once (the same requests serve every model evaluated), scored per model. `items` are those
    that fit the context window; `too_long` counts the others."""

    def __init__(self, tokenizer, eot: int, items: list[MCItem], max_len: int, lambada: bool = False):
        self.lambada, self.max_len = lambada, max_len
        encoded = [[encode_request(tokenizer, eot, c, k, max_len) for c, k in zip(item.contexts, item.continuations)]
                   for item in items]
        fits = [None not in requests for requests in encoded]
        self.items = [item for item, ok in zip(items, fits) if ok]
        self.requests = [r for requests, ok in zip(encoded, fits) if ok for r in requests]
        self.too_long = len(items) - len(self.items)

    def score(self, model, batch_rows: int) -> tuple[dict[str, float], dict[str, np.ndarray]]:
        """Each metric's value, and each item's outcome for the metrics that are a mean over items (their
        intervals resample them): acc and acc_norm; for LAMBADA-style items (one continuation each), acc = the
        continuation is the greedy one, and ppl = exp(-mean summed log-probability), the harness's definitions."""
        if model.config.max_seq_len != self.max_len:
            raise ValueError(f"requests were cut for max_seq_len={self.max_len}, the model has "
                             f"{model.config.max_seq_len}")
        items = self.items
        logp, greedy = score_requests(model, self.requests, [item.n_choices for item in items], batch_rows)
        hits = {"acc": greedy.double().numpy()} if self.lambada else choice_hits(logp, items)
        values = {k: float(v.mean()) for k, v in hits.items()}
        if self.lambada:
            values["ppl"] = math.exp(-logp.mean().item())
        return values, hits


def choice_hits(logp: torch.Tensor, items: list[MCItem]) -> dict[str, np.ndarray]:
    """Each item's acc and acc_norm (1.0 right, 0.0 wrong) from the summed log-probability of every choice of
    every item, in order."""
    hits, norm_hits = np.zeros(len(items)), np.zeros(len(items))
    at = 0
    for i, item in enumerate(items):
        scores = logp[at:at + item.n_choices]
        at += item.n_choices
        chars = torch.tensor([len(c) for c in item.choices or item.continuations], dtype=torch.float64)
        hits[i] = int(scores.argmax()) == item.gold
        norm_hits[i] = int((scores / chars).argmax()) == item.gold
    return {"acc": hits, "acc_norm": norm_hits}
