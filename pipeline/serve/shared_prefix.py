"""Decode attention that reads a prefix shared by several sequences once (the torch path's cascade attention).

A GRPO group's samples, a request's `n` and requests behind one cached system prompt decode side by side over
the same prompt blocks (`BlockPool` shares them by id). Gathering each sequence's whole context copies those
blocks once per sequence; on a CPU that copy and the attention reading it were half a GRPO-shaped step. Here
sequences whose block tables open with the same blocks form a group (at the depth they share: a group's
samples at their prompt, lone prompts at a system prompt): the group's queries score its shared prefix together
(one gather and one matmul for the group), each sequence scores its own remaining positions, and one softmax
runs over both parts, so the output is plain attention over the whole context (vLLM's and FlashInfer's cascade
attention split it the same way, with the shared part's queries batched).

`plan` finds the groups on the host from the step's block tables; `attend` runs on the device. A step whose
sequences share too little to repay the extra steps (`plan` returns None) keeps the plain gather.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from kiln.pipeline.serve.input_batch import slots_of

# cascade pays only when it gathers at most this share of the plain path's positions (measured on a CPU, a
# GRPO-shaped batch of 64 x 8 at each of its steps: a third of the positions took 0.35-0.5x the plain path's
# time, half of them about as long; the padded group layout's extra scores eat the rest)
WORTH = 0.5
# nor below this many decodes, where its extra small ops cost more than the copies it saves (groups of 8 sharing
# 96 of 106 positions, 4 layers, plan included, medians of 30 on a CPU: 32 rows 1.25x the plain path's time, 64
# even, 128 0.77x, 256 0.17x; GRPO's stage at the defaults decodes 32)
MIN_ROWS = 64
NO_LINK = np.iinfo(np.int64).max  # past a group's last row: no link to the next group


def plan(tables: np.ndarray, lens: np.ndarray, block_size: int) -> dict[str, np.ndarray] | None:
    """The groups of decodes (block tables `tables`, zero-padded, and context lengths `lens`) that share whole
    leading blocks, as the arrays `attend` takes; None when sharing saves too little. The arrays: `groups`
    (G, R) each group's rows (padding repeats its first), `places` (N,) each row's place in them (group x R +
    column), `prefix_slots` (G, P) the pool slots of its shared positions, `prefix_lens` (G,), `suffix_slots`
    (N, S) each row's own positions after its group's prefix, `suffix_lens` (N,); padding repeats real slots."""
    n = len(lens)
    if n < MIN_ROWS:
        return None
    # Rows sorted by their tables put rows sharing leading blocks side by side; `link` is how many whole blocks
    # each row shares with the one before it (within both rows' full blocks). A group starts where the link
    # drops below a neighbour's: samples of one prompt stay together at their prompt's depth, and prompts that
    # share only a system prompt are split, each group at its own depth, the lone ones together at the system
    # prompt's.
    order = np.lexsort(tables.T[::-1])
    ordered, sorted_lens = tables[order], lens[order]
    full = sorted_lens // block_size
    same = ordered[1:] == ordered[:-1]
    common = np.where(same.all(axis=1), same.shape[1], same.argmin(axis=1))  # leading blocks alike
    link = np.minimum(common, np.minimum(full[1:], full[:-1]))
    first = np.empty(n, bool)  # where a group starts
    first[0], first[1:] = True, link == 0
    step = link[1:] - link[:-1]
    first[2:] |= step < 0
    first[1:-1] |= step > 0
    starts = np.flatnonzero(first)
    sizes = np.append(starts[1:], n) - starts
    R = int(sizes.max())
    if R < 2:
        return None
    # each group's shared blocks: the least link inside it (a group of one: all its full blocks, its own context
    # split in two parts, so that it does not widen every row's own part)
    internal = np.append(link, NO_LINK)  # row i's link to row i + 1, but for each group's last row
    internal[starts[1:] - 1] = NO_LINK
    shared = np.where(sizes > 1, np.minimum.reduceat(internal, starts), full[starts])
    group = np.repeat(np.arange(len(starts)), sizes)  # each sorted row's
    prefix = shared * block_size
    sorted_prefix = prefix[group]
    G, P, S = len(starts), int(prefix.max()), int((sorted_lens - sorted_prefix).max())
    if G * P + n * S > WORTH * n * int(lens.max()):
        return None
    # rows: each group's in a padded row, the padding repeating its first
    column = np.arange(n) - starts[group]
    heads = order[starts]
    groups = np.repeat(heads[:, None], R, axis=1)
    groups[group, column] = order
    places = np.empty(n, np.int64)
    places[order] = group * R + column
    # a group's shared blocks, whole; past them its first slot (padding must be slots of the context: one outside
    # every context may hold anything, NaN included, which a zero weight would not hide)
    leaders = tables[heads]
    whole = (leaders[:, :P // block_size, None] * block_size + np.arange(block_size)).reshape(G, P)
    prefix_slots = np.where(np.arange(P) < prefix[:, None], whole, leaders[:, :1] * block_size)
    row_prefix = np.empty(n, np.int64)
    row_prefix[order] = sorted_prefix
    suffix_lens = lens - row_prefix
    positions = row_prefix[:, None] + np.minimum(np.arange(S), suffix_lens[:, None] - 1)  # padding: its last
    suffix_slots = slots_of(tables[:, None, :], positions, block_size)
    return {"groups": groups, "places": places, "prefix_slots": prefix_slots, "prefix_lens": prefix,
            "suffix_slots": suffix_slots, "suffix_lens": suffix_lens}


def attend(queries: torch.Tensor, k: torch.Tensor, v: torch.Tensor, on_device: dict[str, torch.Tensor]) -> torch.Tensor:
    """Attention of the decodes' queries (N, H, D) over their contexts in the pools `k` and `v` (slots, H_kv, D),
    grouped as `plan` found (its arrays on the device): (N, H, D)."""
    N, H, D = queries.shape
    H_kv = k.size(1)
    rep = H // H_kv
    groups, places = on_device["groups"], on_device["places"]
    prefix_slots, suffix_slots = on_device["prefix_slots"], on_device["suffix_slots"]
    (G, R), P, S = groups.shape, prefix_slots.size(1), suffix_slots.size(1)
    # laid out by group: (G, R, H_kv, rep, .), a group's rows (and each kv head's query heads) side by side
    q = queries.view(N, H_kv, rep, D) * (1 / math.sqrt(D))
    kp = k.index_select(0, prefix_slots.view(-1)).view(G, P, H_kv, D).to(q.dtype)
    vp = v.index_select(0, prefix_slots.view(-1)).view(G, P, H_kv, D).to(q.dtype)
    scores_p = torch.einsum("grkjd,gpkd->grkjp", q[groups.view(-1)].view(G, R, H_kv, rep, D), kp)
    scores_p = scores_p.masked_fill((torch.arange(P, device=q.device) >= on_device["prefix_lens"][:, None])
                                    [:, None, None, None], -math.inf)
    # each row's own positions, its scores moved to its place beside its group's (padding places score 0)
    ks = k.index_select(0, suffix_slots.view(-1)).view(N, S, H_kv, D).to(q.dtype)
    vs = v.index_select(0, suffix_slots.view(-1)).view(N, S, H_kv, D).to(q.dtype)
    scores_s = torch.einsum("nkjd,nskd->nkjs", q, ks)
    scores_s = scores_s.masked_fill((torch.arange(S, device=q.device) >= on_device["suffix_lens"][:, None])
                                    [:, None, None], -math.inf)
    placed = scores_s.new_zeros(G * R, H_kv, rep, S).index_copy_(0, places, scores_s).view(G, R, H_kv, rep, S)
    weights = torch.cat([scores_p, placed], dim=-1).softmax(dim=-1)  # one softmax over the whole context
    out = torch.einsum("grkjp,gpkd->grkjd", weights[..., :P], vp).reshape(G * R, H_kv, rep, D).index_select(0, places)
    own = weights[..., P:].reshape(G * R, H_kv, rep, S).index_select(0, places)
    return (out + torch.einsum("nkjs,nskd->nkjd", own, vs)).view(N, H, D)
