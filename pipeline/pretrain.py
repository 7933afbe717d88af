"""Stage `pretrain`: token shards -> `data/models/base/` (weights, config, tokenizer hash) + metrics + curves.

Resume is automatic: checkpoints live in `data/checkpoints/pretrain/` (a DVC `persist: true` output), and a
rerun with the same params continues from the newest one instead of starting again.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import torch

from model import GPT, ModelConfig, save_model
from pipeline.checkpoints import Checkpoints
from pipeline.curves import plot_png
from pipeline.errors import UserError
from pipeline.files import sha256_file, write_metrics
from pipeline.loader import ShardSet, TokenBatches
from pipeline.params import ModelParams, TrainParams
from pipeline.progress import console
from pipeline.throughput import peak_flops
from pipeline.tokenizer import load_tokenizer, token_bytes
from pipeline.train import Run, autocast, check_kernels, pick_device, setup_precision, train

MODEL_DIR = Path("data/models/base")
CHECKPOINT_DIR = Path("data/checkpoints/pretrain")
CURVES_DIR = Path("metrics/pretrain")
PANELS = [["loss", "val_loss"], ["val_bpb"], ["lr"], ["grad_norm"], ["tokens_per_s"]]
# Params that change the cadence of logging and saving, or only how the same math is computed (device,
# compile, kernels), not what is trained: not part of the run's identity, so a run may resume across them.
CADENCE = ("eval_every", "eval_tokens", "checkpoint_every", "keep_checkpoints", "log_every", "device", "compile",
           "kernels")


def lm_loss(model, batch):
    x, y = batch
    return model(x, y)


def byte_lengths(tokenizer_path: Path) -> torch.Tensor:
    """UTF-8 bytes each token stands for; special tokens count 0 and are left out of bits-per-byte."""
    tok = load_tokenizer(tokenizer_path)
    specials = set(tok.get_added_tokens_decoder())
    return torch.tensor([0 if i in specials else len(token_bytes(tok, i)) for i in range(tok.get_vocab_size())])


@torch.no_grad()
def evaluate_lm(model, shards: ShardSet, bytes_per_token: torch.Tensor, batch_size: int, seq_len: int,
                max_tokens: int, precision: str) -> dict:
    """Loss over every target token; bpb = nats over non-special targets / (ln 2 * their UTF-8 bytes)."""
    model.eval()
    device = next(model.parameters()).device
    lengths = bytes_per_token.to(device)
    batches = TokenBatches(shards, batch_size, seq_len, random=False)
    nats = torch.zeros((), dtype=torch.float64, device=device)
    text_nats = torch.zeros_like(nats)
    n_tokens = n_bytes = 0
    for _, (x, y) in zip(range(math.ceil(max_tokens / (batch_size * seq_len))), batches):
        x, y = x.to(device), y.to(device)
        with autocast(device, precision):
            losses = model(x, y, reduction="none").double()
        b = lengths[y]
        nats += losses.sum()
        text_nats += (losses * (b > 0)).sum()
        n_tokens += y.numel()
        n_bytes += int(b.sum())
    return {"val_loss": (nats / n_tokens).item(), "val_bpb": (text_nats / (math.log(2) * n_bytes)).item()}


def pretrain(model_params: ModelParams, params: TrainParams, shards_dir: Path, tokenizer_path: Path,
             out_dir: Path = MODEL_DIR, checkpoint_dir: Path = CHECKPOINT_DIR) -> dict:
    tokenizer_sha = sha256_file(tokenizer_path) if tokenizer_path.is_file() else None
    if tokenizer_sha is None:
        raise UserError(f"{tokenizer_path}: tokenizer not found (run `kiln tokenizer train` first)")
    train_shards = ShardSet(shards_dir, "train", tokenizer_sha256=tokenizer_sha)
    val_shards = ShardSet(shards_dir, "val", tokenizer_sha256=tokenizer_sha)
    config = ModelConfig(vocab_size=train_shards.vocab_size, **dataclasses.asdict(model_params))
    seq_len = config.max_seq_len
    torch.manual_seed(params.seed)
    device = pick_device(params.device)
    setup_precision(device, params.precision)
    check_kernels(params.kernels, device, "params: train.kernels")
    model = GPT(config).to(device).set_kernels(params.kernels)
    micro = params.batch_size * seq_len
    if params.max_steps is not None:
        total_steps = params.max_steps
    else:
        total_steps = max(1, params.tokens // params.batch_tokens)
    fingerprint = {"model": config.to_dict(), "tokenizer_sha256": tokenizer_sha,
                   "train": {k: v for k, v in dataclasses.asdict(params).items() if k not in CADENCE}}
    bytes_per_token = byte_lengths(tokenizer_path)
    run = Run(
        params=params, total_steps=total_steps, micro_batch_tokens=micro, loss_fn=lm_loss,
        batches=TokenBatches(train_shards, params.batch_size, seq_len, seed=params.seed),
        evaluate=lambda m: evaluate_lm(m, val_shards, bytes_per_token, params.batch_size, seq_len,
                                       params.eval_tokens, params.precision),
        checkpoints=Checkpoints(checkpoint_dir, fingerprint, params.keep_checkpoints),
        curves_dir=CURVES_DIR, flops_per_token=model.flops_per_token(seq_len), name="pretrain",
    )
    n_params = model.num_params()
    console.print(f"pretrain: {config.arch} {n_params / 1e6:.2f}M params "
                  f"({model.num_params(embeddings=False) / 1e6:.2f}M non-embedding), {total_steps} steps x "
                  f"{params.batch_tokens} tokens on {device} in {params.precision}", highlight=False)
    result = train(model, run)
    _, peak_source = peak_flops(device, params.precision)
    save_model(model, config, out_dir, {"tokenizer_sha256": tokenizer_sha, "mfu_peak_source": peak_source})
    unigram = unigram_entropy(train_shards)
    console.print(f"pretrain: val loss {result.get('val_loss', float('nan')):.4f} nats/token vs the corpus's "
                  f"unigram entropy {unigram:.4f}", highlight=False)
    metrics = {**result, "params": n_params, "unigram_entropy": round(unigram, 5)}
    plot_png(CURVES_DIR, CURVES_DIR / "curves.png", PANELS,
             f"pretrain: {config.arch} {n_params / 1e6:.2f}M params, {result['tokens']:,} tokens")
    write_metrics("pretrain", metrics)
    return metrics


def unigram_entropy(shards: ShardSet) -> float:
    """Entropy (nats/token) of the train split's token frequencies: the loss of a model that ignores context."""
    counts = torch.zeros(shards.vocab_size, dtype=torch.float64)
    for array in shards.arrays:
        counts += torch.bincount(torch.from_numpy(array.astype("int64")), minlength=shards.vocab_size).double()
    p = counts[counts > 0] / counts.sum()
    return float(-(p * p.log()).sum())
