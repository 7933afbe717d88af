"""Stage `pretrain`: token shards -> `data/models/base/` (weights, config, tokenizer hash) + metrics + curves.

Resume is automatic: checkpoints live in `data/checkpoints/pretrain/` (git-ignored, not a DVC output, so DVC
neither removes nor caches them), and a rerun with the same params continues from the newest one instead of
starting again.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from kiln.model.checkpoint import save_model
from kiln.pipeline import layout, runtime
from kiln.pipeline.outputs import recover, write_metrics
from kiln.pipeline.progress import Progress, console
from kiln.pipeline.text.loader import ShardSet
from kiln.pipeline.train import distributed
from kiln.pipeline.train.curves import Panel, plot_png
from kiln.pipeline.train.lm import LMData, train_lm
from kiln.pipeline.train.params import ModelParams, TrainParams
from kiln.pipeline.train.size_choice import SHAPE_KEYS, auto_size, describe
from kiln.pipeline.train.throughput import peak_flops

PANELS = [Panel("loss", "cross-entropy (nats/token)", {"loss": "train", "val_loss": "held-out"}),
          Panel("held-out bits per byte", "bits/byte", {"val_bpb": "val_bpb"}),
          Panel("learning rate", "lr", {"lr": "lr"}),
          Panel("gradient norm before clipping", "global L2 norm", {"grad_norm": "grad_norm"})]


def pretrain(model_params: ModelParams, params: TrainParams, shards_dir: Path, tokenizer_path: Path,
             out_dir: Path, checkpoint_dir: Path, size_file: Path = layout.SIZE,
             resume_from: Path | None = None) -> dict:
    if runtime.from_env().main:  # rank 0 alone writes, so it alone repairs what a killed write left
        recover(out_dir)
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
    curves_dir = layout.curves("pretrain")
    model, result = train_lm(config, params, data, checkpoint_dir, curves_dir, "pretrain", resume_from, "kiln pretrain")
    weights = distributed.full_state_dict(model)
    if not runtime.from_env().main:
        return result
    _, peak_source = peak_flops(model.tok_emb.weight.device, params.precision)
    with Progress(f"pretrain: saving the model to {out_dir}"):
        save_model(weights, config, out_dir, {"tokenizer_sha256": data.tokenizer_sha256,
                                              "mfu_peak_source": peak_source})
    unigram = unigram_entropy(data.train)
    console.print(f"pretrain: val loss {result.get('val_loss', float('nan')):.4f} nats/token vs the corpus's "
                  f"unigram entropy {unigram:.4f}", highlight=False)
    n_params = model.num_params()
    metrics = {**result, "params": n_params, "unigram_entropy": round(unigram, 5), **size}
    plot_png(curves_dir, curves_dir / "curves.png", PANELS,
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
