"""Reading token shards: checked, memory-mapped, and batched deterministically.

`ShardSet` opens one split of a shard folder only after its manifest (every field of the type it should
have), every header, every file size, every token id (inside the vocabulary) and (by default) every sha256
agree, and after the tokenizer hash matches the one the caller trains with.

`TokenBatches` yields `(x, y)` int64 tensors of shape `(B, T)`, `y` being `x` shifted by one token.
Batch `step` depends only on `(seed, step, rank, world_size)`, never on what was read before, so its state
is one integer and a resumed run sees exactly the batches an uninterrupted run would have seen, mid-epoch
included. A run resumed with another global micro-batch (`batch_size * world_size`, e.g. on another number of
GPUs) goes on after the windows already consumed, in the new shape.
- random windows (training), drawn without replacement: epoch e cuts the split into windows of T+1 tokens
  with stride T (neighbours share one token, so every token is a target exactly once) from an offset in
  [0, T), and visits them in a permuted order; offset and order are seeded with `(seed, e)`, so each epoch
  sees new window boundaries and a new order, and only fewer than T tokens at either edge sit out an epoch.
  The epochs' windows form one stream that global batches (`B * world_size` windows) take in turn, each rank
  its own slice, so ranks never share a window and the global batch does not depend on how it is split
  across processes. (Drawing starts with replacement, as kiln once did, leaves ~37% of the windows unseen
  per epoch's worth of steps and repeats others.)
- sequential windows (evaluation): consecutive windows of stride T, interleaved across ranks, until the
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

_SHA256_HEX = frozenset("0123456789abcdef")


def read_manifest(path: Path, split: str) -> tuple[dict, list[dict]]:
    """The manifest and the shard entries of `split`, every field the reader uses checked for its type, so a
    damaged or hand-edited file is one line naming the field, never a KeyError or a path outside the folder."""
    if not path.is_file():
        raise UserError(f"{path}: shard manifest not found (run `kiln data shard` first)")
    try:
        manifest = json.loads(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as e:
        raise UserError(f"{path}: not UTF-8 text (byte {e.start}); expected the JSON manifest `kiln data shard` "
                        "writes") from None
    except json.JSONDecodeError as e:
        raise UserError(f"{path}: not valid JSON ({e.msg} at line {e.lineno}); expected the manifest `kiln data "
                        "shard` writes") from None
    except (ValueError, RecursionError) as e:  # a number of over 4,300 digits, or nesting too deep to parse
        raise UserError(f"{path}: not a readable JSON manifest ({type(e).__name__})") from None
    if not isinstance(manifest, dict):
        raise UserError(f"{path}: expected a JSON object with tokenizer_sha256, vocab_size, eot_id and splits, "
                        f"found {_kind(manifest)}")
    _field(path, manifest, "tokenizer_sha256", _is_sha256, "64 lowercase hex digits")
    vocab_size = _field(path, manifest, "vocab_size", lambda v: _is_int(v) and v > 0, "a positive whole number")
    _field(path, manifest, "eot_id", lambda v: _is_int(v) and 0 <= v < vocab_size,
           f"a token id below vocab_size {vocab_size}")
    splits = _field(path, manifest, "splits", lambda v: isinstance(v, dict), "an object of splits")
    if split not in splits:
        raise UserError(f"{path}: splits has no {split!r} split (has: {', '.join(map(repr, splits)) or 'none'})")
    entry = _field(path, splits, split, lambda v: isinstance(v, dict), "an object with tokens and shards",
                   "splits.")
    prefix = f"splits.{split}."
    total = _field(path, entry, "tokens", lambda v: _is_int(v) and v >= 0, "a whole number >= 0", prefix)
    shards = _field(path, entry, "shards", lambda v: isinstance(v, list), "a list of shard entries", prefix)
    for i, shard in enumerate(shards):
        where = f"{prefix}shards[{i}]"
        if not isinstance(shard, dict):
            raise UserError(f"{path}: {where} is {_kind(shard)}; expected an object with file, tokens and sha256")
        _field(path, shard, "file", _is_file_name, f"a file name inside {path.parent}", f"{where}.")
        _field(path, shard, "tokens", lambda v: _is_int(v) and v >= 0, "a whole number >= 0", f"{where}.")
        _field(path, shard, "sha256", _is_sha256, "64 lowercase hex digits", f"{where}.")
    if sum(s["tokens"] for s in shards) != total:
        raise UserError(f"{path}: {prefix}tokens is {total}, but its shards hold {sum(s['tokens'] for s in shards)}")
    return manifest, shards


def _field(path: Path, obj: dict, key: str, valid, expected: str, prefix: str = ""):
    if key not in obj:
        raise UserError(f"{path}: {prefix}{key} is missing; expected {expected}")
    value = obj[key]
    if not valid(value):
        raise UserError(f"{path}: {prefix}{key} is {_kind(value)}; expected {expected}")
    return value


def _kind(value) -> str:
    shown = repr(value)
    return f"{type(value).__name__} {shown if len(shown) <= 40 else shown[:37] + '...'}"


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_sha256(value) -> bool:
    return isinstance(value, str) and len(value) == 64 and set(value) <= _SHA256_HEX


def _is_file_name(value) -> bool:
    """A bare name, as `kiln data shard` writes: no folder part, so no entry reaches outside the shard folder."""
    return (isinstance(value, str) and value not in ("", ".", "..") and "/" not in value and "\\" not in value
            and "\0" not in value)


class ShardSet:
    def __init__(self, shard_dir: Path, split: str, tokenizer_sha256: str | None = None, verify: bool = True):
        shard_dir = Path(shard_dir)
        manifest_path = shard_dir / MANIFEST
        manifest, entries = read_manifest(manifest_path, split)
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
            if not path.is_file():
                raise UserError(f"{manifest_path}: lists {entry['file']!r}, which is not a file in {shard_dir}")
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
        # Memos of pure functions of (seed, epoch): where each epoch starts in the stream of windows, and the
        # offset and order of the last epoch read (a permutation costs O(windows), so it is not redrawn per step).
        self._epoch_starts = [0]
        self._order: tuple[int, int, np.ndarray] | None = None

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
        first = step * B * world + self.rank * B
        if self.random:
            return self._window_starts(np.arange(first, first + B))
        windows = (self.shards.tokens - 1) // T
        return np.arange(first, min(first + B, windows)) * T

    def _epoch(self, epoch: int) -> tuple[int, np.random.Generator]:
        """Epoch `epoch`'s offset, and the generator that goes on to draw its order. The offset stays below
        tokens - T so that even the shortest split holds one window."""
        rng = np.random.default_rng([self.seed, epoch])
        return int(rng.integers(0, min(self.seq_len, self.shards.tokens - self.seq_len))), rng

    def _windows(self, offset: int) -> int:
        return (self.shards.tokens - 1 - offset) // self.seq_len

    def _window_starts(self, positions: np.ndarray) -> np.ndarray:
        """Token starts of the windows at `positions` in the stream epoch 0's windows, then epoch 1's, ..."""
        while self._epoch_starts[-1] <= positions[-1]:
            offset, _ = self._epoch(len(self._epoch_starts) - 1)
            self._epoch_starts.append(self._epoch_starts[-1] + self._windows(offset))
        bounds = np.array(self._epoch_starts)
        epochs = np.searchsorted(bounds, positions, side="right") - 1
        out = np.empty(len(positions), dtype=np.int64)
        for epoch in np.unique(epochs).tolist():
            if self._order is None or self._order[0] != epoch:
                offset, rng = self._epoch(epoch)
                self._order = (epoch, offset, rng.permutation(self._windows(offset)))
            _, offset, order = self._order
            at = epochs == epoch
            out[at] = offset + order[positions[at] - bounds[epoch]] * self.seq_len
        return out
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
