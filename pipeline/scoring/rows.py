"""Examples as token rows, and the layouts a forward runs them in: padded (one a row, the reference), packed
best-fit (`sft.packing`), and answers sharing one copy of their prompt (DPO's pairs, GRPO's groups, a question's
choices).

Padded rows spend compute on pad positions: on chat data of mixed lengths most of a row can be pad. Packing puts
several whole examples in one row (never split), largest first, each into the fullest row it still fits (best-fit
decreasing, as nanochat's loader and TRL's packing do), and marks every token with the example it belongs to. The
model turns those ids into a block-diagonal causal mask and positions that restart at each example
(model/packed.py `Packed`), so an example's tokens see exactly what they would see alone
in a padded row: the summed loss of the examples, and its gradients, equal the padded path's.

The pads after a row's last example get an id of their own: their targets are ignored and, the mask being
causal, no real token attends to them.

A prompt with several answers (DPO's chosen and rejected, GRPO's group of samples) is computed once: `shared_rows`
lays it out once, then each answer, each answer attending to the prompt and itself (model/packed.py). The last
prompt token is the one that predicts an answer's first token, differently for each answer, so it is not shared:
each answer's piece starts with it.
"""

from __future__ import annotations

import bisect

import torch

from kiln.model.packed import Packed
from kiln.pipeline.progress import console
from kiln.pipeline.tasks.chat_format import Rendered

IGNORE = -100


def example_tokens(r: Rendered, seq_len: int) -> tuple[list[int], list[int], bool]:
    """An example's inputs and targets (-100 where its mask is 0), cut at seq_len + 1 tokens; and whether it was
    cut."""
    ids, mask = r.ids[:seq_len + 1], r.mask[:seq_len + 1]
    return ids[:-1], [t if m else IGNORE for t, m in zip(ids[1:], mask[1:])], len(r.ids) > seq_len + 1


def best_fit(lengths: list[int], capacity: int) -> list[list[int]]:
    """Indices of the items in each bin: longest first (ties in index order), each into the bin with the least room
    left that holds it, a new bin when none does. Every length is at most `capacity`."""
    bins: list[list[int]] = []
    free: list[tuple[int, int]] = []  # (room left, bin), sorted
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        at = bisect.bisect_left(free, (lengths[i], -1))
        if at == len(free):
            bins.append([i])
            bisect.insort(free, (capacity - lengths[i], len(bins) - 1))
            continue
        room, b = free.pop(at)
        bins[b].append(i)
        bisect.insort(free, (room - lengths[i], b))
    return bins


def packed_rows(rendered: list[Rendered], seq_len: int, pad: int) -> tuple[torch.Tensor, ...]:
    """(x, y, segments), (R, seq_len) each, R the rows best-fit packing needs, and how many examples were cut."""
    tokens = [example_tokens(r, seq_len) for r in rendered]
    # rows and their examples in the examples' order: where nothing shares a row, the padded rows exactly
    rows = sorted((sorted(members) for members in best_fit([len(x) for x, _, _ in tokens], seq_len)), key=min)
    x = torch.full((len(rows), seq_len), pad, dtype=torch.long)
    y = torch.full((len(rows), seq_len), IGNORE, dtype=torch.long)
    segments = torch.zeros((len(rows), seq_len), dtype=torch.long)
    for row, members in enumerate(rows):
        at = 0
        for segment, i in enumerate(members):
            inputs, targets, _ = tokens[i]
            x[row, at:at + len(inputs)] = torch.tensor(inputs)
            y[row, at:at + len(inputs)] = torch.tensor(targets)
            segments[row, at:at + len(inputs)] = segment
            at += len(inputs)
        segments[row, at:] = len(members)  # the pads: an id of their own
    return x, y, segments, sum(cut for _, _, cut in tokens)


