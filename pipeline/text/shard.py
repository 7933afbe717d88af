"""Stage `shard`: both corpus splits -> `data/shards/{split}_{index:06d}.bin` + `manifest.json`.

Documents are encoded a batch at a time on every core (tiktoken's threads by default, or HF tokenizers),
followed by `<|endoftext|>`, and streamed into files of `shard.shard_tokens` tokens, so memory stays flat
however large the corpus. The manifest records each shard's token count and sha256 and the tokenizer's
sha256, which the reader checks before training touches a token.
"""

from __future__ import annotations

import hashlib
import itertools
import time
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import numpy as np
import pyarrow.parquet as pq

from kiln.pipeline import layout
from kiln.pipeline.config import Section
from kiln.pipeline.errors import UserError
from kiln.pipeline.outputs import atomic_dir, sha256_file, write_json, write_metrics
from kiln.pipeline.progress import Progress
from kiln.pipeline.text.corpus import SPLITS, iter_texts
from kiln.pipeline.text.shard_format import MANIFEST, VERSION, ShardHeader, shard_name, token_dtype
from kiln.pipeline.text.tokens import EOT, batch_encoder, load_tokenizer


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
    """Appends token arrays and cuts them into files of exactly `shard_tokens` (the last one shorter)."""

    def __init__(self, out_dir: Path, split: str, shard_tokens: int, vocab_size: int, tokenizer_sha: str):
        self.out_dir, self.split, self.shard_tokens = out_dir, split, shard_tokens
        self.vocab_size, self.tokenizer_sha = vocab_size, tokenizer_sha
        self.dtype = token_dtype(vocab_size)
        self.pending: list[np.ndarray] = []
        self.pending_tokens = 0
        self.shards: list[dict] = []

    def add(self, ids: np.ndarray) -> None:
        self.pending.append(ids.astype(self.dtype, copy=False))
        self.pending_tokens += len(ids)
        while self.pending_tokens >= self.shard_tokens:
            self._write(self.shard_tokens)

    def close(self) -> list[dict]:
        if self.pending_tokens or not self.shards:
            self._write(self.pending_tokens)
        return self.shards

    def _write(self, n: int) -> None:
        buf = np.concatenate(self.pending) if self.pending else np.zeros(0, self.dtype)
        chunk, rest = buf[:n], buf[n:]
        self.pending, self.pending_tokens = ([rest] if len(rest) else []), len(rest)
        name = shard_name(self.split, len(self.shards))
        header = ShardHeader(tokens=len(chunk), vocab_size=self.vocab_size, tokenizer_sha256=self.tokenizer_sha,
                             itemsize=self.dtype.itemsize)
        data = header.pack() + chunk.tobytes()
        (self.out_dir / name).write_bytes(data)
        self.shards.append({"file": name, "tokens": len(chunk), "sha256": hashlib.sha256(data).hexdigest()})


def shard(params: ShardParams, corpus_dir: Path, tokenizer_path: Path, out_dir: Path = layout.SHARDS) -> dict:
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
    total_docs = sum(pq.ParquetFile(p).metadata.num_rows for p in paths.values())
    manifest = {"format_version": VERSION, "tokenizer_sha256": tokenizer_sha, "vocab_size": vocab_size,
                "dtype": token_dtype(vocab_size).name, "eot_id": eot, "splits": {}}
    metrics: dict[str, float] = {}
    text_bytes = 0
    start = time.perf_counter()
    with atomic_dir(out_dir) as tmp, Progress("shard", unit="docs", total=total_docs) as progress:
        for split, path in paths.items():
            writer = ShardWriter(tmp, split, params.shard_tokens, vocab_size, tokenizer_sha)
            documents = 0
            for texts in iter_texts(path):
                encoded = encode(texts)
                for ids in encoded:
                    ids.append(eot)
                writer.add(np.fromiter(itertools.chain.from_iterable(encoded), dtype=writer.dtype,
                                       count=sum(map(len, encoded))))
                size = sum(len(t.encode("utf-8")) for t in texts)
                text_bytes += size
                documents += len(texts)
                progress.advance(len(texts), bytes=size)
            shards = writer.close()
            tokens = sum(s["tokens"] for s in shards)
            manifest["splits"][split] = {"tokens": tokens, "documents": documents, "shards": shards}
            metrics[f"{split}_tokens"] = tokens
            metrics[f"{split}_shards"] = len(shards)
        write_json(tmp / MANIFEST, manifest)
        seconds = time.perf_counter() - start
        metrics.update({"text_mb": round(text_bytes / 1e6, 3), "seconds": round(seconds, 3),
                        "mb_per_s": round(text_bytes / 1e6 / seconds, 3)})
        write_metrics("shard", metrics)
    return metrics
