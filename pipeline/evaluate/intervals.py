"""95% intervals for every metric that is a mean over items (an accuracy, a pass@k, a mean reward).

A percentile bootstrap over items: the per-item outcomes are resampled with replacement `RESAMPLES` times with a
fixed seed, and the 2.5th and 97.5th percentiles of the resampled means bound the interval, so two runs on the
same results give the same bytes. A change between two models that answered the same items is bootstrapped
paired: the per-item differences are resampled, which cancels what the items share (an easy item is easy for
both) and gives a much narrower interval than two independent ones would. An interval that excludes 0 says the
change is not what a different draw of items of this size would wash out. A model right on every item (or on
none) has the zero-width interval the bootstrap gives it; the items' count says how far to trust that.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

RESAMPLES = 10_000


@dataclass(frozen=True)
class Interval:
    mean: float  # the mean over items (of the differences, for a paired interval)
    low: float
    high: float

    @property
    def excludes_zero(self) -> bool:
        return self.low > 0 or self.high < 0


def bootstrap(values: np.ndarray, seed: int, resamples: int = RESAMPLES) -> Interval:
    """The mean of per-item `values` and its 95% percentile bootstrap interval."""
    values = np.asarray(values, dtype=np.float64)
    if values.ndim != 1 or not len(values):
        raise ValueError(f"a bootstrap needs a non-empty list of per-item values, got shape {values.shape}")
    picks = np.random.default_rng(seed).integers(0, len(values), size=(resamples, len(values)))
    means = values[picks].mean(axis=1)
    low, high = np.quantile(means, [0.025, 0.975])
    return Interval(float(values.mean()), float(low), float(high))


def paired_bootstrap(model: np.ndarray, start: np.ndarray, seed: int, resamples: int = RESAMPLES) -> Interval:
    """The mean of model - start over the same items, and its 95% percentile bootstrap interval."""
    model, start = np.asarray(model, dtype=np.float64), np.asarray(start, dtype=np.float64)
    if model.shape != start.shape:
        raise ValueError(f"a paired bootstrap needs the same items, got {model.shape} and {start.shape}")
    return bootstrap(model - start, seed, resamples)


class Intervals:
    """Every model's interval on every metric it has per-item values for, and every change against the model it
    started from on the metrics both have over the same items; computed once, when asked."""

    def __init__(self, per_item: dict[str, dict[str, np.ndarray]], starts: dict[str, str | None], seed: int,
                 resamples: int = RESAMPLES):
        self.per_item, self.starts, self.seed, self.resamples = per_item, starts, seed, resamples
        self._memo: dict[tuple[str, str, bool], Interval | None] = {}

    def of(self, model: str, metric: str) -> Interval | None:
        key = (model, metric, False)
        if key not in self._memo:
            values = self.per_item.get(model, {}).get(metric)
            self._memo[key] = None if values is None or not len(values) else bootstrap(values, self.seed,
                                                                                         self.resamples)
        return self._memo[key]

    def change(self, model: str, metric: str) -> Interval | None:
        """`model` minus its start on `metric`, paired over items; None without a start or shared items."""
        key = (model, metric, True)
        if key not in self._memo:
            start = self.starts.get(model)
            a = self.per_item.get(model, {}).get(metric)
            b = self.per_item.get(start, {}).get(metric) if start is not None else None
            same = a is not None and b is not None and len(a) and len(a) == len(b)
            self._memo[key] = paired_bootstrap(a, b, self.seed, self.resamples) if same else None
        return self._memo[key]

    def shown(self, model: str, metric: str) -> str:
        """` [low, high]` to put after a value, or nothing for a metric that is not a mean over items."""
        ci = self.of(model, metric)
        return f" [{ci.low:.3f}, {ci.high:.3f}]" if ci else ""
