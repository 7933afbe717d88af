"""Every path under data/ and metrics/ that kiln reads or writes, named once (dvc.yaml repeats them, since DVC
reads only its own file). Paths are relative to the project root, where `dvc repro` runs each command."""

from __future__ import annotations

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
SAMPLES = METRICS / "samples"
BENCH = METRICS / "bench"


def checkpoints(stage: str) -> Path:
    return CHECKPOINTS / stage


def curves(stage: str) -> Path:
    """A training stage's DVCLive folder (TSVs for `dvc plots`) and its curves.png."""
    return METRICS / stage
