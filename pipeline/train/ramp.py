"""Batch-size ramp (`train.batch_ramp_tokens`): the global batch starts at one pass (a micro-batch on every
process) and grows linearly with the tokens trained on, in whole passes, to `train.batch_tokens`, reached once
`batch_ramp_tokens` tokens are behind. Early on the gradient noise scale is small (McCandlish et al. 2018, "An
Empirical Model of Large-Batch Training"), so small batches waste fewer tokens; GPT-3 ramped its batch over its
first 4-12B tokens.

The learning rate of a step scales with the square root of its batch's share of the full batch: the rule for
Adam-style optimisers (Malladi et al. 2022, "On the SDEs and Scaling Rules for Adaptive Gradient Algorithms";
Adam's update is normalised by the gradient's scale, so the linear rule of SGD overshoots). The schedule is a
function of the step alone, so a run resumed mid-ramp takes exactly the steps it would have taken.
"""

from __future__ import annotations

import math


class BatchRamp:
    """Tokens per step for each step of a run: `full` from the start when `ramp` is 0."""

    def __init__(self, full: int, per_pass: int, ramp: int):
        self.full, self.per_pass, self.ramp = full, per_pass, ramp
        self._seen = [0]  # tokens trained on before step i

    def tokens(self, step: int) -> int:
        """The global batch of `step` (0-based), in tokens: a whole number of passes."""
        seen = self.seen(step)
        if seen >= self.ramp:
            return self.full
        grown = self.per_pass + (self.full - self.per_pass) * seen // self.ramp
        return max(self.per_pass, grown // self.per_pass * self.per_pass)

    def seen(self, step: int) -> int:
        """Tokens trained on by the steps before `step`."""
        while len(self._seen) <= step:
            self._seen.append(self._seen[-1] + self.tokens(len(self._seen) - 1))
        return self._seen[step]

    def accumulation(self, step: int) -> int:
        """Micro-batches of gradient accumulation in `step`."""
        return self.tokens(step) // self.per_pass

    def lr_scale(self, step: int) -> float:
        return math.sqrt(self.tokens(step) / self.full)

    def steps_for(self, tokens: int) -> int:
        """The most steps whose tokens together stay within `tokens`, at least one (tokens // full without a
        ramp); stepped through the ramp only, the full batches after it counted at once."""
        step = 0
        while self.seen(step) < self.ramp and self.seen(step + 1) <= tokens:
            step += 1
        if self.seen(step) >= self.ramp:
            step += (tokens - self.seen(step)) // self.full
        return max(1, step)
