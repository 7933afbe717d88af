"""The paged KV cache's memory and the attention of one engine step over it.

Memory: keys and values of every layer in one pool of blocks, (n_layer, num_blocks, block_size, n_kv_head,
head_dim) each, allocated once; `blocks.BlockPool` decides which block belongs to whom. A step runs a flat
batch: the new tokens of several sequences side by side in one (1, N) row, each sequence a segment with its
block table, the position its new tokens start at and how many there are (one for a decode, a chunk of the
prompt for a prefill). The model asks the cache for the tokens' positions (for RoPE and learned position
embeddings) and hands it each layer's queries, keys and values (`attend`): the cache writes the new keys and
values into their slots, then each segment attends to its own sequence's cached tokens, causally.

Decode segments (one token) go to the paged decode kernel (`kernels/paged_attention.py`) in one launch on a
GPU; on the torch path (a CPU) they gather their contexts, found once a step for every layer, and run one SDPA
call, or, when many share leading blocks (GRPO's groups, a request's `n`), score each shared prefix once for
its group (serve/shared_prefix.py). Prefill segments gather their context from the blocks and run SDPA with
the causal diagonal aligned bottom-right (the chunk's first query sees every token before it), all of a step's
prefills in one padded batch when padding costs less than the calls it saves. Both read the pool through the
block tables, so a prefix shared with another request is read where it lies. Every index a step needs crosses
to the device in one copy (`transfer.py`).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F

from kiln.kernels.backend import use_triton
from kiln.kernels.paged_attention import paged_attention
from kiln.model.config import ModelConfig
from kiln.model.paged import PagedCache
from kiln.pipeline.serve import shared_prefix
from kiln.pipeline.serve.input_batch import slots_of
from kiln.pipeline.serve.transfer import HostToDevice

EVERY_ROW = slice(None)  # a decode step's `logit_rows`: the model reads every row's logits, a view of them all


class Segment(NamedTuple):
    """One sequence's share of a step: `count` new tokens at positions [start, start + count), in `table`, of
    which the last `logits` get logits (more than one when a speculative draft is verified). A named tuple: a step
    makes one per running sequence."""

    table: list[int]
    start: int
    count: int
    logits: int = 1


class PagedKVCache(PagedCache):
    """Keys and values for `num_blocks` blocks of `block_size` tokens, every layer, and the step being run."""

    def __init__(self, config: ModelConfig, num_blocks: int, block_size: int, device=None, dtype=None,
                 backend: str = "auto", step_tokens: int = 256, cascade: bool = True):
        # one block more than the pool hands out: the scratch block, where a CUDA graph's padding rows write
        shape = (config.n_layer, num_blocks + 1, block_size, config.n_kv_head, config.head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.block_size, self.backend, self.scratch = block_size, backend, num_blocks
        self.max_blocks = -(-config.max_seq_len // block_size)  # the longest table a sequence can have
        self.triton = use_triton(backend, self.k)  # decodes by the paged kernel, else gathered for SDPA
        # the torch path's cascade attention for decodes that share leading blocks (serve/shared_prefix.py); off,
        # every decode gathers its whole context (vLLM's disable_cascade_attn: the same attention, summed in
        # another order)
        self.cascade = cascade and not self.triton
        self.shared: dict[str, torch.Tensor] | None = None  # the step's shared-prefix groups (torch path)
        # room for most steps of `step_tokens` new tokens (ids, positions, slots, logit rows, block tables,
        # prefill contexts); one that needs more grows it
        self.transfer = HostToDevice(self.k.device, 8 * step_tokens + 4 * config.max_seq_len + num_blocks)

    @property
    def device(self) -> torch.device:
        return self.k.device

    def bytes_per_block(self) -> int:
        return 2 * self.k[:, 0].numel() * self.k.element_size()

    def copy_blocks(self, copies: list[tuple[int, int, int]]) -> None:
        """Copy blocks' first `filled` slots, every layer's keys and values, source to destination: the partly
        filled last blocks that forked requests take over (`BlockPool.fork`); each fork writes the rest itself
        before anything reads it, so the empty slots are not copied."""
        B = self.block_size
        filled = np.array([f for _, _, f in copies])
        offsets = np.arange(filled.sum()) - np.repeat(np.cumsum(filled) - filled, filled)  # 0..filled-1 per copy
        source, copy = (torch.from_numpy(np.repeat(np.array(blocks) * B, filled) + offsets).to(self.device)
                        for blocks in list(zip(*copies))[:2])
        # index_select and index_copy_ rather than indexing: several times faster on a CPU (a GRPO step forks
        # hundreds of samples)
        for pool in (self.k, self.v):
            flat = pool.view(pool.size(0), -1, *pool.shape[3:])
            flat.index_copy_(1, copy, flat.index_select(1, source))

    def begin(self, segments: list[Segment], extra: dict[str, np.ndarray] | None = None,
              pad_to: int = 0) -> dict[str, torch.Tensor]:
        """Set the step's segments: the model's next forward runs their new tokens, in this order. Every index
        the step needs, with the caller's `extra` arrays (token ids, sampling settings), crosses to the device
        in one copy; the extra arrays come back as device tensors. `pad_to` (decodes only): the arrays hold
        that many rows, the ones past the segments decoding one token into the scratch block, and the block
        tables `max_blocks` columns, the fixed shapes a CUDA graph replays (the caller pads its ids)."""
        for s in segments:
            if s.count < 1 or not 1 <= s.logits <= s.count or len(s.table) * self.block_size < s.start + s.count:
                raise ValueError(f"segment at {s.start} + {s.count} tokens does not fit its {len(s.table)} blocks")
        n, width = len(segments), max((len(s.table) for s in segments), default=0)
        tables = np.array([s.table + [0] * (width - len(s.table)) for s in segments], dtype=np.int64).reshape(n, width)
        return self.begin_rows(np.fromiter((s.start for s in segments), np.int64, n),
                               np.fromiter((s.count for s in segments), np.int64, n),
                               np.fromiter((s.logits for s in segments), np.int64, n), tables, extra, pad_to)

    def begin_rows(self, starts: np.ndarray, counts: np.ndarray, logits: np.ndarray, tables: np.ndarray,
                   extra: dict[str, np.ndarray] | None = None, pad_to: int = 0) -> dict[str, torch.Tensor]:
        """`begin` from arrays, one row a segment: its first position, token count and logits rows, and its block
        table (zero-padded; each must hold its segment, as the caller has checked), with no Segment per row
        (the model runner keeps its rows so: serve/input_batch.py)."""
        n = len(starts)
        decodes = np.flatnonzero(counts == 1)
        if len(decodes) == n:  # decodes only, the common step
            return self.begin_decodes(starts, tables, extra, pad_to)
        if pad_to:
            raise ValueError(f"pad_to={pad_to}: expected decodes only, at most that many")
        offsets = np.concatenate([[0], np.cumsum(counts)])
        self.offsets = offsets.tolist()  # where each segment starts in the flat batch
        self.prefills = np.flatnonzero(counts > 1).tolist()
        # every new token's segment and position, then its pool slot, without a Python pass per token
        owner = np.repeat(np.arange(n), counts)
        positions = np.arange(offsets[-1]) - offsets[owner] + starts[owner]
        # each segment's last `logits` new tokens: the model returns logits for these rows only
        firsts = np.cumsum(logits) - logits
        host = {
            "positions": positions,
            "slots": slots_of(tables[owner], positions, self.block_size),
            "decode_rows": offsets[decodes],
            "decode_tables": tables[decodes],
            "decode_lens": starts[decodes] + 1,
            "logit_rows": np.repeat(offsets[1:] - logits - firsts, logits) + np.arange(logits.sum()),
        }
        host |= self._shared(tables[decodes], starts[decodes] + 1)
        prefills = np.array(self.prefills, dtype=np.int64)
        ends = starts[prefills] + counts[prefills]
        host |= self._prefill_indices(tables[prefills], starts[prefills], counts[prefills], offsets[prefills])
        on_device = self._upload(host, extra)
        self.decode_rows = on_device["decode_rows"]
        self.prefill_ends, self.prefill_masks = ends.tolist(), None  # the masks: made at the first layer
        self.longest_decode = int(starts[decodes].max()) + 1 if len(decodes) else 0
        return {name: on_device[name] for name in extra or {}}

    def begin_decodes(self, starts: np.ndarray, tables: np.ndarray, extra: dict[str, np.ndarray] | None = None,
                      pad_to: int = 0) -> dict[str, torch.Tensor]:
        """`begin` for a step of decodes only (one token each, every row gets logits): row i feeds position
        starts[i] of the sequence whose block table is tables[i] (zero-padded), with no Segment per row."""
        n = len(starts)
        self.longest_decode = int(starts.max()) + 1 if n else 0
        if self.longest_decode > tables.shape[1] * self.block_size:
            raise ValueError(f"a decode at position {self.longest_decode - 1} does not fit {tables.shape[1]} blocks")
        if pad_to and pad_to < n:
            raise ValueError(f"pad_to={pad_to}: expected decodes only, at most that many")
        self.prefills, self.batched = [], False
        if pad_to:
            starts = np.pad(starts, (0, pad_to - n))
            tables = np.pad(tables, ((0, pad_to - n), (0, self.max_blocks - tables.shape[1])),
                            constant_values=self.scratch)
        lens = starts + 1
        host = {"positions": starts, "decode_tables": tables, "decode_lens": lens,
                "slots": slots_of(tables, starts, self.block_size)}
        if not pad_to:
            host |= self._shared(tables, lens)
        on_device = self._upload(host, extra)
        self.decode_rows = None  # None: every row is a decode
        self.logit_rows = EVERY_ROW
        return {name: on_device[name] for name in extra or {}}

    def decode_arrays(self) -> dict[str, torch.Tensor]:
        """The begun decode-only step's device arrays, by the names a CUDA graph's static buffers have
        (serve/graphs.py)."""
        return {"positions": self.positions, "slots": self.slots, "decode_tables": self.decode_tables,
                "decode_lens": self.decode_lens}

    def bind_decodes(self, arrays: dict[str, torch.Tensor]) -> None:
        """Make the step a decode-only one over these device arrays (`decode_arrays`' names): a CUDA graph's
        static buffers, which its replays refill. Every row is a decode and gets logits."""
        self.positions, self.slots = arrays["positions"], arrays["slots"]
        self.decode_tables, self.decode_lens = arrays["decode_tables"], arrays["decode_lens"]
        self.decode_rows, self.logit_rows = None, EVERY_ROW

    def _shared(self, tables: np.ndarray, lens: np.ndarray) -> dict[str, np.ndarray]:
        """The torch path's groups of decodes that share leading blocks (serve/shared_prefix.py), to upload with
        the step's indices under a `shared_` prefix; none on the paged kernel, with the cascade off, or when
        sharing saves too little."""
        found = shared_prefix.plan(tables, lens, self.block_size) if self.cascade else None
        return {f"shared_{name}": a for name, a in (found or {}).items()}

    def _upload(self, host: dict[str, np.ndarray], extra: dict[str, np.ndarray] | None) -> dict[str, torch.Tensor]:
        """The step's indices and the caller's arrays to the device in one copy; the indices kept as attributes
        (the shared-prefix groups' in `shared`, None without)."""
        extra = extra or {}
        if not extra.keys().isdisjoint(host):
            raise ValueError(f"extra arrays {sorted(set(extra) & set(host))}: names the cache uses")
        on_device = self.transfer.upload(host | extra)
        self.shared = {name[7:]: on_device[name] for name in host if name.startswith("shared_")} or None
        for name in host:
            if not name.startswith("shared_"):
                setattr(self, name, on_device[name])
        self.decode_context = None  # the torch path's decode contexts, found at the first layer (device work)
        return on_device

    def _prefill_indices(self, tables: np.ndarray, starts: np.ndarray, counts: np.ndarray,
                         firsts: np.ndarray) -> dict[str, np.ndarray]:
        """How the prefills (their block tables, first positions, token counts and first rows in the flat batch)
        attend. Several of them, padded to one batch, run one attention call per layer instead of one each (the
        many short chunks of requests that share a cached prompt, GRPO's groups): each row's context slots
        (padded with its first, which the causal mask hides), its queries' rows in the flat batch and their
        positions (padded with its first), and which padded queries are real. When padding would more than
        double the work (one long chunk among short ones), each prefill runs on its own."""
        P, ends = len(counts), starts + counts
        queries, width = int(counts.max()), int(ends.max())
        self.batched = P > 1 and P * queries <= 2 * counts.sum() + 64 and P * width <= 2 * ends.sum() + 256
        # each prefill's context, positions 0..end - 1, as pool slots; past its end, position 0's
        grid = np.arange(width)[None, :]
        inside = grid < ends[:, None]
        context = slots_of(tables[:, None, :], np.where(inside, grid, 0), self.block_size)
        if not self.batched:
            return {"context_slots": context[inside]}  # row after row: each prefill's context in turn
        grid = np.minimum(np.arange(queries)[None, :], counts[:, None] - 1)  # padding repeats the last
        real = (np.arange(queries)[None, :] < counts[:, None]).reshape(-1)
        rows = firsts[:, None] + grid
        return {"prefill_context": context, "prefill_rows": rows,
                "prefill_positions": starts[:, None] + grid,
                "prefill_real": np.flatnonzero(real), "prefill_real_rows": rows.reshape(-1)[real]}

    def _decode_context(self, longest: int) -> None:
        """The pool slots of each decode's whole context, (decodes, longest), from its block table and length, a
        shorter one padded with its last slot and masked out (a slot outside every context may hold anything, NaN
        included, which a zero weight would not hide): the torch path gathers keys and values with them, found
        once a step for every layer. One decode sees its whole context: no mask (SDPA's fast path on a CPU)."""
        positions = torch.minimum(torch.arange(longest, device=self.device), self.decode_lens[:, None] - 1)
        self.decode_context = self.decode_tables.gather(1, positions // self.block_size) * self.block_size \
            + positions % self.block_size
        self.decode_mask = None if len(self.decode_lens) == 1 else \
            (torch.arange(longest, device=self.device) < self.decode_lens[:, None])[:, None, None]

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q (1, H, N, D), k and v (1, H_kv, N, D) of the step's new tokens, rotated: store k and v, return the
        attention output (1, H, N, D)."""
        H, H_kv, D = q.size(1), k.size(1), q.size(3)
        flat_k, flat_v = self.k[layer].view(-1, H_kv, D), self.v[layer].view(-1, H_kv, D)
        # index_copy_ and index_select rather than indexing: several times faster on a CPU
        flat_k.index_copy_(0, self.slots, k[0].transpose(0, 1).to(flat_k.dtype))
        flat_v.index_copy_(0, self.slots, v[0].transpose(0, 1).to(flat_v.dtype))
        if self.decode_rows is None:  # decodes only
            return self._decode(q[0].transpose(0, 1), layer).transpose(0, 1)[None]
        out = torch.empty_like(q[0].transpose(0, 1))  # (N, H, D)
        if len(self.decode_rows):
            out[self.decode_rows] = self._decode(q[0].transpose(0, 1)[self.decode_rows], layer)
        if self.prefill_masks is None:
            self._prefill_masks()
        if self.batched:
            P, queries = self.prefill_rows.shape
            y = F.scaled_dot_product_attention(q[0].transpose(0, 1)[self.prefill_rows].transpose(1, 2),
                                               *self._gather(layer, self.prefill_context, H, q.dtype),
                                               attn_mask=self.prefill_masks[0])  # (P, H, queries, D)
            out[self.prefill_real_rows] = y.transpose(1, 2).reshape(P * queries, H, D)[self.prefill_real]
            return out.transpose(0, 1)[None]
        for i, slots, mask in zip(self.prefills, self.prefill_slots, self.prefill_masks):
            first, count = self.offsets[i], self.offsets[i + 1] - self.offsets[i]
            y = F.scaled_dot_product_attention(q[:, :, first:first + count],
                                               *self._gather(layer, slots[None], H, q.dtype), attn_mask=mask)
            out[first:first + count] = y[0].transpose(0, 1)
        return out.transpose(0, 1)[None]

    def _prefill_masks(self) -> None:
        """The prefills' causal masks, shared by every layer: query i of a prefill is token start + i and sees
        every key up to and including itself. Made at the first layer, as the decodes' contexts are: device work
        (a GRPO step's padded batch of prefills is a mask of a few hundred thousand entries)."""
        if self.batched:
            width = self.prefill_context.size(1)
            self.prefill_masks = [(torch.arange(width, device=self.device) <= self.prefill_positions[:, :, None])
                                  [:, None]]
            return
        self.prefill_slots = self.context_slots.split(self.prefill_ends)
        self.prefill_masks = [self.positions[self.offsets[i]:self.offsets[i + 1], None] >= torch.arange(
            end, device=self.device)[None, :] for i, end in zip(self.prefills, self.prefill_ends)]

    def _decode(self, queries: torch.Tensor, layer: int) -> torch.Tensor:
        """Attention of the decodes' queries (S, H, D) over their contexts: the paged kernel reads the blocks in
        place; the torch path gathers each context (the step's slots, found once for every layer) and runs SDPA,
        fewer small ops a layer than the kernel's reference, which is what a CPU step spends its time on."""
        if self.triton:
            return paged_attention(queries, self.k[layer].to(queries.dtype), self.v[layer].to(queries.dtype),
                                   self.decode_tables, self.decode_lens, backend="triton")
        if self.shared is not None:
            H_kv, D = self.k.size(3), self.k.size(4)
            return shared_prefix.attend(queries, self.k[layer].view(-1, H_kv, D), self.v[layer].view(-1, H_kv, D),
                                        self.shared)
        if self.decode_context is None:
            self._decode_context(self.longest_decode)
        keys, values = self._gather(layer, self.decode_context, queries.size(1), queries.dtype)
        return F.scaled_dot_product_attention(queries[:, :, None], keys, values, attn_mask=self.decode_mask)[:, :, 0]

    def _gather(self, layer: int, slots: torch.Tensor, heads: int, dtype: torch.dtype):
        """Keys and values of layer `layer` at pool slots (B, L), as (B, heads, L, D) in `dtype`: the kv heads
        repeated for their query heads under GQA."""
        H_kv, D = self.k.size(3), self.k.size(4)
        keys = self.k[layer].view(-1, H_kv, D).index_select(0, slots.view(-1)).view(*slots.shape, H_kv, D)
        values = self.v[layer].view(-1, H_kv, D).index_select(0, slots.view(-1)).view(*slots.shape, H_kv, D)
        keys, values = keys.transpose(1, 2).to(dtype), values.transpose(1, 2).to(dtype)
        if heads != H_kv:
            keys, values = keys.repeat_interleave(heads // H_kv, dim=1), values.repeat_interleave(heads // H_kv, dim=1)
        return keys, values
