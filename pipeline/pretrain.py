"""Stage `pretrain`: token shards -> `data/models/base/` (weights, config, tokenizer hash) + metrics + curves.

Resume is automatic: checkpoints live in `data/checkpoints/pretrain/` (a DVC `persist: true` output), and a
rerun with the same params continues from the newest one instead of starting again.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
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
from pipeline.scaling_size import SHAPE_KEYS, SIZE_FILE, auto_size, describe
from pipeline.throughput import peak_flops
from pipeline.tokenizer import load_tokenizer, token_bytes
from pipeline.train import Run, autocast, prepare_device, train

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


@dataclass
class LMData:
    """Train and val shards checked against one tokenizer, and the bytes each token stands for (for bpb)."""

    train: ShardSet
    val: ShardSet
    bytes_per_token: torch.Tensor
    tokenizer_sha256: str

    @classmethod
    def load(cls, shards_dir: Path, tokenizer_path: Path) -> LMData:
        if not tokenizer_path.is_file():
            raise UserError(f"{tokenizer_path}: tokenizer not found (run `kiln tokenizer train` first)")
        sha = sha256_file(tokenizer_path)
        return cls(ShardSet(shards_dir, "train", tokenizer_sha256=sha),
                   ShardSet(shards_dir, "val", tokenizer_sha256=sha), byte_lengths(tokenizer_path), sha)


def total_steps(params: TrainParams) -> int:
    return params.max_steps if params.max_steps is not None else max(1, params.tokens // params.batch_tokens)


def train_lm(config: ModelConfig, params: TrainParams, data: LMData, checkpoint_dir: Path, curves_dir: Path,
             name: str) -> tuple[GPT, dict]:
    """Next-token training of a fresh model on `data` with the one loop; the pretrain stage and every run of the
    scaling sweep go through here, so they share the data order, the schedule and the evaluation."""
    seq_len = config.max_seq_len
    torch.manual_seed(params.seed)
    device = prepare_device(params)
    model = GPT(config).to(device).set_kernels(params.kernels)
    steps = total_steps(params)
    fingerprint = {"model": config.to_dict(), "tokenizer_sha256": data.tokenizer_sha256,
                   "train": {k: v for k, v in dataclasses.asdict(params).items() if k not in CADENCE}}
    run = Run(
        params=params, total_steps=steps, micro_batch_tokens=params.batch_size * seq_len, loss_fn=lm_loss,
        batches=TokenBatches(data.train, params.batch_size, seq_len, seed=params.seed),
        evaluate=lambda m: evaluate_lm(m, data.val, data.bytes_per_token, params.batch_size, seq_len,
                                       params.eval_tokens, params.precision),
        checkpoints=Checkpoints(checkpoint_dir, fingerprint, params.keep_checkpoints),
        curves_dir=curves_dir, flops_per_token=model.flops_per_token(seq_len), name=name,
    )
    console.print(f"{name}: {config.arch} {model.num_params() / 1e6:.3g}M params "
                  f"({model.num_params(embeddings=False) / 1e6:.3g}M non-embedding), {steps} steps x "
                  f"{params.batch_tokens} tokens on {device} in {params.precision}", highlight=False)
    return model, train(model, run)


def pretrain(model_params: ModelParams, params: TrainParams, shards_dir: Path, tokenizer_path: Path,
             out_dir: Path = MODEL_DIR, checkpoint_dir: Path = CHECKPOINT_DIR, size_file: Path = SIZE_FILE) -> dict:
    data = LMData.load(shards_dir, tokenizer_path)
    size = {}
    if model_params.size == "auto":
        choice = auto_size(size_file)
        console.print(describe(choice), highlight=False)
        config = model_params.config(data.train.vocab_size, **{k: choice[k] for k in SHAPE_KEYS})
        params = dataclasses.replace(params, max_steps=None, tokens=choice["tokens"])
        size = {"size_auto": {k: choice[k] for k in ("target_flops", "n_opt", "d_opt", "predicted_loss", "n_layer",
                                                      "d_model", "tokens")}}
    else:
        config = model_params.config(data.train.vocab_size)
    model, result = train_lm(config, params, data, checkpoint_dir, CURVES_DIR, "pretrain")
    _, peak_source = peak_flops(model.tok_emb.weight.device, params.precision)
    save_model(model, config, out_dir, {"tokenizer_sha256": data.tokenizer_sha256, "mfu_peak_source": peak_source})
    unigram = unigram_entropy(data.train)
    console.print(f"pretrain: val loss {result.get('val_loss', float('nan')):.4f} nats/token vs the corpus's "
                  f"unigram entropy {unigram:.4f}", highlight=False)
    n_params = model.num_params()
    metrics = {**result, "params": n_params, "unigram_entropy": round(unigram, 5), **size}
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
