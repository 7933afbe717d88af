"""metrics/report.md: what a reader opens first after `dvc repro` or `dvc exp run`.

One table of every model on every metric of eval.json (and which way it improves), each value of a metric that
is a mean over items (an accuracy, a pass@k, a mean reward) with its 95% bootstrap interval, each post-trained
model's change against the model it started from (its metadata's `init`, when that model was evaluated too);
then every such change with its paired 95% interval and whether it excludes 0 (evaluate/intervals.py); then a
few of each generative task's prompts with every model's answer. Everything in it is computed from the run's
deterministic results (no timings, a seeded bootstrap), so two runs of the same pipeline write the same bytes.
"""

from __future__ import annotations

import json
import re

from kiln.pipeline.evaluate.generative import GenResult, GenTask
from kiln.pipeline.evaluate.intervals import RESAMPLES, Intervals

SHOWN = 3  # prompts of each generative task shown with every model's answer


def report_markdown(metrics: dict, models: list[str], starts: dict[str, str | None],
                    tasks: list[tuple[GenTask, dict[str, GenResult]]], intervals: Intervals, samples: str = "samples",
                    chance: dict[str, float] | None = None, provenance: str = "") -> str:
    """`metrics` is eval.json's content ({metric: {model: value}}, and `items`); `starts` names each model's
    starting model among `models` (None for none); `tasks` pairs each generative task with each model's result;
    `intervals` those of the per-item metrics; `samples` is the folder of the `<model>.md` generations, relative
    to the report; `chance` what guessing scores on a metric (absent: no such level); `provenance` a line saying
    which params and models made it."""
    chains = ", ".join(f"{m} from {s}" for m, s in starts.items() if s)
    lines = ["# Evaluation report", "",
             "Every model of `eval.models` measured the same way by `kiln evaluate` (the numbers of "
             "`metrics/eval.json`). " + (f"A model's change, in brackets, is against the model it started from "
                                          f"({chains})." if chains else
                                          "No model started from another evaluated model: no changes to show."), ""]
    if provenance:
        lines += [provenance, ""]
    lines += _metric_table(metrics, models, starts, chance or {}, intervals)
    lines += _changes(metrics, models, starts, intervals)
    for task, results in tasks:
        lines += _samples(task, results, models)
    lines += ["## Generations", "", "Each model's generations of the `eval.samples` prompts: "
              + ", ".join(f"[{samples}/{m}.md]({samples}/{m}.md)" for m in models) + ".", ""]
    return "\n".join(lines)


def _metric_table(metrics: dict, models: list[str], starts: dict[str, str | None], chance: dict[str, float],
                  intervals: Intervals) -> list[str]:
    heads = [m if starts.get(m) is None else f"{m} (vs {starts[m]})" for m in models]
    lines = ["## Every metric", "", "`chance` is what guessing scores: a uniform guess over the vocabulary for the "
             "losses, over an item's choices for an accuracy, a coin for a pair; `-` where no guess has a level "
             "(a reward of your own). In square brackets, a metric that is a mean over items has its 95% interval "
             f"(percentile bootstrap over the items, {RESAMPLES:,} resamples, seed {intervals.seed}).", "",
             "| metric | better | chance | " + " | ".join(heads) + " |",
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
            cells.append(f"{row[m]:.4f}{intervals.shown(m, key)}{delta}")
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


def _changes(metrics: dict, models: list[str], starts: dict[str, str | None], intervals: Intervals) -> list[str]:
    lines = ["## Each model against its start", ""]
    rows = [(key, m) for key in metrics if key != "items" for m in models if intervals.change(m, key) is not None]
    if not rows:
        return [*lines, "No model has a start scored on the same items: nothing to compare.", ""]
    lines += ["Paired bootstrap over the items both models answered (the per-item changes resampled, "
              f"{RESAMPLES:,} times, seed {intervals.seed}): the mean change and its 95% interval. A change whose "
              "interval holds 0 is within what another draw of items of this size could give.", "",
              "| metric | model | start | value | start's value | change | 95% interval | excludes 0 |",
              "| --- | --- | --- | ---: | ---: | ---: | --- | --- |"]
    for key, m in rows:
        ci, start = intervals.change(m, key), starts[m]
        mine, theirs = intervals.of(m, key).mean, intervals.of(start, key).mean
        lines.append(f"| {key} | {m} | {start} | {mine:.4f} | {theirs:.4f} | {ci.mean:+.4f} | "
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
