"""Stage `scaling_sweep`: an IsoFLOP grid of small runs -> `data/scaling/runs.csv` for `kiln scaling fit`.

For every budget C in `scaling.budgets` and depth L in `scaling.depths`, the depth dial's model
(`ScalingParams.shape`) is trained from scratch for D = C / (6 N) tokens, where N counts *all* parameters, as
Chinchilla does. With tied embeddings that is also the honest compute: the LM head is a matmul the size of the
embedding table, and at this scale the largest one. D is rounded to whole steps of `scaling.batch_tokens`; the
CSV records the D and C = 6 N D actually trained, next to the nominal `budget` the fit groups runs by.

Every run goes through `train_lm`, like pretraining: same loop, shards, data order and evaluation. Its
learning-rate schedule is fitted to its length: warmup over `scaling.warmup_fraction` of its steps, then cosine
to `scaling.min_lr` exactly at its last step (a schedule cut short would handicap the short runs).

One stage iterates over the grid instead of a DVC `foreach`/`matrix`: those make one stage per run, whose
outputs a fit stage would have to list one by one in dvc.yaml, so a budget added in params.yaml would not
reach the fit. Instead runs.csv persists across runs of the stage and a run is skipped when a row with its
name and fingerprint (shape, tokens, optimiser, tokenizer, shards, the stage's code, eval budget) is there:
adding a budget trains only the new runs, and changing the learning rate, the data or the code retrains all.
The CSV is rewritten after every run, so an interrupted sweep keeps what finished, and the run in progress
resumes from its checkpoint.
"""

from __future__ import annotations

import contextlib
import csv
import dataclasses
import hashlib
import io
import json
import math
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from kiln.model.config import ModelConfig
from kiln.pipeline import layout
from kiln.pipeline.errors import UserError
from kiln.pipeline.outputs import atomic_write_bytes, write_json, write_metrics
from kiln.pipeline.progress import clock, console
from kiln.pipeline.scaling.params import ScalingParams
from kiln.pipeline.train.checkpoints import run_name
from kiln.pipeline.train.lm import LMData, lm_fingerprint, train_lm
from kiln.pipeline.train.params import ModelParams, TrainParams, run_identity
from kiln.pipeline.train.size_choice import count_params

# What a run gave, not how long it took: runs.csv is a DVC output, the same bytes on every rerun. Each run's
# seconds are kept in SECONDS beside it, a scratch file (a runs.csv from before had them as a column).
COLUMNS = ("run", "params", "non_embedding_params", "tokens", "flops", "loss", "bpb", "budget", "depth", "d_model",
           "n_head", "steps", "train_loss", "fingerprint")
SECONDS = "seconds.json"
STAGE = "scaling_sweep"  # dvc.yaml's name, whose code every run's fingerprint holds


@dataclass
class SweepRun:
    name: str
    budget: float
    depth: int
    config: ModelConfig
    params: int
    non_embedding_params: int
    train: TrainParams
    fingerprint: str

    @property
    def tokens(self) -> int:
        return self.train.max_steps * self.train.batch_tokens

    @property
    def flops(self) -> float:
        return 6.0 * self.params * self.tokens


def plan(scaling: ScalingParams, model: ModelParams, data: LMData) -> list[SweepRun]:
    if scaling.batch_tokens % model.max_seq_len:
        raise UserError(f"params: scaling.batch_tokens={scaling.batch_tokens}: expected a multiple of "
                        f"model.max_seq_len={model.max_seq_len}")
    train = scaling.train_params()
    # Micro-batches no larger than a step, so that a small sweep batch needs no small scaling.batch_size.
    batch_size = min(train.batch_size, scaling.batch_tokens // model.max_seq_len)
    vocab_size, runs = data.train.vocab_size, []
    for budget in sorted(set(scaling.budgets)):
        for depth in sorted(set(scaling.depths)):
            try:
                config = model.config(vocab_size, **scaling.shape(depth)).check().check_fits("cpu", "to train")
            except ValueError as e:
                raise UserError(f"params: scaling.depths: depth {depth} gives a bad model ({e})") from None
            n, n_non_embedding = count_params(config)
            steps = max(1, round(budget / (6 * n * scaling.batch_tokens)))
            run_train = dataclasses.replace(
                train, batch_size=batch_size, batch_tokens=scaling.batch_tokens, max_steps=steps, tokens=None,
                warmup_steps=round(scaling.warmup_fraction * steps), eval_every=steps,
                eval_tokens=scaling.eval_tokens, log_every=min(train.log_every, steps), keep_checkpoints=1)
            identity = {**lm_fingerprint(config, run_train, data, STAGE),
                        # the checkpoints' identity, plus the eval budget (here the final eval is the result) and
                        # the micro-batch, which picks the windows a one-process run draws
                        "train": run_identity(run_train, ("eval_every", "eval_tokens", "batch_size"))}
            fingerprint = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]
            runs.append(SweepRun(f"C{budget:.3g}_L{depth}", budget, depth, config, n, n_non_embedding, run_train,
                                 fingerprint))
    return runs


