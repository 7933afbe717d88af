"""Answers' log-probabilities, batched: what SFT's held-out loss, multiple-choice accuracy, DPO's loss and
evaluate's post-training metrics are made of, below both post/ and evaluate/.

A row's answer log-probability is the sum of log p over its targets (the answer's tokens, its `<|im_end|>`
included). Rows that share a prompt (a question's choices, a pair's answers) are scored in one row, the prompt
computed once (scoring/rows.py `shared_rows`); the sums equal the padded rows'.

A preference pair's two answers follow the same prompt: a pair is one row of its prompt, then the chosen answer,
then the rejected one, each answer attending to the prompt and itself.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from kiln.model.modes import evaluating
from kiln.model.packed import Packed
from kiln.pipeline.errors import UserError
from kiln.pipeline.progress import console
from kiln.pipeline.scoring.rows import IGNORE, fits, separate, shared_rows, to_rows
from kiln.pipeline.tasks.chat_data import Pair
from kiln.pipeline.tasks.chat_format import ChatFormat
from kiln.pipeline.tasks.corpus_task import TaskItem


def answer_logps(model, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Summed log-probability of each row's targets (N,), in float32, with gradients."""
    return -model(x, y, reduction="none").sum(dim=-1)


def answer_tokens(y: torch.Tensor) -> torch.Tensor:
    """How many targets each row has (N,): the length of its answer."""
    return (y != IGNORE).sum(dim=-1)


def shared_answer_logps(model, shared: list[torch.Tensor], y: torch.Tensor) -> torch.Tensor:
    """answer_logps of separate rows with targets y (N, W), with gradients, from one forward of their shared rows
    (scoring/rows.py `shared_rows`: x, y, segments, shares, where)."""
    x, shared_y, segments, shares, where = shared
    return -separate(model(x, shared_y, reduction="none", packed=Packed(segments, shares)), where, y).sum(dim=-1)


