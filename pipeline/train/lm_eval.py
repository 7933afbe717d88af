"""A language model's loss on token shards, in nats per token and bits per byte: what pretraining reports at
each evaluation and what `kiln evaluate` measures every model with. Apart from the training loop, so that
evaluation reads it without importing the loop."""

from __future__ import annotations

import math
from pathlib import Path

import torch

from kiln.pipeline.runtime import SINGLE, World
from kiln.pipeline.text.loader import ShardSet, TokenBatches
from kiln.pipeline.train import distributed


def byte_lengths(tokenizer_path: Path) -> torch.Tensor:
    """UTF-8 bytes each token stands for; special tokens count 0 and are left out of bits-per-byte."""
    # here, not at the top: the benchmarks import the training loop on a GPU machine without `tokenizers`
    from kiln.pipeline.text.bpe import load_tokenizer, token_bytes

    tok = load_tokenizer(tokenizer_path)
    specials = set(tok.get_added_tokens_decoder())
    return torch.tensor([0 if i in specials else len(token_bytes(tok, i)) for i in range(tok.get_vocab_size())])


@torch.no_grad()
def evaluate_lm(model, shards: ShardSet, bytes_per_token: torch.Tensor, batch_size: int, seq_len: int,
                max_tokens: int, world: World = SINGLE) -> dict:
    """Loss over every target token, under the caller's autocast; bpb = nats over non-special targets / (ln 2 *
    their UTF-8 bytes).

    The same val prefix whatever the world size: its batches are dealt out to the ranks and the sums added up.
    Every rank runs as many forwards as the busiest one (an FSDP forward is collective); the spare ones count
    for nothing."""
    model.eval()
    device = next(model.parameters()).device
    lengths = bytes_per_token.to(device)
    batches = TokenBatches(shards, batch_size, seq_len, random=False, rank=world.rank, world_size=world.size)
    n_batches = min(math.ceil(max_tokens / (batch_size * seq_len)),
                    math.ceil((shards.tokens - 1) // seq_len / batch_size))
    sums = torch.zeros(4, dtype=torch.float64, device=device)  # nats, text nats, tokens, bytes
    for i in range(math.ceil(n_batches / world.size)):
        mine = i * world.size + world.rank < n_batches
        if mine or i == 0:  # a rank left without a batch forwards the split's first one
            x, y = (t.to(device) for t in next(batches if mine else TokenBatches(shards, batch_size, seq_len,
                                                                                 random=False)))
        losses = model(x, y, reduction="none").double()
        if mine:
            b = lengths[y]
            sums += torch.stack([losses.sum(), (losses * (b > 0)).sum(), losses.new_tensor(y.numel()),
                                 b.sum().double()])
    nats, text_nats, n_tokens, n_bytes = distributed.total(sums).tolist()
    return {"val_loss": nats / n_tokens, "val_bpb": text_nats / (math.log(2) * n_bytes)}
