"""Every path under data/ and metrics/ that kiln reads or writes, named once (dvc.yaml repeats them, since DVC
reads only its own file). Paths are relative to the project root, where `dvc repro` runs each command.

A stage run by hand with other params than params.yaml's (or another --out) is not the DAG's stage: its metrics,
curves, timings and checkpoints go under its own run folder (`hand_run`), so `metrics_dir`, `curves` and
`checkpoints` are looked up when a stage writes, never bound at import."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from pathlib import Path

PARAMS = Path("params.yaml")

DATA = Path("data")
CORPUS = DATA / "corpus"  # train.parquet, val.parquet
TOKENIZER_DIR = DATA / "tokenizer"
TOKENIZER_FILE = "tokenizer.json"  # also the name a model folder keeps its tokenizer under
TOKENIZER = TOKENIZER_DIR / TOKENIZER_FILE
SHARDS = DATA / "shards"
SCALING = DATA / "scaling"  # runs.csv, each sweep run's curves, fit.json, size.json
FIT = SCALING / "fit.json"
SIZE = SCALING / "size.json"
MODELS = DATA / "models"
BASE_MODEL, SFT_MODEL, DPO_MODEL, GRPO_MODEL = MODELS / "base", MODELS / "sft", MODELS / "dpo", MODELS / "grpo"
CHECKPOINTS = DATA / "checkpoints"  # resume state, one folder per training stage

METRICS = Path("metrics")  # <stage>.json for `dvc metrics`, timings/<stage>.json, <stage>/ curves
TIMINGS = "timings"  # under a metrics folder: what varies run to run (git-ignored, not a DVC output)
BENCH = METRICS / "bench"
# Files of your own that params name (reward functions, task and dataset files): tasks/<stage>/ is that stage's
# DVC dep, tasks/ evaluate's (pipeline/stage_inputs.py)
TASKS = Path("tasks")
RUNS = Path("runs")  # hand runs' folders by default (git-ignored)

_hand_run: ContextVar[Path | None] = ContextVar("kiln_hand_run", default=None)


@contextmanager
def hand_run(root: Path) -> Iterator[Path]:
    """While inside, a stage's metrics, curves, timings and checkpoints go under `root`, not the DAG's paths."""
    token = _hand_run.set(Path(root))
    try:
        yield Path(root)
    finally:
        _hand_run.reset(token)


def hand_run_root() -> Path | None:
    return _hand_run.get()


def metrics_dir() -> Path:
    """`metrics/`, or a hand run's `<run>/metrics/`."""
    root = _hand_run.get()
    return METRICS if root is None else root / "metrics"


def checkpoints(stage: str) -> Path:
    """A stage's resume state: `data/checkpoints/<stage>`, or a hand run's `<run>/checkpoints/<stage>`."""
    root = _hand_run.get()
    return (CHECKPOINTS if root is None else root / "checkpoints") / stage


def curves(stage: str) -> Path:
    """A training stage's DVCLive folder (TSVs for `dvc plots`) and its curves.png."""
    return metrics_dir() / stage


def timings(curves_dir: Path) -> Path:
    """Where the series that vary run to run (tokens/s) of the curves in `curves_dir` go: metrics/timings/<stage>,
    beside the stage's timings file, out of what DVC hashes."""
    return Path(curves_dir).parent / TIMINGS / Path(curves_dir).name