@torch.no_grad()
def score_rows(model, x: torch.Tensor, y: torch.Tensor, batch_size: int, pad: int, groups: int | list[int] = 1,
               greedy: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """answer_logps of every row, on CPU in float64, about batch_size rows a forward in eval mode, under the
    caller's autocast. `groups` are consecutive rows that share their common prompt, computed once (a question's
    choices, a pair's answers): one size for all, or each group's; a forward takes whole groups (at least one).
    Every row is cut to its last target: the forward runs on real tokens (`shared_rows`). With `greedy`, also
    whether each row's every target is the model's argmax (N,) bool."""
    device = next(model.parameters()).device
    sizes = [groups] * (len(x) // groups) + [len(x) % groups] * bool(len(x) % groups) \
        if isinstance(groups, int) else groups
    logps, hits = [], []
    with evaluating(model):
        for batch in group_batches(sizes, batch_size):
            lo, hi = batch[0][0], batch[-1][-1] + 1
            x_b, y_b, packed, where = shared_rows(x[lo:hi], y[lo:hi], [[i - lo for i in g] for g in batch], pad)
            shared = [t.to(device) for t in (x_b, y_b, packed.segments, packed.shares, where)]
            y_sep = y[lo:hi].to(device)
            if not greedy:
                logps.append(shared_answer_logps(model, shared, y_sep))
                continue
            x_b, y_b, segments, shares, where = shared
            # log p and argmax per token, never the logits
            token = model(x_b, y_b, stats=True, packed=Packed(segments, shares))
            logps.append(separate(token.logp, where, y_sep).sum(-1))
            hits.append((separate(token.hit, where, y_sep) | (y_sep == IGNORE)).all(-1).cpu())
    logp = torch.cat(logps).double().cpu() if logps else torch.zeros(0, dtype=torch.float64)
    return (logp, torch.cat(hits) if hits else torch.zeros(0, dtype=torch.bool)) if greedy else logp


def group_batches(sizes: list[int], batch_rows: int):
    """Consecutive groups of rows (their indices), whole groups a batch, up to batch_rows rows (at least one)."""
    batch, rows, start = [], 0, 0
    for size in sizes:
        if batch and rows + size > batch_rows:
            yield batch
            batch, rows = [], 0
        batch.append(list(range(start, start + size)))
        start, rows = start + size, rows + size
    if batch:
        yield batch


class ChoiceScorer:
    """Accuracy on multiple-choice items: the answer counts as picked when its summed log-probability (after
    the prompt, <|im_end|> included) beats every wrong choice's strictly, so a tie is never a hit."""

    def __init__(self, items: list[TaskItem], chat: ChatFormat, seq_len: int):
        self.kinds, self.pad = [item.kind for item in items], chat.pad
        self.n_choices = len(items[0].choices) if items else 0
        rendered = [chat.render(item.conversation(choice), first_trained=len(item.prompt))
                    for item in items for choice in item.choices]
        self.x, self.y = to_rows(rendered, seq_len, chat.pad, "held-out choices")

    def accuracy(self, model, batch_size: int) -> dict[str, float]:
        return {k: float(v.mean()) for k, v in self.hits(model, batch_size).items()}

    def hits(self, model, batch_size: int) -> dict[str, np.ndarray]:
        """Each item's outcome (1.0 picked, 0.0 not) behind `val_accuracy` and each kind's `val_accuracy_<kind>`."""
        if not self.kinds:
            return {}
        scores = score_rows(model, self.x, self.y, batch_size, self.pad, self.n_choices)
        scores = scores.view(-1, self.n_choices)
        hits = (scores[:, 0] > scores[:, 1:].max(dim=1).values).double().numpy()
        kinds = np.array(self.kinds)
        return {"val_accuracy": hits} | {f"val_accuracy_{kind}": hits[kinds == kind]
                                         for kind in sorted(set(self.kinds))}


@dataclasses.dataclass
class PostTrainData:
    """The held-out data of the post-training stages: built-in items (accuracy) and preference pairs."""

    scorer: ChoiceScorer
    pairs: PairRows


@dataclasses.dataclass
class PairRows:
    """Chosen and rejected rows of the same pairs, and the reference's log-probabilities of their answers."""

    chosen: tuple[torch.Tensor, torch.Tensor]
    rejected: tuple[torch.Tensor, torch.Tensor]
    pad: int  # the chat format's pad token, which the shared rows pad with
    ref_chosen: torch.Tensor | None = None
    ref_rejected: torch.Tensor | None = None

    def __len__(self) -> int:
        return len(self.chosen[0])

    def tokens(self) -> tuple[torch.Tensor, torch.Tensor]:
        """How many tokens each chosen and each rejected answer has."""
        return answer_tokens(self.chosen[1]), answer_tokens(self.rejected[1])

    def head(self, n: int) -> PairRows:
        return PairRows((self.chosen[0][:n], self.chosen[1][:n]), (self.rejected[0][:n], self.rejected[1][:n]),
                        self.pad, self.ref_chosen[:n], self.ref_rejected[:n])


def pair_rows(pairs: list[Pair], chat: ChatFormat, seq_len: int, what: str) -> PairRows:
    """Each pair rendered twice, prompt + chosen and prompt + rejected, with only the answer as targets. Pairs
    whose answers no longer differ (or vanish) once cut to max_seq_len are skipped and counted."""
    chosen, rejected = [], []
    for pair in pairs:
        c = chat.render(pair.prompt + pair.chosen, first_trained=len(pair.prompt))
        r = chat.render(pair.prompt + pair.rejected, first_trained=len(pair.prompt))
        if fits(c, seq_len) and fits(r, seq_len) and c.ids[:seq_len + 1] != r.ids[:seq_len + 1]:
            chosen.append(c)
            rejected.append(r)
    if len(chosen) < len(pairs):
        console.print(f"{what}: skipped {len(pairs) - len(chosen):,} pairs whose answers do not differ within "
                      f"max_seq_len={seq_len}", highlight=False)
    if pairs and not chosen:
        raise UserError(f"{what}: no pair has two different answers within max_seq_len={seq_len}")
    return PairRows(to_rows(chosen, seq_len, chat.pad, what), to_rows(rejected, seq_len, chat.pad, what), chat.pad)


def shared_pairs(xc: torch.Tensor, yc: torch.Tensor, xr: torch.Tensor, yr: torch.Tensor,
                 pad: int) -> list[torch.Tensor]:
    """Pairs' padded rows as a row per pair, its prompt once: x, y, segments, shares, and `where` (2N, W), the
    place of each padded row's column (chosen rows first) in them."""
    n = len(xc)
    x, y, packed, where = shared_rows(torch.cat([xc, xr]), torch.cat([yc, yr]), [[i, n + i] for i in range(n)], pad)
    return [x, y, packed.segments, packed.shares, where]


def pair_logps(model, shared: list[torch.Tensor], yc: torch.Tensor,
               yr: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed log-probabilities of the chosen and the rejected answers (N,) each, in float32, with gradients,
    from one forward of `shared_pairs`' rows; yc, yr the padded rows' targets."""
    return shared_answer_logps(model, shared, torch.cat([yc, yr])).split(len(yc))


def logps(model, rows: PairRows, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed log-probabilities of the chosen and rejected answers, no gradients, on CPU in float64, each pair's
    prompt computed once, under the caller's autocast."""
    x = torch.stack([rows.chosen[0], rows.rejected[0]], dim=1).flatten(0, 1)  # chosen, rejected, chosen, ...
    y = torch.stack([rows.chosen[1], rows.rejected[1]], dim=1).flatten(0, 1)
    scores = score_rows(model, x, y, batch_size, rows.pad, groups=2).view(-1, 2)
    return scores[:, 0].contiguous(), scores[:, 1].contiguous()
