"""Preference pairs as token rows and the policy's log-probabilities of each answer: what DPO trains on and
what evaluate measures preference accuracy with."""

from __future__ import annotations

import dataclasses

import torch

from kiln.pipeline.errors import UserError
from kiln.pipeline.post.common import answer_tokens, fits, score_rows, to_rows
from kiln.pipeline.progress import console
from kiln.pipeline.tasks.chat_data import Pair
from kiln.pipeline.tasks.chat_format import ChatFormat


@dataclasses.dataclass
class PairRows:
    """Chosen and rejected rows of the same pairs, and the reference's log-probabilities of their answers."""

    chosen: tuple[torch.Tensor, torch.Tensor]
    rejected: tuple[torch.Tensor, torch.Tensor]
    ref_chosen: torch.Tensor | None = None
    ref_rejected: torch.Tensor | None = None

    def __len__(self) -> int:
        return len(self.chosen[0])

    def tokens(self) -> tuple[torch.Tensor, torch.Tensor]:
        """How many tokens each chosen and each rejected answer has."""
        return answer_tokens(self.chosen[1]), answer_tokens(self.rejected[1])

    def head(self, n: int) -> PairRows:
        return PairRows((self.chosen[0][:n], self.chosen[1][:n]), (self.rejected[0][:n], self.rejected[1][:n]),
                        self.ref_chosen[:n], self.ref_rejected[:n])


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
    return PairRows(to_rows(chosen, seq_len, chat.pad, what), to_rows(rejected, seq_len, chat.pad, what))


def logps(model, rows: PairRows, batch_size: int, precision: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed log-probabilities of the chosen and rejected answers, no gradients."""
    chosen, rejected = (score_rows(model, x, y, batch_size, precision) for x, y in (rows.chosen, rows.rejected))
    return chosen, rejected
