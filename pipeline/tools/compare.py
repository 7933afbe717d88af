"""`kiln compare`: how many tokens and seconds each group of seed runs takes to reach a target val loss.

The field measures a pretraining recipe by its time to a target loss (modded-nanogpt's speedruns, nanochat), not
by the speed of a step. Each group is a `kiln seeds` folder (one hand run per seed). A run reaches the target
where its val-loss curve first goes below it, linearly interpolated between the two evaluations around the
crossing. Tokens at that step come from the run's tokens per step (its `batch_tokens` curve under a batch ramp).
Seconds are training seconds, summed from the throughput each log line measured (`tokens_per_s` since the
previous line), so evaluations and checkpoints are not counted.

The target is by default the first group's highest final val loss: "how soon does each recipe get where the
baseline ends", at a loss every baseline seed reaches (at its mean final loss, the seeds above the mean would
never reach it, and the baseline would have no figure). Each group's ratio to the first is the ratio of their mean tokens (and seconds), with a 95 %
percentile bootstrap interval that resamples each group's seeds (2,000 draws, a fixed generator): with three
seeds a side it is wide, and it should be. A run that never reaches the target leaves its group without a
figure (said in the table), never a number made up from the curve's end.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kiln.pipeline import layout
from kiln.pipeline.errors import UserError
from kiln.pipeline.outputs import atomic_write_bytes, write_json
from kiln.pipeline.progress import console, print_columns
from kiln.pipeline.tools.seeds import COMMAND_FILE
from kiln.pipeline.train.curves import read_metric

DRAWS = 2000


@dataclass
class RunCurve:
    """One seed's run: its val loss by step, and tokens and training seconds at every step it logged."""

    name: str
    val: list[tuple[int, float]]
    tokens: list[tuple[float, float]]  # (step, tokens seen by then), from step 0
    seconds: list[tuple[float, float]]  # (step, training seconds by then), from step 0


def read_group(folder: Path) -> tuple[str, list[RunCurve]]:
    """(stage, its runs) of a `kiln seeds` folder; a one-line UserError naming what is missing."""
    folder = Path(folder)
    command = folder / COMMAND_FILE
    if not command.is_file():
        raise UserError(f"{folder}: no {COMMAND_FILE}; expected a `kiln seeds` folder")
    try:
        stage = json.loads(command.read_text())["stage"]
    except (ValueError, KeyError, TypeError):
        raise UserError(f"{command}: expected the JSON `kiln seeds` writes, with a stage") from None
    runs = [read_run(seed, stage) for seed in sorted(folder.glob("seed-*"))
            if (seed / "metrics" / f"{stage}.json").is_file()]
    if not runs:
        raise UserError(f"{folder}: no finished seed-*/metrics/{stage}.json; run `kiln seeds {stage} --out {folder}`")
    return stage, runs


def read_run(root: Path, stage: str) -> RunCurve:
    curves = root / "metrics" / stage / "plots" / "metrics"
    timings = layout.timings(root / "metrics" / stage) / "plots" / "metrics"
    paths = {name: folder / f"{name}.tsv" for name, folder in
             (("val_loss", curves), ("tokens_per_s", timings))}
    for path in paths.values():
        if not path.is_file():
            raise UserError(f"{path}: missing; expected the curves of a finished {stage} run")
    try:
        val, throughput = read_metric(paths["val_loss"]), read_metric(paths["tokens_per_s"])
        summary = json.loads((root / "metrics" / f"{stage}.json").read_text())[stage]
        steps, tokens = int(summary["steps"]), int(summary["tokens"])
    except (ValueError, KeyError, TypeError) as e:
        raise UserError(f"{root}: its curves or {stage}.json cannot be read ({e})") from None
    if not val or any(not math.isfinite(v) for _, v in val + throughput) or steps < 1:
        raise UserError(f"{paths['val_loss']}: expected finite values at one step or more")
    seen = [(0.0, 0.0), (float(steps), float(tokens))]  # a constant batch
    ramp = curves / "batch_tokens.tsv"
    if ramp.is_file():  # each log's batch, taken as the batch of every step since the previous log
        seen, made, last = [(0.0, 0.0)], 0.0, 0
        for step, batch in read_metric(ramp):
            made += batch * (step - last)
            seen.append((float(step), made))
            last = step
    clock, last, spent = [(0.0, 0.0)], 0, 0.0
    for step, tps in throughput:
        spent += (at(seen, step) - at(seen, last)) / tps if tps > 0 else math.inf
        clock.append((float(step), spent))
        last = step
    return RunCurve(root.name, val, seen, clock)


def at(points: list[tuple[float, float]], x: float) -> float:
    """`points` (ascending x) linearly interpolated at x; the last value beyond the end."""
    xs, ys = zip(*points)
    return float(np.interp(x, xs, ys))


