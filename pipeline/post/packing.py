"""Examples packed into rows best-fit, each attending only to itself (`sft.packing`).

Padded rows spend compute on pad positions: on chat data of mixed lengths most of a row can be pad. Packing puts
several whole examples in one row (never split), largest first, each into the fullest row it still fits (best-fit
decreasing, as nanochat's loader and TRL's packing do), and marks every token with the example it belongs to. The
model turns those ids into a block-diagonal causal mask and positions that restart at each example
(model/gpt.py `segment_mask`, `segment_positions`), so an example's tokens see exactly what they would see alone
in a padded row: the summed loss of the examples, and its gradients, equal the padded path's.

The pads after a row's last example get an id of their own: their targets are ignored and, the mask being
causal, no real token attends to them.
"""

from __future__ import annotations

import bisect

import torch

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
    rows = best_fit([len(x) for x, _, _ in tokens], seq_len)
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
