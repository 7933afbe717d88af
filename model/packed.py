"""Rows that hold several sequences: what each token may attend to, and the position it has.

A training batch packs sequences end to end in each row: pretraining's documents (`train.doc_mask`), SFT's whole
examples (`sft.packing`), and a prompt stored once with the answers that follow it (DPO's chosen and rejected,
GRPO's group of samples). `Packed` describes that layout for the model, which derives from it the attention
mask and the positions, so every sequence computes exactly what it would alone in a row of its own:

- `segments` (B, T): the piece each token belongs to. A token attends to the earlier tokens of its own piece.
- `shares` (B, T), optional: a second piece each token also sees whole, the prompt its answer continues (a token
  of no answer names its own piece). An answer's positions count on from the end of the prompt it shares.

A piece must sit after the piece it shares, and a prompt shared by answers is one piece of its own: with causal
attention that makes an answer's view "the prompt, then itself", as in the row the prompt and that answer alone
would make.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Packed:
    segments: torch.Tensor
    shares: torch.Tensor | None = None

    def check(self, B: int, T: int) -> None:
        for name, t in (("segments", self.segments), ("shares", self.shares)):
            if t is not None and t.shape != (B, T):
                raise ValueError(f"packed.{name}: expected shape ({B}, {T}), got {tuple(t.shape)}")

    def mask(self) -> torch.Tensor:
        """(B, 1, T, T) booleans, True where query i may attend to key j: j <= i, and j in i's piece or in the
        piece i shares."""
        seg = self.segments
        T = seg.size(1)
        causal = torch.ones(T, T, dtype=torch.bool, device=seg.device).tril()
        seen = seg[:, :, None] == seg[:, None, :]
        if self.shares is not None:
            seen = seen | (self.shares[:, :, None] == seg[:, None, :])
        return (seen & causal)[:, None]

    def positions(self) -> torch.Tensor:
        """(B, T): each token's offset in its piece, plus the length of the piece it shares when that is another."""
        seg = self.segments
        T = seg.size(1)
        index = torch.arange(T, device=seg.device).expand_as(seg)
        starts = torch.ones_like(seg, dtype=torch.bool)
        starts[:, 1:] = seg[:, 1:] != seg[:, :-1]
        offset = index - torch.where(starts, index, 0).cummax(dim=1).values
        if self.shares is None:
            return offset
        sizes = torch.zeros(seg.size(0), int(seg.max()) + 1, dtype=seg.dtype, device=seg.device)
        sizes.scatter_add_(1, seg, torch.ones_like(seg))
        return offset + sizes.gather(1, self.shares) * (self.shares != seg)
