"""Local eval task files read row by row, each row with where it came from, so that a bad row can be named.

`datasets` (which reads `hf:` sets, `post.chat_data.read_rows`) loses the line of a row, unifies the types of a
column (a gold of 1.5 among ints turns every gold into a float) and takes a second to open a file. A benchmark
file is small and must be read exactly as written, so the local formats are read here with the standard library
and pyarrow: JSON lines (`.jsonl`, or `.json` that is not one array), a JSON array of objects (`.json`), Parquet,
and header-less CSV (MMLU), each optionally gzipped. Anything unreadable (not UTF-8, not JSON, a truncated gzip
stream, not Parquet) is a `UserError` naming the file and, where there are lines, the line.
"""

from __future__ import annotations

import csv
import gzip
import io
import json
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from kiln.model.files import check_regular
from kiln.pipeline.errors import UserError

ROW_FILES = (".jsonl", ".json", ".parquet")
# A benchmark or dataset file is megabytes, a row kilobytes: beyond these caps a file (decompressed, when
# gzipped) or a line is not a task file's, and reading on would only fill the memory.
MAX_FILE_BYTES = 4 << 30
MAX_LINE_BYTES = 8 << 20
WHAT = "a task or dataset file (JSON lines, JSON, Parquet or CSV, optionally gzipped)"

# What a damaged gzip stream raises part-way through: a cut file (EOFError), a bad header (BadGzipFile is an
# OSError), corrupt deflate data (zlib.error).
GZIP_ERRORS = (EOFError, OSError, zlib.error)


@dataclass(frozen=True)
class Row:
    where: str     # "path:line" or "path: row N", for messages
    values: dict   # column -> value, with the types the file gave them


def is_row_file(path: Path) -> bool:
    return _suffix(path) in ROW_FILES


def read_row_file(path: Path) -> Iterator[Row]:
    """The rows of a .jsonl, .json or .parquet file (optionally .gz), lazily."""
    check_regular(path, MAX_FILE_BYTES, WHAT)
    suffix = _suffix(path)
    if suffix == ".parquet":
        return _parquet_rows(path)
    if suffix == ".json":
        return _json_rows(path)
    return _json_lines(path, _lines(path))


def read_csv_file(path: Path) -> Iterator[tuple[str, list[str]]]:
    """("path:line", cells) for each non-empty record of a header-less CSV file (optionally .gz)."""
    check_regular(path, MAX_FILE_BYTES, WHAT)
    try:
        with _open_text(path) as f:
            reader = csv.reader(f)
            line = 1
            for cells in reader:
                if cells:
                    yield f"{path}:{line}", cells
                line = reader.line_num + 1  # a quoted cell may span lines: a record starts after the last one
    except UnicodeDecodeError as e:
        raise UserError(f"{path}: not UTF-8 text ({e.reason})") from None
    except csv.Error as e:
        raise UserError(f"{path}:{reader.line_num}: not CSV ({e})") from None
    except GZIP_ERRORS as e:
        raise UserError(f"{path}: cannot read it ({_gzip_reason(path, e)})") from None


def _suffix(path: Path) -> str:
    return Path(path.name.removesuffix(".gz")).suffix


def _is_gzip(path: Path) -> bool:
    return path.name.endswith(".gz")


def _gzip_reason(path: Path, e: Exception) -> str:
    reason = str(e).splitlines()[0] if str(e).strip() else type(e).__name__
    return f"{reason}: a truncated or corrupt gzip file" if _is_gzip(path) else reason


def _open_text(path: Path):
    if _is_gzip(path):
        return gzip.open(path, "rt", encoding="utf-8", newline="")
    return open(path, encoding="utf-8", newline="")


def _read_bytes(path: Path) -> bytes:
    try:
        with gzip.open(path, "rb") if _is_gzip(path) else open(path, "rb") as f:
            data = f.read(MAX_FILE_BYTES + 1)
    except GZIP_ERRORS as e:
        raise UserError(f"{path}: cannot read it ({_gzip_reason(path, e)})") from None
    if len(data) > MAX_FILE_BYTES:
        raise UserError(f"{path}: more than {MAX_FILE_BYTES:,} bytes (decompressed); expected {WHAT} of at most "
                        "that")
    return data


def _lines(path: Path) -> Iterator[tuple[int, bytes]]:
    """Each line with its number; one longer than MAX_LINE_BYTES is refused as it is read, not held whole."""
    try:
        with (gzip.open(path, "rb") if _is_gzip(path) else open(path, "rb")) as f:
            number = 0
            while line := f.readline(MAX_LINE_BYTES + 1):
                number += 1
                if len(line) > MAX_LINE_BYTES:
                    raise UserError(f"{path}:{number}: a line of more than {MAX_LINE_BYTES:,} bytes; expected one "
                                    "row per line")
                yield number, line
    except GZIP_ERRORS as e:
        raise UserError(f"{path}: cannot read it ({_gzip_reason(path, e)})") from None


def _json_lines(path: Path, lines: Iterator[tuple[int, bytes]]) -> Iterator[Row]:
    for number, raw in lines:
        where = f"{path}:{number}"
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise UserError(f"{where}: not UTF-8 (byte {e.start + 1} of the line)") from None
        if text.strip():
            yield Row(where, _object(_parse(text, where), where))


def _json_rows(path: Path) -> Iterator[Row]:
    """A JSON array of row objects, or else JSON lines (as `datasets` reads a .json file)."""
    data = _read_bytes(path)
    if not data.lstrip().startswith(b"["):
        yield from _json_lines(path, enumerate(io.BytesIO(data), 1))
        return
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise UserError(f"{path}: not UTF-8 (byte {e.start + 1})") from None
    for i, value in enumerate(_parse(text, str(path)), 1):
        where = f"{path}: row {i}"
        yield Row(where, _object(value, where))


def _parse(text: str, where: str) -> object:
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        at = f"line {e.lineno}, column {e.colno}" if "\n" in text.strip() else f"column {e.colno}"
        raise UserError(f"{where}: not JSON: {e.msg} ({at})") from None
    except RecursionError:
        raise UserError(f"{where}: JSON nested too deeply") from None
    except ValueError as e:  # e.g. an integer of more digits than Python converts
        raise UserError(f"{where}: not usable JSON ({e})") from None


def _object(value: object, where: str) -> dict:
    if not isinstance(value, dict):
        raise UserError(f"{where}: expected a JSON object (one row), got {type(value).__name__}")
    return value


def _parquet_rows(path: Path) -> Iterator[Row]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    source = pa.BufferReader(_read_bytes(path)) if _is_gzip(path) else str(path)
    try:
        batches = pq.ParquetFile(source).iter_batches()
        start = 1
        for batch in batches:
            rows = batch.to_pylist()
            yield from (Row(f"{path}: row {start + i}", row) for i, row in enumerate(rows))
            start += len(rows)
    except (pa.ArrowException, OSError, ValueError) as e:  # ValueError: a string column that is not UTF-8
        first = next((line for line in str(e).splitlines() if line.strip()), type(e).__name__)
        raise UserError(f"{path}: not a readable Parquet file ({first})") from None
