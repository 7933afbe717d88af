"""A model put in eval mode for a block of inference inside training (rollouts, scoring, a captured graph)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch


@contextmanager
def evaluating(model: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """`model` in eval mode (no dropout) inside the block, back in the mode it had after, however the block ends."""
    was_training = model.training
    model.eval()
    try:
        yield model
    finally:
        model.train(was_training)
