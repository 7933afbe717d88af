"""`kiln debug overfit`: can the configured model learn at all? The first check of a new model or a change to
one (Karpathy's "overfit one batch"): a model that cannot drive its loss on one fixed batch to near zero has a
bug (a leaking or broken mask, a detached tensor, targets not shifted, a learning rate of zero), and this
finds out in seconds instead of a run.

The `model` section's shape, fresh weights from `train.seed`, trains on one batch of `train.batch_size`
windows of the train shards, the same batch every step, through the training loop's own step (`loop.Step`:
precision, clipping, the non-finite guard) with AdamW at a constant `train.lr` and no weight decay: the
question is whether it can memorise, not how well it generalises, so neither the schedule nor decay (which
pulls against memorising) takes part. It stops once the loss is below `--target` nats per token or after
`--steps`, and prints the curve and a verdict: learned (exit 0) or not (exit 1).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from kiln.model.gpt import GPT
from kiln.pipeline.errors import UserError
from kiln.pipeline.outputs import sha256_file, write_json
from kiln.pipeline.progress import Progress, console
from kiln.pipeline.runtime import prepare_device
from kiln.pipeline.text.loader import ShardSet, TokenBatches
from kiln.pipeline.train.lm import lm_loss
from kiln.pipeline.train.loop import Step, build_optimizer
from kiln.pipeline.train.params import ModelParams, TrainParams


@dataclass
class Verdict:
    learned: bool
    losses: list[float]  # one per step taken
    target: float

    def summary(self) -> str:
        first, last, steps = self.losses[0], self.losses[-1], len(self.losses)
        if self.learned:
            return f"learned: loss {first:.3f} -> {last:.4f} nats/token in {steps} steps (target {self.target})"
        hint = ("the loss did not move: is the learning rate 0, or are the weights cut off from the loss?"
                if abs(first - last) < 1e-3 * max(abs(first), 1) else
                "it learns, too slowly or not to zero: a mask that lets a position see its own target's "
                "neighbours, targets not shifted, a learning rate too low or too high, or too few --steps")
        return f"did not learn: loss {first:.3f} -> {last:.4f} nats/token after {steps} steps " \
               f"(target {self.target}); {hint}"


def overfit(model_params: ModelParams, params: TrainParams, shards_dir: Path, tokenizer_path: Path, steps: int,
            target: float, lr: float | None = None, out: Path | None = None) -> Verdict:
    """`lr`: instead of train.lr, 0 included (a run that cannot learn, to see the verdict say so)."""
    if steps < 1 or not (math.isfinite(target) and target > 0) or not (lr is None or math.isfinite(lr) and lr >= 0):
        raise UserError(f"--steps {steps}, --target {target}, --lr {lr}: expected a positive step count, a positive "
                        "finite loss and a finite learning rate >= 0")
    if not tokenizer_path.is_file():
        raise UserError(f"{tokenizer_path}: tokenizer not found (run `kiln tokenizer train` first)")
    shards = ShardSet(shards_dir, "train", tokenizer_sha256=sha256_file(tokenizer_path))
    config = model_params.config(shards.vocab_size)
    params = dataclasses.replace(params, optimizer="adamw", weight_decay=0.0, lr=params.lr if lr is None else lr)
    device = prepare_device(params)
    torch.manual_seed(params.seed)
    model = GPT(config).to(device).set_kernels(params.kernels).train()
    batch = next(TokenBatches(shards, params.batch_size, config.max_seq_len, seed=params.seed))
    scaler = torch.amp.GradScaler(device.type, enabled=params.precision == "fp16")
    step = Step(model, model, build_optimizer(model, params, device), scaler, lm_loss, 1, params, device)

    def bad_loss(loss: float) -> None:
        raise UserError(f"overfit: the loss became {loss} at step {len(losses) + 1} (train.lr={params.lr} too high?)")

    losses: list[float] = []
    with Progress("overfit", unit="steps", total=steps, interval=2.0) as progress:
        for _ in range(steps):
            loss, _ = step(itertools.repeat(batch), params.lr, bad_loss)
            losses.append(loss)
            progress.advance(loss=loss)
            if loss < target:
                break
    verdict = Verdict(losses[-1] < target, losses, target)
    show_curve(losses)
    console.print(verdict.summary(), highlight=False)
    if out is not None:
        write_json(out, {"learned": verdict.learned, "target": target, "steps": len(losses), "lr": params.lr,
                         "batch": [params.batch_size, config.max_seq_len], "model": config.to_dict(),
                         "losses": losses})
    return verdict


def show_curve(losses: list[float], rows: int = 10) -> None:
    """The loss at a few steps spread over the run, first and last included, with a bar for each."""
    picks = sorted({round(i * (len(losses) - 1) / (rows - 1)) for i in range(rows)}) if len(losses) > 1 else [0]
    top = max(losses[i] for i in picks) or 1.0
    for i in picks:
        console.print(f"  step {i + 1:>5}  loss {losses[i]:8.4f}  {'#' * max(1, round(40 * losses[i] / top))}",
                      highlight=False)
