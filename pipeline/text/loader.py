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
- document-aligned rows (training, `documents=True`, `train.batching: documents`): every row starts at a
  document's first token (nanochat's loader). Documents are the runs of tokens up to and including each
  end-of-text token. One longer than a row is cut into whole rows of T+1 tokens from its first token (stride T,
  as windows); what is left of it, and every shorter document, is a piece packed whole into a row best-fit:
  each row takes, from the next PACK_BUFFER pieces of the epoch's seeded order, the longest that still fits,
  until none does, and the rest of the row is padding (target -100, so it adds nothing to the loss). Within an
  epoch every token is a target exactly once and no piece is split or repeated; the epoch's rows are then
  visited in a seeded order, and, as windows, the epochs form one stream that global batches take in turn.
  Documents that start at no row boundary under windows (the DAG's median one is ~1,900 tokens, 14 rows at
  T = 128) are where this differs most. With `segments=True` (`train.doc_mask`) each batch also holds the pieces'
  segment ids (B, T), so the model attends within each piece only, positions restarting (the padding is a
  segment of its own).
- sequential windows (evaluation): consecutive windows of stride T, interleaved across ranks, until the
  split runs out.
"""

from __future__ import annotations

import bisect
import json
from pathlib import Path

import numpy as np
import torch

from kiln.pipeline.errors import UserError
from kiln.pipeline.outputs import sha256_file
from kiln.pipeline.text.shard_format import MANIFEST, ShardHeader, open_tokens

_SHA256_HEX = frozenset("0123456789abcdef")
PACK_BUFFER = 64  # pieces a row may choose among when packing documents best-fit (nanochat's loader: 1,000 docs)
IGNORE = -100  # the loss's ignored target (padding in document rows)


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




def document_pieces(shards: ShardSet, row: int) -> tuple[np.ndarray, np.ndarray]:
    """(starts, lengths) of the split's documents cut into pieces of at most `row` tokens, each document's first
    piece at its first token and the next ones `row - 1` tokens on (neighbours share the token one predicts and
    the other reads), so every token but a document's first is a target in exactly one piece."""
    ends = [np.flatnonzero(np.asarray(array) == shards.eot_id) + (offset + 1)
            for array, offset in zip(shards.arrays, shards.offsets[:-1])]
    ends = np.concatenate([*ends, np.array([shards.tokens], dtype=np.int64)]).astype(np.int64)
    ends = np.unique(ends)  # a split that ends with end-of-text lists its end twice
    firsts = np.concatenate([[0], ends[:-1]])
    sizes = ends - firsts
    stride = row - 1
    counts = np.maximum(1, -(-(sizes - 1) // stride))  # pieces per document (a one-token one keeps its piece)
    doc = np.repeat(np.arange(len(sizes)), counts)
    k = np.arange(len(doc)) - np.repeat(np.cumsum(counts) - counts, counts)
    starts = firsts[doc] + k * stride
    lengths = np.minimum(row, ends[doc] - starts)
    keep = lengths >= 2  # a piece of one token predicts nothing
    return starts[keep], lengths[keep]


def pack_rows(lengths: np.ndarray, row: int, order: np.ndarray) -> list[np.ndarray]:
    """Pieces (indices into `lengths`, taken in `order`) packed into rows of `row` tokens best-fit: a full piece
    is a row; each other row takes, from the next PACK_BUFFER pieces waiting, the longest that fits the room
    left (the earliest of equals), until none fits."""
    rows = [np.array([i]) for i in order if lengths[i] == row]
    waiting = iter(int(i) for i in order if lengths[i] < row)
    buffer: list[tuple[int, int, int]] = []  # (length, arrival, piece), sorted
    arrival = 0

    def refill():
        nonlocal arrival
        while len(buffer) < PACK_BUFFER:
            piece = next(waiting, None)
            if piece is None:
                return
            bisect.insort(buffer, (int(lengths[piece]), arrival, piece))
            arrival += 1

    refill()
    while buffer:
        room, taken = row, []
        while True:
            at = bisect.bisect_left(buffer, (room + 1, -1, -1)) - 1  # the longest piece of length <= room...
            if at < 0:
                break
            length = buffer[at][0]
            at = bisect.bisect_left(buffer, (length, -1, -1))  # ...and the earliest to arrive of that length
            length, _, piece = buffer.pop(at)
            taken.append(piece)
            room -= length
            refill()
        rows.append(np.array(taken))
    return rows


class TokenBatches:
    def __init__(self, shards: ShardSet, batch_size: int, seq_len: int, *, seed: int = 0, rank: int = 0,
                 world_size: int = 1, random: bool = True, documents: bool = False, segments: bool = False):
        if shards.tokens < seq_len + 1:
            raise UserError(f"split has {shards.tokens} tokens, fewer than one window of seq_len+1={seq_len + 1}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside world of {world_size}")
        if documents and not random:
            raise ValueError("document rows are a training order: random=True")
        if segments and not documents:
            raise ValueError("segment ids are document rows': documents=True")
        self.shards, self.batch_size, self.seq_len = shards, batch_size, seq_len
        self.seed, self.rank, self.world_size, self.random = seed, rank, world_size, random
        self.documents, self.segments = documents, segments
        self.pieces = document_pieces(shards, seq_len + 1) if documents else None
        self.step = 0
        # Memos of pure functions of (seed, epoch): where each epoch starts in the stream of windows (or rows),
        # and the offset and order (or the packed rows) of the last epoch read: a permutation costs O(windows),
        # so it is not redrawn per step.
        self._epoch_starts = [0]
        self._order: tuple[int, int, np.ndarray] | None = None
        self._packed: tuple[int, list[np.ndarray]] | None = None

    def __iter__(self):
        return self

    def __next__(self) -> tuple[torch.Tensor, ...]:
        if self.documents:
            return self._document_batch()
        starts = self._starts(self.step)
        if len(starts) == 0:
            raise StopIteration
        self.step += 1
        rows = np.stack([self.shards.read(int(s), self.seq_len + 1) for s in starts])
        rows = torch.from_numpy(rows)
        return rows[:, :-1], rows[:, 1:]

    def _document_batch(self) -> tuple[torch.Tensor, ...]:
        """The step's document rows: pieces laid end to end, then end-of-text tokens read with target -100; with
        `segments`, each input token's piece number in its row (the padding's one past the last piece)."""
        B, T = self.batch_size, self.seq_len
        first = self.step * B * self.world_size + self.rank * B
        self.step += 1
        starts, lengths = self.pieces
        x = np.full((B, T), self.shards.eot_id, dtype=np.int64)
        y = np.full((B, T), IGNORE, dtype=np.int64)
        segments = np.zeros((B, T), dtype=np.int64)
        for b, pieces in enumerate(self._document_rows(np.arange(first, first + B))):
            tokens = np.concatenate([self.shards.read(int(starts[i]), int(lengths[i])) for i in pieces])
            x[b, :len(tokens) - 1], y[b, :len(tokens) - 1] = tokens[:-1], tokens[1:]
            segments[b] = np.repeat(np.arange(len(pieces) + 1), [*lengths[pieces], T + 1])[:T]
        batch = torch.from_numpy(x), torch.from_numpy(y)
        return (*batch, torch.from_numpy(segments)) if self.segments else batch

    def _packed_epoch(self, epoch: int) -> list[np.ndarray]:
        if self._packed is None or self._packed[0] != epoch:
            rng = np.random.default_rng([self.seed, epoch])
            lengths = self.pieces[1]
            rows = pack_rows(lengths, self.seq_len + 1, rng.permutation(len(lengths)))
            self._packed = (epoch, [rows[i] for i in rng.permutation(len(rows))])
        return self._packed[1]

    def _document_rows(self, positions: np.ndarray) -> list[np.ndarray]:
        """The pieces of the rows at `positions` in the stream of epoch 0's rows, then epoch 1's, ..."""
        while self._epoch_starts[-1] <= positions[-1]:
            self._epoch_starts.append(self._epoch_starts[-1] + len(self._packed_epoch(len(self._epoch_starts) - 1)))
        bounds = np.array(self._epoch_starts)
        epochs = np.searchsorted(bounds, positions, side="right") - 1
        return [self._packed_epoch(int(e))[int(p - bounds[e])] for p, e in zip(positions, epochs)]

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
                "world_size": self.world_size, "random": self.random, "tokenizer_sha256": self.shards.tokenizer_sha256,
                **({"documents": True} if self.documents else {})}

    def load_state_dict(self, state: dict) -> None:
        mine = self.state_dict()
        if state.get("documents", False) != self.documents:
            raise UserError(f"resume state: data loader documents={state.get('documents', False)!r}, this run has "
                            f"{self.documents!r}")
        for key in ("seed", "seq_len", "random", "tokenizer_sha256"):
            if state.get(key) != mine[key]:
                raise UserError(f"resume state: data loader {key}={state.get(key)!r}, this run has {mine[key]!r}")
        rows_then = int(state["batch_size"]) * int(state["world_size"])
        self.step = int(state["step"]) * rows_then // (self.batch_size * self.world_size)
