"""Stage `prepare`: raw documents -> `data/corpus/{train,val}.parquet` (columns `text`, `source`).

Every document is NFC-normalised, dropped if empty or an exact duplicate of an earlier one, and assigned to
val when a hash of its text falls below `data.val_fraction`. The split depends on the text alone, so adding
documents to the corpus never moves an existing one from train to val or back, and a duplicate can never sit
on both sides.

The work is parallel and streaming: `data.workers` processes each read and clean one unit of the source at a
time (a file, a row group, a run of lines: sources.py) and hand back its documents with their hashes; this
process takes the units in corpus order, so it alone decides what is a duplicate and where a cap stops, and
appends rows to the parquet files a row group at a time. The output is the same for any number of workers;
a source under PARALLEL_MIN_BYTES (Shakespeare is 5 MB) is read in this process, as starting workers would
cost more than they save.
Memory holds a window of units in flight and one 16-byte hash per kept document (for exact deduplication,
about 100 bytes a document in a Python set: 1.5 GB for 15M documents), never the corpus.
"""

from __future__ import annotations

import hashlib
import itertools
import multiprocessing
import os
import time
import unicodedata
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from kiln.pipeline import layout
from kiln.pipeline.errors import StageError, UserError
from kiln.pipeline.outputs import atomic_dir, write_metrics
from kiln.pipeline.progress import Progress
from kiln.pipeline.text.corpus import SPLITS, SURROGATE
from kiln.pipeline.text.sources import DataParams, DecodeStats, Document, Unit, check_size, plan_units

SCHEMA = pa.schema([("text", pa.string()), ("source", pa.string())])
# A unit's documents before they are written: 64-bit offsets, as a parquet row group or an hf: batch may hold more
# than the 2 GiB of text one Arrow string array can.
UNIT_SCHEMA = pa.schema([("text", pa.large_string()), ("source", pa.large_string())])
ROWS_PER_WRITE = 1024  # rows per parquet row group
# ... or fewer, when that many would hold more text than this: a row group is one Arrow string array when written
# and read back (2 GiB at most), and a reader holds one whole.
ROW_GROUP_BYTES = 64 << 20
KEY_BYTES = 16
# Below this much input one process is faster: a worker process starts by importing kiln (torch with it), about
# a second, and this process reads ~10 MB/s.
PARALLEL_MIN_BYTES = 32 << 20


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
class Cleaned:
    """One unit's documents, cleaned, in order, with what the deciding process needs about each.

    An error met partway keeps the documents before it: a cap reached among them ends the run as if the files
    had been read one document at a time, and the error counts only when the run gets past them."""

    table: pa.Table  # text, source
    empty: list[bool] = field(default_factory=list)
    key: list[bytes] = field(default_factory=list)  # dedupe hash of the UTF-8 text (empty: b"")
    size: list[int] = field(default_factory=list)  # UTF-8 bytes
    val: list[bool] = field(default_factory=list)
    replaced: list[int] = field(default_factory=list)  # replacement characters put into this document
    error: UserError | None = None


def clean(unit: Unit, params: DataParams) -> Cleaned:
    """A worker's job: read one unit, normalise and hash each document."""
    stats, texts, sources, out = DecodeStats(), [], [], Cleaned(UNIT_SCHEMA.empty_table())
    replaced = 0
    try:
        for doc in unit.documents(params.text_field, params.decode_errors, stats):
            text = unicodedata.normalize("NFC", valid_unicode(doc, params.decode_errors, stats))
            data = text.encode("utf-8")
            check_size(doc, len(data))
            empty = not text.strip()
            texts.append(text)
            sources.append(doc.source)
            out.empty.append(empty)
            out.key.append(b"" if empty else hashlib.blake2b(data, digest_size=KEY_BYTES).digest())
            out.size.append(len(data))
            out.val.append(split_of(data, params.val_fraction) == "val")
            out.replaced.append(stats.replaced - replaced)
            replaced = stats.replaced
    except UserError as e:
        out.error = e
    out.table = pa.table({"text": texts, "source": sources}, UNIT_SCHEMA)
    return out


