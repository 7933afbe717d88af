"""metrics/report.md: what a reader opens first after `dvc repro` or `dvc exp run`.

One table of every model on every metric of eval.json (and which way it improves), each post-trained model's
value with its change against the model it started from (its metadata's `init`, when that model was evaluated
too); for each generative task, whether that change in greedy pass@1 is more than noise; then a few of the
task's prompts with every model's answer. Everything in it is computed from the run's deterministic results (no timings, a seeded bootstrap), so
two runs of the same pipeline write the same bytes.

The noise check is a paired bootstrap over prompts: both models answered the same prompts, so the per-prompt
differences are resampled (with replacement, `RESAMPLES` times, a fixed seed) and the 2.5th and 97.5th
percentiles of their mean are the 95% interval. An interval that excludes 0 says the change is not what a
different draw of prompts of this size would wash out.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

import numpy as np

from kiln.pipeline.evaluate.generative import GenResult, GenTask

RESAMPLES = 10_000
SHOWN = 3  # prompts of each generative task shown with every model's answer


@dataclass(frozen=True)
class Interval:
    mean: float  # mean per-prompt difference, model minus start
    low: float
    high: float

    @property
    def excludes_zero(self) -> bool:
        return self.low > 0 or self.high < 0


def paired_bootstrap(model: np.ndarray, start: np.ndarray, seed: int, resamples: int = RESAMPLES) -> Interval:
    """The mean of model - start over the same prompts, and its 95% percentile bootstrap interval."""
    diff = np.asarray(model, dtype=np.float64) - np.asarray(start, dtype=np.float64)
    picks = np.random.default_rng(seed).integers(0, len(diff), size=(resamples, len(diff)))
    means = diff[picks].mean(axis=1)
    low, high = np.quantile(means, [0.025, 0.975])
    return Interval(float(diff.mean()), float(low), float(high))


def report_markdown(metrics: dict, models: list[str], starts: dict[str, str | None],
                    tasks: list[tuple[GenTask, dict[str, GenResult]]], seed: int, samples: str = "samples",
                    chance: dict[str, float] | None = None, provenance: str = "") -> str:
    """`metrics` is eval.json's content ({metric: {model: value}}, and `items`); `starts` names each model's
    starting model among `models` (None for none); `tasks` pairs each generative task with each model's result;
    `samples` is the folder of the `<model>.md` generations, relative to the report; `chance` what guessing
    scores on a metric (absent: no such level); `provenance` a line saying which params and models made it."""
    chains = ", ".join(f"{m} from {s}" for m, s in starts.items() if s)
    lines = ["# Evaluation report", "",
             "Every model of `eval.models` measured the same way by `kiln evaluate` (the numbers of "
             "`metrics/eval.json`). " + (f"A model's change, in brackets, is against the model it started from "
                                          f"({chains})." if chains else
                                          "No model started from another evaluated model: no changes to show."), ""]
    if provenance:
        lines += [provenance, ""]
    lines += _metric_table(metrics, models, starts, chance or {})
    for task, results in tasks:
        lines += _noise_check(task, results, models, starts, seed)
    for task, results in tasks:
        lines += _samples(task, results, models)
    lines += ["## Generations", "", "Each model's generations of the `eval.samples` prompts: "
              + ", ".join(f"[{samples}/{m}.md]({samples}/{m}.md)" for m in models) + ".", ""]
    return "\n".join(lines)


def _metric_table(metrics: dict, models: list[str], starts: dict[str, str | None],
                  chance: dict[str, float]) -> list[str]:
    heads = [m if starts.get(m) is None else f"{m} (vs {starts[m]})" for m in models]
    lines = ["## Every metric", "", "`chance` is what guessing scores: a uniform guess over the vocabulary for the "
             "losses, over an item's choices for an accuracy, a coin for a pair; `-` where no guess has a level "
             "(a reward of your own).", "", "| metric | better | chance | " + " | ".join(heads) + " |",
             "| --- | --- | ---: |" + " ---: |" * len(models)]
    for key, row in metrics.items():
        if key == "items":
            continue
        cells = []
        for m in models:
            if m not in row:
                cells.append("-")
                continue
            start = starts.get(m)
            delta = f" ({row[m] - row[start]:+.4f})" if start is not None and start in row else ""
            cells.append(f"{row[m]:.4f}{delta}")
        level = f"{chance[key]:.4f}" if key in chance else "-"
        lines.append(f"| {key} | {better(key)} | {level} | " + " | ".join(cells) + " |")
    items = metrics.get("items") or {}
    if items:
        lines += ["", "Items scored (the same for every model): "
                  + ", ".join(f"{k} {v:,}" for k, v in items.items()) + "."]
    return [*lines, ""]


def better(metric: str) -> str:
    """Which way a metric improves: losses, bits per byte and perplexity down, accuracies and rewards up."""
    return "lower" if metric.rsplit("/", 1)[-1] in ("val_loss", "val_bpb", "val_ppl") else "higher"


def _noise_check(task: GenTask, results: dict[str, GenResult], models: list[str], starts: dict[str, str | None],
                 seed: int) -> list[str]:
    lines = [f"## {task.name}: greedy pass@1, each model against its start", ""]
    pairs = [(m, starts[m]) for m in models if starts.get(m) is not None]
    if not pairs:
        return [*lines, "No model started from another evaluated model: nothing to compare.", ""]
    lines += [f"Paired bootstrap over the same {len(task.texts):,} prompts ({RESAMPLES:,} resamples, seed {seed}): "
              "the mean per-prompt change in greedy pass@1 and its 95% interval.", "",
              "| model | start | pass@1 | start's pass@1 | change | 95% interval | excludes 0 |",
              "| --- | --- | ---: | ---: | ---: | --- | --- |"]
    for m, start in pairs:
        a, b = results[m].correct(), results[start].correct()
        ci = paired_bootstrap(a, b, seed)
        lines.append(f"| {m} | {start} | {a.mean():.4f} | {b.mean():.4f} | {ci.mean:+.4f} | "
                     f"[{ci.low:+.4f}, {ci.high:+.4f}] | {'yes' if ci.excludes_zero else 'no: within noise'} |")
    return [*lines, ""]


def _samples(task: GenTask, results: dict[str, GenResult], models: list[str]) -> list[str]:
    lines = [f"## {task.name}: the first {min(SHOWN, len(task.texts))} prompts, each model's greedy answer", ""]
    for i in range(min(SHOWN, len(task.texts))):
        lines += [f"### {task.name} {i + 1}", "", *_fenced(task.texts[i]), "",
                  f"Answer: {_code(task.answers[i])}", "", "| model | greedy answer | reward |", "| --- | --- | ---: |"]
        lines += [f"| {m} | {_code(results[m].completions[i])} | {results[m].rewards[i]:g} |" for m in models]
        lines.append("")
    return lines


def _fenced(text: str) -> list[str]:
    """`text` in a code block whose fence no run of backticks inside it can close."""
    fence = "`" * max(3, 1 + max((len(r) for r in re.findall(r"`+", text)), default=0))
    return [f"{fence}text", text, fence]


def _code(text: str) -> str:
    """`text` as one table cell: quoted with its newlines escaped, and its pipes escaped for the table."""
    quoted = json.dumps(text, ensure_ascii=False).replace("|", "\\|")
    fence = "`" * (1 + max((len(r) for r in re.findall(r"`+", quoted)), default=0))
    return f"{fence} {quoted} {fence}"
