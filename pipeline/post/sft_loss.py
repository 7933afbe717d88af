"""SFT's loss as a plain function of a model and a micro-batch, kept apart from the stage (as DPO's is in
dpo_loss.py and GRPO's in grpo_loss.py), so `kiln bench post` times what the stage trains with."""

from __future__ import annotations

from kiln.model.packed import Packed


def masked_loss(model, batch):
    """Cross-entropy of the targets, each row's weighted, summed, over (weighted targets in the step /
    accumulation steps): the step's weighted mean per target token. Packed rows carry each token's example."""
    x, y, weights, *segments, per_micro = batch
    losses = model(x, y, reduction="none", packed=Packed(segments[0]) if segments else None)
    return (losses.sum(dim=1) * weights).sum() / per_micro