def ordered_map(fn: Callable, units: Iterable[Unit], workers: int) -> Iterator:
    """`map(fn, units)` on `workers` processes, results in order, at most two per worker in flight: a fast
    reader never runs ahead of the slow writer by more than that, so memory stays flat. A source smaller than
    PARALLEL_MIN_BYTES is read here, in this process."""
    units, head, size = iter(units), [], 0
    while size < PARALLEL_MIN_BYTES and (unit := next(units, None)) is not None:
        head.append(unit)
        size += unit.size
    items = itertools.chain(head, units)
    if workers == 1 or size < PARALLEL_MIN_BYTES:
        yield from map(fn, items)
        return
    # forkserver, not fork: this process may already run pyarrow's threads, which a fork would copy mid-lock.
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload([__name__])
    with ProcessPoolExecutor(workers, mp_context=context) as pool:
        pending: deque = deque()
        try:
            for item in items:
                pending.append(pool.submit(fn, item))
                if len(pending) >= 2 * workers:
                    yield pending.popleft().result()
            while pending:
                yield pending.popleft().result()
        except BrokenProcessPool:
            raise StageError("prepare: a worker process died (killed, or out of memory); lower data.workers "
                             "or free memory and run again") from None
        finally:
            for future in pending:
                future.cancel()


@dataclass
class SplitWriter:
    """Appends rows to one parquet file in row groups of ROWS_PER_WRITE rows (the last one shorter), or of fewer
    where that many would hold more than ROW_GROUP_BYTES of text (at least one row)."""

    path: Path
    documents: int = 0
    bytes: int = 0
    _pending: list[pa.Table] = field(default_factory=list)
    _sizes: deque[int] = field(default_factory=deque)  # each pending row's UTF-8 bytes
    _writer: pq.ParquetWriter | None = None

    def add(self, rows: pa.Table, sizes: list[int]) -> None:
        self._pending.append(rows)
        self._sizes.extend(sizes)
        self.documents += rows.num_rows
        self.bytes += sum(sizes)
        while (n := self._group()) < len(self._sizes):
            self._write(n)

    def close(self) -> None:
        while self._sizes:
            self._write(self._group())
        if self._writer is None:
            self._write(0)
        self._writer.close()

    def _group(self) -> int:
        """How many pending rows the next row group takes: as many as fit its bounds, and at least one."""
        n, size = 0, 0
        for row in itertools.islice(self._sizes, ROWS_PER_WRITE):
            if n and size + row > ROW_GROUP_BYTES:
                break
            n, size = n + 1, size + row
        return n

    def _write(self, n: int) -> None:
        if self._writer is None:
            self._writer = pq.ParquetWriter(self.path, SCHEMA, compression="zstd")
        rows = pa.concat_tables(self._pending).combine_chunks() if self._pending else UNIT_SCHEMA.empty_table()
        if n:
            self._writer.write_table(rows.slice(0, n).cast(SCHEMA))
        rest = rows.slice(n)
        self._pending = [rest] if rest.num_rows else []
        for _ in range(n):
            self._sizes.popleft()


def prepare(params: DataParams, out_dir: Path = layout.CORPUS) -> dict:
    stats = DecodeStats()
    seen: set[bytes] = set()
    duplicates = empty = kept = kept_bytes = 0
    start = time.perf_counter()
    workers = params.workers or os.cpu_count() or 1
    units = plan_units(params)
    with atomic_dir(out_dir, ("*.parquet",), "corpus") as tmp, Progress("prepare", unit="docs", total=params.max_docs) as progress:
        writers = {split: SplitWriter(tmp / f"{split}.parquet") for split in SPLITS}
        for unit in ordered_map(partial(clean, params=params), units, workers):
            keep, done = [], False
            for i, is_empty in enumerate(unit.empty):
                stats.replaced += unit.replaced[i]
                if is_empty:
                    empty += 1
                    continue
                if unit.key[i] in seen:
                    duplicates += 1
                    continue
                size = unit.size[i]
                if params.max_bytes is not None and kept_bytes + size > params.max_bytes:
                    if not kept:
                        raise UserError(f"params: data.max_bytes={params.max_bytes}: smaller than the first "
                                        f"document ({size} bytes)")
                    done = True
                    break
                seen.add(unit.key[i])
                keep.append(i)
                kept += 1
                kept_bytes += size
                if params.max_docs is not None and kept >= params.max_docs:
                    done = True
                    break
            for split in SPLITS:
                rows = [i for i in keep if unit.val[i] == (split == "val")]
                writers[split].add(unit.table.take(pa.array(rows, pa.int64())), [unit.size[i] for i in rows])
            progress.advance(len(keep), bytes=sum(unit.size[i] for i in keep))
            if done:
                break
            if unit.error is not None:
                raise unit.error
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
