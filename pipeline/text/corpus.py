"""The corpus format every stage after `prepare` reads: train/val parquet files with a `text` column, one row
per document (written by text/prepare.py)."""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from kiln.pipeline.errors import UserError

SPLITS = ("train", "val")


SURROGATE = re.compile("[\ud800-\udfff]")


def open_split(parquet: Path) -> pq.ParquetFile:
    """A corpus split for reading a row group at a time, refused in one line when it is truncated, corrupted or
    not a corpus."""
    with unreadable(parquet):
        # pre_buffer (pyarrow's default) reads ahead every row group a reader asks for: the whole file, for
        # iter_batches. Read one at a time instead, so memory does not grow with the corpus.
        pf = pq.ParquetFile(parquet, pre_buffer=False)
    if "text" not in pf.schema_arrow.names:
        raise UserError(f"{parquet}: not a corpus split (no column 'text'); run `kiln data prepare` again")
    return pf


def text_batches(parquet: Path, batch_size: int = 512) -> Iterator[pa.Array]:
    """The `text` column of a corpus split as Arrow arrays, a batch at a time."""
    batches = open_split(parquet).iter_batches(columns=["text"], batch_size=batch_size)
    while True:
        with unreadable(parquet):
            batch = next(batches, None)
        if batch is None:
            return
        yield batch.column(0)


@contextmanager
def unreadable(parquet: Path) -> Iterator[None]:
    try:
        yield
    except Exception as e:  # pyarrow raises ArrowInvalid, OSError... for a truncated or corrupted file
        message = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UserError(f"{parquet}: corpus split unreadable ({message}); run `kiln data prepare` again") from None


def iter_texts(parquet: Path, batch_size: int = 512) -> Iterator[list[str]]:
    """Lists of document texts from a corpus split, a batch at a time."""
    for column in text_batches(parquet, batch_size):
        yield column.to_pylist()
