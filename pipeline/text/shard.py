"""Stage `shard`: both corpus splits -> `data/shards/{split}_{index:06d}.bin` + `manifest.json`.

Documents are encoded a batch at a time on every core (tiktoken's threads by default, or HF tokenizers),
followed by `<|endoftext|>`, and streamed into files of `shard.shard_tokens` tokens, so memory stays flat
however large the corpus. The manifest records each shard's token count and sha256 and the tokenizer's
sha256, which the reader checks before training touches a token.

A kill costs at most the shard being written. Finished shards go one by one into the stage's checkpoint
folder (`data/checkpoints/shard/`, each file written whole), and `progress.json` there records after each one
where in its split the next shard starts (document and token offset) and a fingerprint of the inputs (corpus,
tokenizer, `shard_tokens`). A rerun on the same inputs keeps the shards whose sha256 still matches and encodes
from there on; other inputs start afresh. Only when every shard exists are they linked into the output
folder, published whole by the one writer, so `data/shards` is never partial and a resumed run's output is
byte for byte an uninterrupted one's.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import numpy as np
import pyarrow.compute as pc

from kiln.pipeline import layout
from kiln.pipeline.config import Section
from kiln.pipeline.errors import UserError
from kiln.pipeline.outputs import (
    atomic_dir,
    atomic_write_bytes,
    exclusive,
    sha256_file,
    write_json,
    write_metrics,
)
from kiln.pipeline.progress import Progress
from kiln.pipeline.text.bpe import EOT, batch_encoder, load_tokenizer
from kiln.pipeline.text.corpus import SPLITS, open_split, text_batches
from kiln.pipeline.text.shard_format import MANIFEST, VERSION, ShardHeader, shard_name, token_dtype

PROGRESS = "progress.json"
# Documents per encode call: their ids as Python lists (~36 bytes a token) are most of what a batch holds, ~11 MB
# for Shakespeare's 6 kB scenes; 512 held 4x that and encoded no faster (measured on 40 MB of text).
ENCODE_DOCS = 128


MAX_THREADS = 1024


@dataclass
class ShardParams(Section):
    SECTION: ClassVar[str] = "shard"
    shard_tokens: int = 1_000_000
    # `tiktoken` (fast, multithreaded) or `hf` (the tokenizers library itself); both give identical ids.
    backend: str = "tiktoken"
    threads: int = 0  # 0 = every core

    def check(self) -> None:
        if self.shard_tokens < 1024:
            raise self.bad("shard_tokens", "at least 1024")
        if self.backend not in ("tiktoken", "hf"):
            raise self.bad("backend", "'tiktoken' or 'hf'")
        if not 0 <= self.threads <= MAX_THREADS:
            raise self.bad("threads", f"0 (every core) or a number of threads up to {MAX_THREADS}")




class ShardWriter:
    """Appends documents' tokens and cuts them into files of exactly `shard_tokens` (the last one shorter).

    Positions count tokens from the start of the split. For each pending document the writer keeps its index and
    [start, end) span, so that it can say where the next shard starts: a document and a token offset in it."""

    def __init__(self, folder: Path, split: str, shard_tokens: int, vocab_size: int, tokenizer_sha: str,
                 done: list[dict], on_shard: Callable[[], None]):
        self.folder, self.split, self.shard_tokens = folder, split, shard_tokens
        self.vocab_size, self.tokenizer_sha, self.on_shard = vocab_size, tokenizer_sha, on_shard
        self.dtype = token_dtype(vocab_size)
        self.shards = done  # progress.json's list for this split, extended in place
        self.written = sum(s["tokens"] for s in done)
        self.pending: list[np.ndarray] = []
        self.pending_tokens = 0
        self.docs = self.starts = self.ends = np.zeros(0, np.int64)

    @property
    def end(self) -> int:
        """Where the next token added goes."""
        return self.written + self.pending_tokens

    def add(self, ids: np.ndarray, docs: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> None:
        self.pending.append(ids)
        self.pending_tokens += len(ids)
        self.docs, self.starts, self.ends = (np.concatenate(a) for a in ((self.docs, docs), (self.starts, starts),
                                                                         (self.ends, ends)))
        while self.pending_tokens >= self.shard_tokens:
            self._write(self.shard_tokens)

    def close(self) -> None:
        if self.pending_tokens or not self.shards:
            self._write(self.pending_tokens)

    def _write(self, n: int) -> None:
        buf = np.concatenate(self.pending) if self.pending else np.zeros(0, self.dtype)
        chunk, rest = buf[:n], buf[n:]
        self.pending, self.pending_tokens = ([rest] if len(rest) else []), len(rest)
        name = shard_name(self.split, len(self.shards))
        header = ShardHeader(tokens=len(chunk), vocab_size=self.vocab_size, tokenizer_sha256=self.tokenizer_sha,
                             itemsize=self.dtype.itemsize)
        data = header.pack() + chunk.tobytes()
        atomic_write_bytes(self.folder / name, data)
        self.written += n
        # The first document not wholly in the shards written so far: the next shard starts inside it.
        j = int(np.searchsorted(self.ends, self.written, side="right"))
        if j < len(self.docs):
            next_doc, next_offset = int(self.docs[j]), self.written - int(self.starts[j])
        else:
            next_doc, next_offset = (int(self.docs[-1]) + 1 if len(self.docs) else 0), 0
        self.docs, self.starts, self.ends = self.docs[j:], self.starts[j:], self.ends[j:]
        self.shards.append({"file": name, "tokens": len(chunk), "sha256": hashlib.sha256(data).hexdigest(),
                            "next_doc": next_doc, "next_offset": next_offset})
        self.on_shard()


def fingerprint(params: ShardParams, paths: dict[str, Path], tokenizer_sha: str) -> str:
    """What the shards are a function of: the corpus, the tokenizer, the shard size and format (not the
    backend or threads, which give identical ids)."""
    inputs = {"format_version": VERSION, "tokenizer_sha256": tokenizer_sha, "shard_tokens": params.shard_tokens,
              "corpus": {split: sha256_file(path) for split, path in paths.items()}}
    return hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()


def resume(work: Path, key: str) -> dict:
    """The progress of an earlier run on the same inputs, cut to its shards that are still intact, or a fresh
    start; leftovers (the shard a kill interrupted, another input's shards) are removed."""
    progress = read_progress(work) if work.exists() else None
    if progress is not None and progress["fingerprint"] == key:
        for split in SPLITS:
            entries = progress["shards"][split]
            good = next((i for i, e in enumerate(entries) if not intact(work / e["file"], e)), len(entries))
            del entries[good:]
        keep = {PROGRESS, *(e["file"] for split in SPLITS for e in progress["shards"][split])}
        for path in work.iterdir():
            if path.name not in keep:
                path.unlink()
        write_json(work / PROGRESS, progress)
        return progress
    if work.exists():
        shutil.rmtree(work)
    progress = {"fingerprint": key, "shards": {split: [] for split in SPLITS}}
    with atomic_dir(work) as tmp:
        write_json(tmp / PROGRESS, progress)
    return progress


def read_progress(work: Path) -> dict | None:
    """progress.json of an earlier run, or None when it is damaged; a folder without one is not kiln's."""
    path = work / PROGRESS
    if not path.is_file():
        raise UserError(f"{work}: holds no {PROGRESS}, so it is not the resume state of `kiln data shard`; "
                        "move it away")
    try:
        progress = json.loads(path.read_text(encoding="utf-8"))
        valid = isinstance(progress["fingerprint"], str) and all(
            isinstance(e["file"], str) and type(e["tokens"]) is int and isinstance(e["sha256"], str)
            and type(e["next_doc"]) is int and type(e["next_offset"]) is int
            for split in SPLITS for e in progress["shards"][split])
    except (ValueError, KeyError, TypeError):
        return None
    return progress if valid else None


def intact(path: Path, entry: dict) -> bool:
    try:
        header = ShardHeader.read(path)
    except UserError:
        return False
    return header.tokens == entry["tokens"] and sha256_file(path) == entry["sha256"]


def shard(params: ShardParams, corpus_dir: Path, tokenizer_path: Path, out_dir: Path = layout.SHARDS,
          work: Path | None = None) -> dict:
    work = layout.checkpoints("shard") if work is None else work
    tok = load_tokenizer(tokenizer_path)
    vocab_size, eot = tok.get_vocab_size(), tok.token_to_id(EOT)
    if eot is None:
        raise UserError(f"{tokenizer_path}: has no {EOT} token (train it with `kiln tokenizer train`)")
    tokenizer_sha = sha256_file(tokenizer_path)
    encode = batch_encoder(tokenizer_path, params.backend, params.threads)
    paths = {split: corpus_dir / f"{split}.parquet" for split in SPLITS}
    for path in paths.values():
        if not path.is_file():
            raise UserError(f"{path}: corpus split not found (run `kiln data prepare` first)")
    total_docs = sum(open_split(p).metadata.num_rows for p in paths.values())
    dtype = token_dtype(vocab_size)
    manifest = {"format_version": VERSION, "tokenizer_sha256": tokenizer_sha, "vocab_size": vocab_size,
                "dtype": dtype.name, "eot_id": eot, "splits": {}}
    metrics: dict[str, float] = {}
    text_bytes = encoded_bytes = 0
    start = time.perf_counter()
    with exclusive(work):
        progress = resume(work, fingerprint(params, paths, tokenizer_sha))
        with Progress("shard", unit="docs", total=total_docs) as bar:
            for split, path in paths.items():
                done = progress["shards"][split]
                writer = ShardWriter(work, split, params.shard_tokens, vocab_size, tokenizer_sha, done,
                                     lambda: write_json(work / PROGRESS, progress))
                next_doc, offset = (done[-1]["next_doc"], done[-1]["next_offset"]) if done else (0, 0)
                documents = 0
                for column in text_batches(path, ENCODE_DOCS):
                    size = pc.sum(pc.binary_length(column)).as_py() or 0
                    first, documents = documents, documents + len(column)
                    text_bytes += size
                    bar.advance(len(column), bytes=size)
                    if documents <= next_doc:  # wholly in finished shards
                        continue
                    skip = max(next_doc - first, 0)
                    encoded = encode(column.slice(skip).to_pylist())
                    for ids in encoded:
                        ids.append(eot)
                    lengths = np.fromiter(map(len, encoded), np.int64, len(encoded))
                    ids = np.fromiter(itertools.chain.from_iterable(encoded), dtype, int(lengths.sum()))
                    drop = offset if first + skip == next_doc else 0  # the finished shards hold its first tokens
                    ends = writer.end - drop + np.cumsum(lengths)
                    writer.add(ids[drop:], np.arange(first + skip, documents), ends - lengths, ends)
                    encoded_bytes += size
                writer.close()
                tokens = sum(s["tokens"] for s in done)
                manifest["splits"][split] = {"tokens": tokens, "documents": documents,
                                             "shards": [{k: s[k] for k in ("file", "tokens", "sha256")}
                                                        for s in done]}
                metrics[f"{split}_tokens"] = tokens
                metrics[f"{split}_shards"] = len(done)
        seconds = time.perf_counter() - start
        metrics.update({"text_mb": round(text_bytes / 1e6, 3), "seconds": round(seconds, 3),
                        "mb_per_s": round(encoded_bytes / 1e6 / seconds, 3)})
        with atomic_dir(out_dir, (MANIFEST, "*.bin"), "shards") as tmp:
            for split in SPLITS:
                for entry in progress["shards"][split]:
                    link(work / entry["file"], tmp / entry["file"])
            write_json(tmp / MANIFEST, manifest)
            write_metrics("shard", metrics)
        shutil.rmtree(work)
    # The lock file stays: removed, a run that opened it before could lock it while a third locks a new file.
    return metrics


def link(src: Path, dst: Path) -> None:
    """A second name for a finished shard: no copy, and the resume state keeps it until the output is
    published. Where no link can be made (the output on another filesystem than the resume state: EXDEV; a
    filesystem without hard links), a copy; a rename could not cross filesystems either."""
    try:
        os.link(src, dst)
    except OSError:
        shutil.copyfile(src, dst)
