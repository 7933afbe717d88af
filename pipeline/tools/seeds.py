"""`kiln seeds`: one training stage run with several seeds, each a hand run of its own, and every metric's mean
and spread across them.

A difference between two settings means something only when it exceeds what the seed alone moves, so this is
the measurement behind every "better" a knob's table claims. Each seed runs as `kiln <stage> --set
<section>.seed=N --out <root>/seed-N` in a process of its own (a stage is written to own its process: torch's
threads and RNG, the progress display), so a seed that finished is not run again when the same command is given
the same --out, and an interrupted one resumes from its checkpoints. The summary (`<root>/seeds.json`) holds each
seed's metrics and, per metric, the mean, the sample standard deviation, the spread (max - min) and a 95%
Student-t interval of the mean, which with 3 seeds is wide (t = 4.30): three seeds bound the spread, they do
not pin the mean.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

from kiln.model.atomic import foreign
from kiln.pipeline.config import check_seed
from kiln.pipeline.errors import UserError
from kiln.pipeline.outputs import sha256_file, write_json
from kiln.pipeline.progress import console, print_columns
from kiln.pipeline.protected import check_output

COMMAND_FILE = "command.json"  # in a seeds folder: what its runs are runs of
HOLDS = ("seed-*", "seeds.json*", f"{COMMAND_FILE}*")
SEED_KEYS = {"pretrain": "train.seed", "sft": "sft.seed", "dpo": "dpo.seed", "grpo": "grpo.seed"}
# Two-sided 95% Student-t quantiles by degrees of freedom (scipy.stats.t.ppf(0.975, df)); beyond 30, the normal's.
T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228,
       12: 2.179, 15: 2.131, 20: 2.086, 30: 2.042}


def run_seeds(stage: str, seeds: list[int], params: Path, sets: list[str], root: Path) -> dict:
    """Run `stage` once per seed under `root`, then summarise; returns the summary written to seeds.json."""
    if stage not in SEED_KEYS:
        raise UserError(f"kiln seeds: stage {stage!r}: expected one of {', '.join(SEED_KEYS)}")
    key = SEED_KEYS[stage]
    if any(s.split("=", 1)[0].strip() in (key, key.split(".")[1]) for s in sets):
        raise UserError(f"kiln seeds: --set {key}: the seed is what --seeds varies; expected it left out")
    root = check_output(root, "--out", params=params)
    claim(root, {"stage": stage, "set": sets, "params_sha256": sha256_file(params) if params.is_file() else None})
    per_seed = {}
    for i, seed in enumerate(seeds, 1):
        out = root / f"seed-{seed}"
        metrics_file = out / "metrics" / f"{stage}.json"
        if not metrics_file.is_file():
            console.print(f"seeds: {stage} with {key}={seed} ({i}/{len(seeds)}) -> {out}", highlight=False,
                          soft_wrap=True)
            args = [stage, "--params", str(params), *[a for s in sets for a in ("--set", s)],
                    "--set", f"{key}={seed}", "--out", str(out)]
            code = subprocess.run([sys.executable, "-m", "kiln.pipeline.cli", *args]).returncode
            if code:
                raise UserError(f"kiln seeds: kiln {' '.join(args)} exited {code}; the seeds before it are in {root}")
        per_seed[seed] = json.loads(metrics_file.read_text())[stage]
    summary = {"stage": stage, "seed_key": key, "set": sets, "seeds": seeds,
               "metrics": summarise([flat(per_seed[s]) for s in seeds]),
               "per_seed": {str(s): per_seed[s] for s in seeds}}
    write_json(root / "seeds.json", summary)
    return summary


def claim(root: Path, command: dict) -> None:
    """Record in `root` what its seed runs are runs of (the stage, the --set values, the params file's digest),
    or refuse a `root` holding runs of another command: their metrics would be summarised as this one's."""
    record = root / COMMAND_FILE
    if root.is_dir():
        if names := foreign(root, HOLDS):
            raise UserError(f"--out {root}: holds {names}, which kiln seeds does not write; choose another --out")
        if any(root.glob("seed-*")) and not record.is_file():
            raise UserError(f"--out {root}: holds seed runs without {COMMAND_FILE}, so of unknown params; choose "
                            "another --out")
    if record.is_file():
        try:
            theirs = json.loads(record.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, ValueError) as e:
            raise UserError(f"{record}: unreadable ({type(e).__name__}); choose another --out") from None
        if theirs != command:
            diff = ", ".join(f"{k} {theirs.get(k)!r} there, {v!r} now" for k, v in command.items()
                             if theirs.get(k) != v) if isinstance(theirs, dict) else "not a command record"
            raise UserError(f"--out {root}: holds seed runs of another command ({diff}); their metrics are not "
                            "this one's: choose another --out")
        return
    write_json(record, command)


def parse_seeds(text: str) -> list[int]:
    try:
        seeds = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise UserError(f"kiln seeds: --seeds {text!r}: expected whole numbers separated by commas, "
                        "e.g. 1,2,3") from None
    for seed in seeds:
        check_seed(seed, f"kiln seeds: --seeds {text!r}: seed")
    if len(seeds) < 2 or len(set(seeds)) != len(seeds):
        raise UserError(f"kiln seeds: --seeds {text!r}: expected at least two different seeds")
    return seeds


def flat(values: dict, prefix: str = "") -> dict[str, float]:
    """The numeric leaves of a metrics dict under dotted keys (booleans and strings left out)."""
    out = {}
    for k, v in values.items():
        if isinstance(v, dict):
            out |= flat(v, f"{prefix}{k}.")
        elif isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
            out[f"{prefix}{k}"] = float(v)
    return out


def summarise(runs: list[dict[str, float]]) -> dict[str, dict[str, float]]:
    """Per metric every run has: mean, sample std, min, max, spread and the 95% t-interval of the mean."""
    out = {}
    for key in [k for k in runs[0] if all(k in r for r in runs)]:
        xs = [r[key] for r in runs]
        n, mean = len(xs), sum(xs) / len(xs)
        std = math.sqrt(sum((x - mean) ** 2 for x in xs) / (n - 1))
        half = t95(n - 1) * std / math.sqrt(n)
        out[key] = {"mean": mean, "std": std, "min": min(xs), "max": max(xs), "spread": max(xs) - min(xs),
                    "ci95_low": mean - half, "ci95_high": mean + half}
    return out


def t95(df: int) -> float:
    """The 97.5th percentile of Student's t with `df` degrees of freedom (the table's nearest df at or below)."""
    return T95[max(k for k in T95 if k <= df)] if df <= 30 else 1.96


def print_summary(summary: dict) -> None:
    seeds, metrics = summary["seeds"], summary["metrics"]
    runs = [flat(summary["per_seed"][str(s)]) for s in seeds]
    rows = [["metric", *(f"seed {s}" for s in seeds), "mean", "std", "spread", "95% interval of the mean"]]
    for key, m in metrics.items():
        rows.append([key, *(f"{r[key]:.5g}" for r in runs), f"{m['mean']:.5g}", f"{m['std']:.3g}",
                     f"{m['spread']:.3g}", f"[{m['ci95_low']:.5g}, {m['ci95_high']:.5g}]"])
    print_columns(f"seeds: {summary['stage']} over {summary['seed_key']} = {', '.join(map(str, seeds))}", rows)