def read_rows(path: Path) -> dict[str, dict]:
    """Finished runs by name from an earlier sweep; a file that is not a sweep CSV is an error, not ignored."""
    if not path.is_file():
        return {}
    reader = csv.DictReader(io.StringIO(path.read_text(encoding="utf-8")))
    missing = [c for c in COLUMNS if c not in (reader.fieldnames or [])]
    if missing:
        raise UserError(f"{path}: not a sweep's runs.csv (lacks {', '.join(missing)}); move it away to start over")
    return {row["run"]: row for row in reader}


def read_seconds(path: Path, rows: dict[str, dict]) -> dict[str, float]:
    """Each finished run's training seconds: SECONDS, or the column a runs.csv from before it had (unreadable:
    none, since it is only a timing)."""
    try:
        seconds = {str(k): float(v) for k, v in json.loads(path.read_text(encoding="utf-8")).items()
                   if math.isfinite(float(v))}
    except (OSError, ValueError, AttributeError):
        seconds = {}
    for name, row in rows.items():
        with contextlib.suppress(KeyError, TypeError, ValueError):
            if math.isfinite(float(row["seconds"])):
                seconds.setdefault(name, float(row["seconds"]))
    return seconds


def write_rows(path: Path, rows: list[dict]) -> None:
    buf = io.StringIO()
    writer = csv.DictWriter(buf, COLUMNS, lineterminator="\n", extrasaction="ignore")
    writer.writeheader()
    writer.writerows(rows)
    atomic_write_bytes(path, buf.getvalue().encode())


def sweep(scaling: ScalingParams, model: ModelParams, shards_dir: Path, tokenizer_path: Path,
          out_dir: Path = layout.SCALING, checkpoint_dir: Path | None = None) -> dict:
    checkpoint_dir = layout.checkpoints("scaling") if checkpoint_dir is None else checkpoint_dir
    data = LMData.load(shards_dir, tokenizer_path)
    runs = plan(scaling, model, data)
    csv_path = out_dir / "runs.csv"
    rows = read_rows(csv_path)
    seconds = read_seconds(out_dir / SECONDS, rows)
    todo = [r for r in runs if rows.get(r.name, {}).get("fingerprint") != r.fingerprint]
    todo_flops = sum(r.flops for r in todo)
    console.print(f"scaling sweep: {len(runs)} runs ({len(set(scaling.budgets))} budgets x "
                  f"{len(set(scaling.depths))} depths), {len(runs) - len(todo)} already in {csv_path}, "
                  f"{len(todo)} to train ({todo_flops:.3g} FLOPs)", highlight=False)
    start, flops_done = time.perf_counter(), 0.0
    for i, run in enumerate(todo, start=1):
        _, result = train_lm(run.config, run.train, data, checkpoint_dir / run.name, out_dir / "curves" / run.name,
                             f"sweep {i}/{len(todo)} {run.name}", stage=STAGE)
        rows[run.name] = {
            "run": run.name, "params": run.params, "non_embedding_params": run.non_embedding_params,
            "tokens": run.tokens, "flops": f"{run.flops:.6g}", "loss": result["val_loss"], "bpb": result["val_bpb"],
            "budget": f"{run.budget:g}", "depth": run.depth,
            "d_model": run.config.d_model, "n_head": run.config.n_head, "steps": result["steps"],
            "train_loss": result["train_loss"], "fingerprint": run.fingerprint}
        write_rows(csv_path, [rows[r.name] for r in runs if r.name in rows
                              and rows[r.name]["fingerprint"] == r.fingerprint])
        seconds[run.name] = result["seconds"]
        write_json(out_dir / SECONDS, seconds)
        # A finished run needs no resume state; other params' runs of this name keep theirs. Its lock file stays:
        # removed, a run that opened it before could lock it while a third locks a new file of the same name.
        own = checkpoint_dir / run.name
        shutil.rmtree(own / run_name(lm_fingerprint(run.config, run.train, data, STAGE)), ignore_errors=True)
        with contextlib.suppress(OSError):
            own.rmdir()  # only when nothing else is left in it
        flops_done += run.flops
        elapsed = time.perf_counter() - start
        console.print(f"sweep: {run.name} N={run.params:,} D={run.tokens:,} val loss {result['val_loss']:.4f}; "
                      f"{i}/{len(todo)} trained, eta {clock(elapsed * (todo_flops / flops_done - 1))} (by FLOPs)",
                      highlight=False)
    # Runs of budgets or depths no longer in the grid are dropped here, not fitted.
    write_rows(csv_path, [rows[r.name] for r in runs])
    write_json(out_dir / SECONDS, seconds)  # also what an older runs.csv held
    metrics = {"runs": len(runs), "trained": len(todo), "reused": len(runs) - len(todo),
               "trained_flops": float(f"{todo_flops:.4g}"), "seconds": round(time.perf_counter() - start, 1),
               # the whole grid's training time, as seconds.json records it: the same after a rerun that reuses runs
               "train_seconds": round(sum(seconds.get(r.name, 0.0) for r in runs), 1),
               "best_loss": min(float(rows[r.name]["loss"]) for r in runs)}
    write_metrics("scaling_sweep", metrics)
    return metrics
