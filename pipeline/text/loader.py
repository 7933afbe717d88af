"""Reading token shards: checked, memory-mapped, and batched deterministically.

`ShardSet` opens one split of a shard folder only after its manifest, every header, every file size and
(by default) every sha256 agree, and after the tokenizer hash matches the one the caller trains with.

`TokenBatches` yields `(x, y)` int64 tensors of shape `(B, T)`, `y` being `x` shifted by one token.
Batch `step` depends only on `(seed, step, rank, world_size)`, never on what was read before, so its state
is one integer and a resumed run sees exactly the batches an uninterrupted run would have seen. A run resumed
with another global micro-batch (`batch_size * world_size`, e.g. on another number of GPUs) goes on after the
windows already consumed, in the new shape.
- random windows (training): the starts of the whole global batch (`B * world_size` windows) come from one
  generator seeded with `(seed, step)` and each rank takes its own slice, so ranks never share a draw and
  the global batch does not depend on how it is split across processes;
- sequential windows (evaluation): consecutive non-overlapping windows, interleaved across ranks, until the
  split runs out.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from kiln.pipeline.errors import UserError
from kiln.pipeline.outputs import sha256_file
from kiln.pipeline.text.shard_format import MANIFEST, ShardHeader, open_tokens


class ShardSet:
    def __init__(self, shard_dir: Path, split: str, tokenizer_sha256: str | None = None, verify: bool = True):
        shard_dir = Path(shard_dir)
        manifest_path = shard_dir / MANIFEST
        if not manifest_path.is_file():
            raise UserError(f"{manifest_path}: shard manifest not found (run `kiln data shard` first)")
        try:
            manifest = json.loads(manifest_path.read_text())
            entries = manifest["splits"][split]["shards"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise UserError(f"{manifest_path}: not a valid shard manifest for split {split!r} ({e})") from None
        if tokenizer_sha256 is not None and manifest["tokenizer_sha256"] != tokenizer_sha256:
            raise UserError(
                f"{manifest_path}: shards were made with another tokenizer "
                f"(sha256 {manifest['tokenizer_sha256'][:12]}…, expected {tokenizer_sha256[:12]}…)"
            )
        self.tokenizer_sha256 = manifest["tokenizer_sha256"]
        self.vocab_size = manifest["vocab_size"]
        self.eot_id = manifest["eot_id"]
        self.arrays = []
        for entry in entries:
            path = shard_dir / entry["file"]
            header = ShardHeader.read(path)
            if header.tokenizer_sha256 != self.tokenizer_sha256:
                raise UserError(f"{path}: made with another tokenizer than {manifest_path} lists")
            if header.tokens != entry["tokens"] or header.vocab_size != self.vocab_size:
                raise UserError(f"{path}: header disagrees with {manifest_path} (tokens or vocab size)")
            if verify and sha256_file(path) != entry["sha256"]:
                raise UserError(f"{path}: corrupted shard (sha256 differs from {manifest_path})")
            self.arrays.append(open_tokens(path, header))
        self.offsets = np.cumsum([0, *(len(a) for a in self.arrays)])
        self.tokens = int(self.offsets[-1])

    def read(self, start: int, n: int) -> np.ndarray:
        """Tokens `[start, start + n)` of the split as if its shards were one array."""
        out = np.empty(n, dtype=np.int64)
        filled = 0
        i = int(np.searchsorted(self.offsets, start, side="right")) - 1
        while filled < n:
            local = start + filled - int(self.offsets[i])
            take = min(n - filled, len(self.arrays[i]) - local)
            out[filled:filled + take] = self.arrays[i][local:local + take]
            filled += take
            i += 1
        return out


class TokenBatches:
    def __init__(self, shards: ShardSet, batch_size: int, seq_len: int, *, seed: int = 0, rank: int = 0,
                 world_size: int = 1, random: bool = True):
        if shards.tokens < seq_len + 1:
            raise UserError(f"split has {shards.tokens} tokens, fewer than one window of seq_len+1={seq_len + 1}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside world of {world_size}")
        self.shards, self.batch_size, self.seq_len = shards, batch_size, seq_len
        self.seed, self.rank, self.world_size, self.random = seed, rank, world_size, random
        self.step = 0

    def __iter__(self):
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        starts = self._starts(self.step)
        if len(starts) == 0:
            raise StopIteration
        self.step += 1
        rows = np.stack([self.shards.read(int(s), self.seq_len + 1) for s in starts])
        rows = torch.from_numpy(rows)
        return rows[:, :-1], rows[:, 1:]

    def _starts(self, step: int) -> np.ndarray:
        B, T, world = self.batch_size, self.seq_len, self.world_size
        if self.random:
            rng = np.random.default_rng([self.seed, step])
            starts = rng.integers(0, self.shards.tokens - T, size=B * world)
            return starts[self.rank * B:(self.rank + 1) * B]
        windows = (self.shards.tokens - 1) // T
        first = step * B * world + self.rank * B
        return np.arange(first, min(first + B, windows)) * T

    def __len__(self) -> int:
        """Batches this rank gets in sequential mode."""
        windows = (self.shards.tokens - 1) // self.seq_len
        per_round = self.batch_size * self.world_size
        full, rest = divmod(windows, per_round)
        return full + (1 if rest > self.rank * self.batch_size else 0)

    def state_dict(self) -> dict:
        return {"step": self.step, "seed": self.seed, "batch_size": self.batch_size, "seq_len": self.seq_len,
                "world_size": self.world_size, "random": self.random, "tokenizer_sha256": self.shards.tokenizer_sha256}

    def load_state_dict(self, state: dict) -> None:
        mine = self.state_dict()
        for key in ("seed", "seq_len", "random", "tokenizer_sha256"):
            if state.get(key) != mine[key]:
                raise UserError(f"resume state: data loader {key}={state.get(key)!r}, this run has {mine[key]!r}")
        rows_then = int(state["batch_size"]) * int(state["world_size"])
        self.step = int(state["step"]) * rows_then // (self.batch_size * self.world_size)
