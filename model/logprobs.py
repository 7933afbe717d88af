"""Per-token log-probabilities of given targets under the LM head, a chunk of tokens at a time.

Post-training and evaluation need, for each position, log p(target) (SFT, DPO and GRPO losses, every
multiple-choice score), and sometimes the entropy of the distribution (GRPO's metric) and whether the target is
the argmax (greedy match in evaluation). Computing them from full logits keeps a (tokens x vocab) tensor, its
float32 copy and its log-softmax alive at once: at 4k tokens and a 50k vocabulary that is 2.4 GB, more than a
small model's activations. Here the head runs on CHUNK_ELEMENTS / vocab rows at a time. The bound is on the
chunk's elements rather than on rows (the Triton loss's 4·D rows), because 4·D rows leave a short batch whole:
1,024 tokens at D = 768 would be one (tokens x vocab) chunk. With gradients, each chunk is wrapped in
`torch.utils.checkpoint` (non-reentrant): the forward keeps only its inputs (a view of the hidden states and the
head weight, which exist anyway), and backward recomputes one chunk's logits at a time. That costs a second head
matmul in backward, against the logits that would otherwise be stored; it is plain autograd, so any head (a
dequantised NF4 weight, a LoRA-adapted one), autocast (restored for the recomputation) and `torch.compile` work
unchanged, where a hand-written autograd.Function would write each chunk's backward and dtype casts itself. (The
Triton loss, kernels/linear_cross_entropy.py, chunks the same way with its own kernel.)

Log-softmax is taken in at least float32 whatever the matmul's dtype, as before: over a large vocabulary bf16
loses too much (a float64 model keeps float64). Positions whose target is -100 get log-probability 0, entropy 0
and no hit, and the head never runs on them: post-training scores completions, a small share of each row (GRPO's
16 answer tokens after a passage of a hundred), so the head's work, the largest matmul of a small model, shrinks
with it (TRL's `logits_to_keep` does the same). Finding them reads the targets on the host (a sync on a GPU);
under `torch.compile`, whose graphs want fixed shapes, every position is computed.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch.utils.checkpoint import checkpoint

IGNORE = -100
CHUNK_ELEMENTS = 2**24  # logits per chunk: 64 MB in float32, e.g. 333 rows of GPT-2's 50k vocabulary


class TokenStats(NamedTuple):
    logp: torch.Tensor  # log p(target), 0 where ignored
    entropy: torch.Tensor  # of softmax(logits / temperature)
    hit: torch.Tensor  # the target is the argmax (bool), False where ignored


def chunk_rows(n_tokens: int, vocab: int) -> int:
    return max(1, min(n_tokens, CHUNK_ELEMENTS // vocab))


def softcap(logits: torch.Tensor, cap: float) -> torch.Tensor:
    """cap * tanh(logits / cap) (the model's `logit_softcap`)."""
    return cap * torch.tanh(logits / cap)


def _chunk(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temperature: float,
           stats: bool, vocab_size: int, cap: float) -> tuple[torch.Tensor, ...]:
    # the GEMM over every row of the (padded) weight, so its output rows stay 16-byte aligned for cuBLAS; the
    # padding columns are cut from the logits after it (a view), never softmaxed
    logits = (hidden @ weight.T)[:, :vocab_size]
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    logp = torch.log_softmax((softcap(logits, cap) if cap else logits) / temperature, dim=-1)
    scored = targets != IGNORE
    picked = logp.gather(-1, targets.clamp(min=0)[:, None])[:, 0] * scored
    if not stats:
        return (picked,)
    entropy = -(logp.exp() * logp).sum(dim=-1) * scored
    return picked, entropy, (logp.argmax(dim=-1) == targets)


def token_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0,
                   stats: bool = False, chunk_size: int | None = None,
                   vocab_size: int | None = None, softcap: float = 0.0) -> torch.Tensor | TokenStats:
    """hidden (N, D), weight (V, D), targets (N,): log p(target) (N,) in float32 (or wider), or with `stats` the
    TokenStats (logp, entropy, hit), computed `chunk_size` tokens at a time (default `chunk_rows`). `vocab_size`:
    the classes are the weight's first rows only (the rest is padding, which keeps the GEMM aligned); `softcap`
    > 0: the logits capped so (`softcap`), in float32, before the temperature."""
    vocab_size = weight.shape[0] if vocab_size is None else vocab_size
    n = hidden.shape[0]
    kept = None
    if not torch.compiler.is_compiling():
        kept = (targets != IGNORE).nonzero()[:, 0]
        if len(kept) in (0, n):
            kept = None  # nothing ignored (no gather, no scatter), or everything (computed, so a loss over it
            # still has a graph to run backward through)
        else:
            hidden, targets = hidden.index_select(0, kept), targets.index_select(0, kept)
    rows = hidden.shape[0]
    size = chunk_size or chunk_rows(rows, weight.shape[0])
    grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    parts = []
    for start in range(0, rows, size):
        args = (hidden[start:start + size], weight, targets[start:start + size], temperature, stats, vocab_size,
                softcap)
        parts.append(checkpoint(_chunk, *args, use_reentrant=False) if grad else _chunk(*args))
    if not parts:
        empty = hidden.new_zeros(0, dtype=torch.promote_types(hidden.dtype, torch.float32))
        return TokenStats(empty, empty, empty.bool()) if stats else empty
    columns = [torch.cat(column) for column in zip(*parts)]
    if kept is not None:  # the ignored positions back in: 0, 0, False
        columns = [c.new_zeros(n).index_copy(0, kept, c) for c in columns]
    return TokenStats(*columns) if stats else columns[0]
