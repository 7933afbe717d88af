"""Where a benchmark ran, recorded beside its numbers: absolute numbers depend on the machine, ratios taken in one
run on it are what the benchmarks claim."""

from __future__ import annotations

import importlib.metadata
import os
import platform


def machine() -> dict:
    return {"cpu_count": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
            "processor": platform.processor() or platform.machine()}


def package_version(distribution: str) -> str | None:
    """The installed version of a distribution (PyPI name), or None when it is not installed."""
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None