def to_rows(rendered: list[Rendered], seq_len: int, pad: int, what: str,
            packing: bool = False) -> tuple[torch.Tensor, ...]:
    """Inputs x and targets y, (N, seq_len) each: y is x shifted by one, -100 where the mask is 0 or padded.
    Longer examples are cut at seq_len + 1 tokens (counted); an example left with no target is an error the
    caller prevents (they are dropped before this). With `packing`, whole examples share rows (fewer than N)
    and a third tensor gives each token's example (`packed_rows`)."""
    if packing:
        *rows, cut = packed_rows(rendered, seq_len, pad)
    else:
        rows = [torch.full((len(rendered), seq_len), pad, dtype=torch.long),
                torch.full((len(rendered), seq_len), IGNORE, dtype=torch.long)]
        cut = 0
        for i, r in enumerate(rendered):
            inputs, targets, was_cut = example_tokens(r, seq_len)
            cut += was_cut
            rows[0][i, :len(inputs)] = torch.tensor(inputs)
            rows[1][i, :len(inputs)] = torch.tensor(targets)
    if cut:
        console.print(f"{what}: {cut:,} of {len(rendered):,} examples cut to max_seq_len={seq_len}", highlight=False)
    return tuple(rows)


def fits(r: Rendered, seq_len: int) -> bool:
    """At least one target survives the cut to seq_len + 1 tokens."""
    return any(r.mask[1:seq_len + 1])


def shared_prefix(xs: list[list[int]], ys: list[list[int]]) -> int:
    """How many leading inputs a group's sequences can share: their common prefix, up to the first target of any
    (a shared token predicts nothing, since each sequence's prediction from it may differ)."""
    first = min((next((t for t, target in enumerate(y) if target != IGNORE), len(y)) for y in ys), default=0)
    common = min(len(x) for x in xs)
    for t in range(min(first, common)):
        if any(x[t] != xs[0][t] for x in xs[1:]):
            return t
    return min(first, common)


def separate(t: torch.Tensor, where: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """A per-token result `t` of shared rows in the separate rows' layout (`where`, from `shared_rows`), 0 where the
    separate rows' targets `y` are ignored."""
    return torch.where(y != IGNORE, t.reshape(-1)[where], torch.zeros((), dtype=t.dtype, device=t.device))


def shared_rows(x: torch.Tensor, y: torch.Tensor, groups: list[list[int]], pad: int,
                multiple: int = 1) -> tuple[torch.Tensor, torch.Tensor, Packed, torch.Tensor]:
    """Separate rows x, y (N, W), right-padded, laid out again as a row per group of them (indices): the group's
    shared prefix once, then what each row has after it up to its last target, each attending to the prefix and
    itself (`Packed.shares`), positions counting on from the prefix, then pads (each a piece of its own). A group
    of one is a row of one piece.

    Returns x, y (R, L), L the longest row rounded up to `multiple`, the layout, and `where` (N, W): the flat index
    into (R x L) of each separate row's column, so a per-token result gathered through it is in the separate
    rows' layout (a column with no target points at column 0 of row 0: mask it with y != -100). The shared
    forward computes at an answer's column what the answer's own row computes there."""
    lengths = ((y != IGNORE).cumsum(dim=1) == (y != IGNORE).sum(dim=1, keepdim=True)).int().argmax(dim=1) + 1
    xs = [row[:n].tolist() for row, n in zip(x, lengths.tolist())]
    ys = [row[:n].tolist() for row, n in zip(y, lengths.tolist())]
    pieces = [(shared_prefix([xs[i] for i in members], [ys[i] for i in members]) if len(members) > 1 else 0,
               members) for members in groups]
    length = max(f + sum(len(xs[i]) - f for i in members) for f, members in pieces)
    length = -(-length // multiple) * multiple
    out_x = torch.full((len(groups), length), pad, dtype=torch.long)
    out_y = torch.full((len(groups), length), IGNORE, dtype=torch.long)
    segments, shares = torch.zeros_like(out_x), torch.zeros_like(out_x)
    where = torch.zeros(x.shape, dtype=torch.long)
    for row, (f, members) in enumerate(pieces):
        out_x[row, :f] = torch.tensor(xs[members[0]][:f], dtype=torch.long)
        at, piece = f, int(f > 0)
        for i in members:
            n = len(xs[i]) - f
            out_x[row, at:at + n] = torch.tensor(xs[i][f:], dtype=torch.long)
            out_y[row, at:at + n] = torch.tensor(ys[i][f:], dtype=torch.long)
            segments[row, at:at + n], shares[row, at:at + n] = piece, 0 if f else piece
            where[i, f:f + n] = row * length + at + torch.arange(n)
            at, piece = at + n, piece + 1
        # each pad a piece of its own, at position 0: a short group's row may pad past max_seq_len
        segments[row, at:] = shares[row, at:] = piece + torch.arange(length - at)
    return out_x, out_y, Packed(segments, shares), where
