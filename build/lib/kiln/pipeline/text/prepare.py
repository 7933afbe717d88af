"""Stage `prepare`: raw documents -> `data/corpus/{train,val}.parquet` (columns `text`, `source`).

Every document is NFC-normalised, dropped if empty or an exact duplicate of an earlier one, and assigned to
val when a hash of its text falls below `data.val_fraction`. The split depends on the text alone, so adding
documents to the corpus never moves an existing one from train to val or back, and a duplicate can never sit
on both sides.
"""

from __future__ import annotations

import hashlib
import time
import unicodedata
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from kiln.pipeline import layout
from kiln.pipeline.errors import UserError
from kiln.pipeline.outputs import atomic_dir, write_metrics
from kiln.pipeline.progress import Progress
from kiln.pipeline.text.corpus import SPLITS, SURROGATE
from kiln.pipeline.text.sources import DataParams, DecodeStats, Document, read_documents

SCHEMA = pa.schema([("text", pa.string()), ("source", pa.string())])
ROWS_PER_WRITE = 1024


def split_of(data: bytes, val_fraction: float) -> str:
    """`val` for a stable `val_fraction` of texts, chosen by a hash of the text's UTF-8 bytes."""
    h = int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")
    return "val" if h / 2**64 < val_fraction else "train"


def valid_unicode(doc: Document, decode_errors: str, stats: DecodeStats) -> str:
    """Lone surrogates (e.g. a JSON `"\\ud800"` escape) have no UTF-8 form; refuse them or replace them."""
    try:
        doc.text.encode("utf-8")
        return doc.text
    except UnicodeEncodeError as e:
        if decode_errors == "strict":
            raise UserError(
                f"{doc.source}: text holds a lone surrogate {doc.text[e.start]!r} at character {e.start}, "
                "which is not valid Unicode; set data.decode_errors=replace to replace it"
            ) from None
    fixed, count = SURROGATE.subn("\ufffd", doc.text)
    stats.replaced += count
    return fixed


@dataclass
class SplitWriter:
    """Buffers rows and appends them to one parquet file."""

    path: Path
    documents: int = 0
    bytes: int = 0
    _rows: list[Document] = field(default_factory=list)
    _writer: pq.ParquetWriter | None = None

    def add(self, doc: Document, size: int) -> None:
        self._rows.append(doc)
        self.documents += 1
        self.bytes += size
        if len(self._rows) >= ROWS_PER_WRITE:
            self.flush()

    def flush(self) -> None:
        if self._writer is None:
            self._writer = pq.ParquetWriter(self.path, SCHEMA, compression="zstd")
        if self._rows:
            table = pa.table({"text": [d.text for d in self._rows], "source": [d.source for d in self._rows]}, SCHEMA)
            self._writer.write_table(table)
            self._rows.clear()

    def close(self) -> None:
        self.flush()
        self._writer.close()


def prepare(params: DataParams, out_dir: Path = layout.CORPUS) -> dict:
    stats = DecodeStats()
    seen: set[bytes] = set()
    duplicates = empty = kept_bytes = 0
    start = time.perf_counter()
    with atomic_dir(out_dir) as tmp, Progress("prepare", unit="docs", total=params.max_docs) as progress:
        writers = {split: SplitWriter(tmp / f"{split}.parquet") for split in SPLITS}
        kept = 0
        for doc in read_documents(params, stats):
            text = unicodedata.normalize("NFC", valid_unicode(doc, params.decode_errors, stats))
            if not text.strip():
                empty += 1
                continue
            data = text.encode("utf-8")
            key = hashlib.blake2b(data, digest_size=16).digest()
            if key in seen:
                duplicates += 1
                continue
            size = len(data)
            if params.max_bytes is not None and kept_bytes + size > params.max_bytes:
                if not kept:
                    raise UserError(f"params: data.max_bytes={params.max_bytes}: smaller than the first document "
                                    f"({size} bytes)")
                break
            seen.add(key)
            writers[split_of(data, params.val_fraction)].add(Document(doc.source, text), size)
            kept += 1
            kept_bytes += size
            progress.advance(1, bytes=size)
            if params.max_docs is not None and kept >= params.max_docs:
                break
        for writer in writers.values():
            writer.close()
        if kept == 0:
            raise UserError(f"params: data.source={params.source!r}: the corpus is empty (no non-blank document)")
        if writers["val"].documents == 0 or writers["train"].documents == 0:
            side = "val" if writers["val"].documents == 0 else "train"
            raise UserError(
                f"params: data.val_fraction={params.val_fraction}: {kept} document(s) left {side} empty; "
                "add documents or change the fraction"
            )
        metrics = {
            **{f"{split}_documents": writers[split].documents for split in SPLITS},
            **{f"{split}_bytes": writers[split].bytes for split in SPLITS},
            "duplicates_dropped": duplicates,
            "empty_dropped": empty,
            "replaced_chars": stats.replaced,
            "seconds": round(time.perf_counter() - start, 3),
        }
        write_metrics("prepare", metrics)
    return metrics
