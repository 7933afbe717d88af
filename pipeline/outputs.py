"""What stages write with: JSON and metrics files through the one atomic writer (kiln.model.atomic), content
hashes, and the lock that keeps two runs out of one checkpoint folder.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import math
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from kiln.model.atomic import atomic_dir, atomic_write_bytes, atomic_write_files, recover, replacing, writing
from kiln.pipeline import layout
from kiln.pipeline.errors import StageError, UserError

__all__ = ["atomic_dir", "atomic_write_bytes", "atomic_write_files", "recover", "replacing", "write_json", "json_bytes",
           "write_metrics", "metrics_files", "sha256_file", "exclusive", "lock_path"]
LOCK_SUFFIX = ".lock"


def write_json(path: Path, obj) -> None:
    """Strict JSON (RFC 8259 has no NaN or Infinity, and most readers refuse them): a non-finite number is a
    StageError naming the key, and nothing is written."""
    atomic_write_bytes(path, json_bytes(path, obj))


def json_bytes(path: Path, obj) -> bytes:
    """`obj` as the strict JSON `write_json` writes to `path` (named in the error)."""
    try:
        text = json.dumps(obj, indent=2, allow_nan=False)
    except ValueError:
        key = _non_finite_key(obj)
        if key is None:  # not a number's fault (a circular reference): a bug, with its traceback
            raise
        raise StageError(f"{path}: not written: {key} is not a finite number") from None
    return (text + "\n").encode()


def _non_finite_key(obj, where: str = "") -> str | None:
    """The dotted key of the first NaN or infinity in `obj` (lists by index), or None."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return where or "the value"
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, (list, tuple)) else ()
    for key, value in items:
        if (found := _non_finite_key(value, f"{where}.{key}" if where else str(key))) is not None:
            return found
    return None


# How a run went rather than what it produced: they differ between two runs that give bit-identical outputs, so
# they go to metrics/timings/<stage>.json, which neither DVC nor git tracks: `dvc metrics diff` of a rerun shows
# no change and a fresh `dvc repro` leaves `git status` clean.
TIMING_KEYS = frozenset({"seconds", "train_seconds", "tokens_per_s", "mb_per_s", "mfu", "peak_memory_gb", "trained",
                         "reused", "trained_flops", "rollout_tokens_per_s", "generate_share",
                         "pairs_per_s"})


def write_metrics(stage: str, values: dict, metrics_dir: Path | None = None) -> Path:
    """`metrics/<stage>.json` (the results dvc.yaml lists under `metrics:`) and, when the stage measured any,
    `metrics/timings/<stage>.json` (its timings, throughput and memory); a hand run's under its own folder.

    The results sit under the stage's name, so `dvc metrics show` and `dvc exp show` name a column
    `sft.val_accuracy`, not `metrics/sft.json:val_accuracy` (what DVC falls back to when two files share a key).
    """
    files = metrics_files(stage, values, metrics_dir)
    atomic_write_files(files)
    return next(iter(files))


def metrics_files(stage: str, values: dict, metrics_dir: Path | None = None) -> dict[Path, bytes]:
    """What `write_metrics` writes, path by path (the results first), for a stage that writes them together with
    other outputs (`atomic_write_files`)."""
    metrics_dir = layout.metrics_dir() if metrics_dir is None else Path(metrics_dir)
    path = metrics_dir / f"{stage}.json"
    files = {path: json_bytes(path, {stage: {k: v for k, v in values.items() if k not in TIMING_KEYS}})}
    if timings := {k: v for k, v in values.items() if k in TIMING_KEYS}:
        timings_path = metrics_dir / layout.TIMINGS / f"{stage}.json"
        files[timings_path] = json_bytes(timings_path, timings)
    return files


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def lock_path(folder: Path) -> Path:
    return Path(folder).with_name(Path(folder).name + LOCK_SUFFIX)


@contextmanager
def exclusive(folder: Path) -> Iterator[None]:
    """Hold `folder` for this process: a second run on it stops with one line naming the first's pid.

    The lock is the kernel's (flock) on `FOLDER.lock` beside it, so it ends with its process: a run killed
    with -9 never blocks the next one, and the file left behind holds nothing. It sits beside the folder, not in
    it, so the folder holds checkpoints only."""
    folder = Path(folder)
    with writing(lock_path(folder)):
        folder.parent.mkdir(parents=True, exist_ok=True)
        handle = open(lock_path(folder), "a+", encoding="utf-8")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        owner = handle.read().strip() or "unknown"
        handle.close()
        raise UserError(f"{folder}: in use by another kiln run (pid {owner}); wait for it to end or stop it") from None
    handle.seek(0)
    handle.truncate()
    handle.write(f"{os.getpid()}\n")
    handle.flush()
    try:
        yield
    finally:
        fcntl.flock(handle, fcntl.LOCK_UN)
        handle.close()
