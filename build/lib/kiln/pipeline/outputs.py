"""Writing outputs so that a stage leaves all of them or none: temp name in the same folder, then rename.

A rename within one filesystem is atomic, so an interrupted or failed stage never leaves a half-written
tokenizer or a short shard where the next stage (or `dvc repro`) would take it for a finished one.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def atomic_dir(final: Path) -> Iterator[Path]:
    """Yield an empty temp folder beside `final`; on success it replaces `final`, on error it is removed."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f"{final.name}.tmp-", dir=final.parent))
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    tmp.chmod(0o755)
    if final.exists():
        old = Path(tempfile.mkdtemp(prefix=f"{final.name}.old-", dir=final.parent))
        final.rename(old / final.name)
        tmp.rename(final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        tmp.rename(final)


def atomic_write_bytes(path: Path, data: bytes) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f"{path.name}.tmp-", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_json(path: Path, obj) -> None:
    atomic_write_bytes(path, (json.dumps(obj, indent=2, sort_keys=False) + "\n").encode())


def write_metrics(stage: str, values: dict, metrics_dir: Path = Path("metrics")) -> Path:
    """`metrics/<stage>.json`, the file dvc.yaml lists under `metrics:` for `dvc metrics diff`."""
    path = Path(metrics_dir) / f"{stage}.json"
    write_json(path, values)
    return path


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()
