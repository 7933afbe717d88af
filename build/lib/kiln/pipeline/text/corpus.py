"""The corpus format every stage after `prepare` reads: train/val parquet files with a `text` column, one row
per document (written by text/prepare.py)."""

from __future__ import annotations

import re
from pathlib import Path

import pyarrow.parquet as pq


def iter_texts(parquet: Path, batch_size: int = 512):
    """Lists of document texts from a corpus split, a batch at a time."""
    for batch in pq.ParquetFile(parquet).iter_batches(columns=["text"], batch_size=batch_size):
        yield batch.column(0).to_pylist()


SPLITS = ("train", "val")


SURROGATE = re.compile("[\ud800-\udfff]")