def crossing(val: list[tuple[int, float]], target: float) -> float | None:
    """The (fractional) step where the val loss first reaches `target`, between the evaluations around it; None
    if it never does."""
    previous = None
    for step, loss in val:
        if loss <= target:
            if previous is None or previous[1] == loss:
                return float(step)
            (s0, l0) = previous
            return s0 + (l0 - target) / (l0 - loss) * (step - s0)
        previous = (step, loss)
    return None


def to_target(run: RunCurve, target: float) -> dict | None:
    step = crossing(run.val, target)
    if step is None:
        return None
    return {"step": step, "tokens": at(run.tokens, step), "seconds": at(run.seconds, step)}


def ratio_interval(base: list[float], other: list[float], rng: np.random.Generator) -> list[float]:
    """A 95 % percentile bootstrap interval of mean(other) / mean(base), each group's seeds resampled."""
    a, b = np.asarray(base), np.asarray(other)
    ratios = (rng.choice(b, (DRAWS, len(b))).mean(1) / rng.choice(a, (DRAWS, len(a))).mean(1))
    return [float(np.percentile(ratios, 2.5)), float(np.percentile(ratios, 97.5))]


def compare(folders: list[Path], target: float | None, out: Path) -> dict:
    """Read every group, measure each run's tokens and seconds to the target, write compare.json and
    compare.png into `out`, and return the result."""
    if len(folders) < 2:
        raise UserError("kiln compare: expected two or more `kiln seeds` folders, the baseline first")
    groups = [(Path(f), *read_group(f)) for f in folders]
    stages = {stage for _, stage, _ in groups}
    if len(stages) > 1:
        raise UserError(f"kiln compare: the folders hold runs of different stages ({', '.join(sorted(stages))})")
    if target is None:
        target = max(run.val[-1][1] for run in groups[0][2])
    elif not math.isfinite(target):
        raise UserError(f"--target {target}: expected a finite val loss")
    rng = np.random.default_rng(0)
    result = {"stage": stages.pop(), "target": target, "groups": []}
    base = None
    for folder, _, runs in groups:
        reached = {run.name: to_target(run, target) for run in runs}
        row = {"folder": str(folder), "runs": reached,
               "final_val_loss": [run.val[-1][1] for run in runs]}
        if all(reached.values()):
            for key in ("tokens", "seconds"):
                values = [r[key] for r in reached.values()]
                row[key] = float(np.mean(values))
                if base is not None and all(base["runs"].values()):
                    bases = [r[key] for r in base["runs"].values()]
                    row[f"{key}_ratio"] = row[key] / base[key]
                    row[f"{key}_ratio_ci95"] = ratio_interval(bases, values, rng)
        base = base or row
        result["groups"].append(row)
    write_json(out / "compare.json", result)
    atomic_write_bytes(out / "compare.png", plot(groups, target))
    return result


def plot(groups, target: float) -> bytes:
    """Each group's mean val curve against tokens, the band between its seeds' lowest and highest, the target."""
    import io

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for folder, _, runs in groups:
        steps = sorted({s for run in runs for s, _ in run.val if all(s <= r.val[-1][0] for r in runs)})
        losses = np.array([[at([(float(s), v) for s, v in run.val], s) for s in steps] for run in runs])
        tokens = [np.mean([at(run.tokens, s) for run in runs]) for s in steps]
        line, = ax.plot(tokens, losses.mean(0), label=f"{folder.name} ({len(runs)} seeds)")
        ax.fill_between(tokens, losses.min(0), losses.max(0), color=line.get_color(), alpha=0.2)
    ax.axhline(target, color="grey", linestyle="--", linewidth=1, label=f"target {target:.4g}")
    ax.set_xlabel("tokens")
    ax.set_ylabel("val loss")
    ax.legend()
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=100)
    plt.close(fig)
    return buffer.getvalue()


def print_compare(result: dict, out: Path) -> None:
    rows = [["group", "seeds", "final val loss", "tokens to target", "x first [95% CI]", "seconds",
             "x first [95% CI]"]]
    for row in result["groups"]:
        finals = row["final_val_loss"]
        cells = [Path(row["folder"]).name, str(len(finals)), f"{np.mean(finals):.4f}"]
        for key in ("tokens", "seconds"):
            if key not in row:
                missing = [name for name, r in row["runs"].items() if r is None]
                cells += [f"not reached by {', '.join(missing)}", ""]
                continue
            cells.append(f"{row[key]:,.0f}")
            low, high = row.get(f"{key}_ratio_ci95", (None, None))
            cells.append(f"{row[f'{key}_ratio']:.3f} [{low:.3f}, {high:.3f}]" if low is not None else
                         ("1 (baseline)" if row is result["groups"][0] else "-"))
        rows.append(cells)
    print_columns(f"compare: {result['stage']} runs to val loss {result['target']:.4f}", rows)
    console.print(f"wrote {out / 'compare.json'} and {out / 'compare.png'}", highlight=False)
