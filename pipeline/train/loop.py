"""The one training loop: pretraining, the scaling sweep, SFT, DPO and GRPO use it with their losses.

It owns the machinery that does not depend on the loss (the device and precision it is handed come from
`kiln.pipeline.runtime`): AdamW with decay on matrices only, warmup + cosine or WSD schedule, gradient
accumulation to `train.batch_tokens` per step, clipping, periodic evaluation, checkpoints and resume, the NaN
guard, throughput/MFU accounting and the curves. Under torchrun it trains the model wrapped in DDP or FSDP2
(`kiln.pipeline.train.distributed`): `batches` then yields this rank's share of each global micro-batch, and the
loss it reports is the mean over ranks.

`loss_fn(model, batch)` returns the mean loss of one micro-batch; `batches` yields micro-batches forever and
has `state_dict()` / `load_state_dict()`; `evaluate(model)` returns a dict of numbers.
"""

from __future__ import annotations

import contextlib
import math
import resource
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from kiln.pipeline.errors import StageError, UserError
from kiln.pipeline.progress import Progress, console
from kiln.pipeline.runtime import PRECISIONS, SINGLE, World, autocast, resolve_kernels
from kiln.pipeline.train import distributed
from kiln.pipeline.train.checkpoints import Checkpoints
from kiln.pipeline.train.curves import Curves, curves_kept
from kiln.pipeline.train.float8 import after_optimizer_step, to_float8_training
from kiln.pipeline.train.memory import Shape, check_run_memory
from kiln.pipeline.train.muon import Muon, Optimizers, ZeroOptimizers
from kiln.pipeline.train.params import TrainParams
from kiln.pipeline.train.ramp import BatchRamp
from kiln.pipeline.train.stats import StepStats, draw, observing
from kiln.pipeline.train.throughput import peak_flops


def compile_forward(model: torch.nn.Module, params: TrainParams) -> Callable:
    """What the step calls for a forward: the model itself, or torch.compile of it in train.compile_mode."""
    return torch.compile(model, mode=params.compile_mode) if params.compile else model


def build_optimizer(model: torch.nn.Module, params: TrainParams, device: torch.device,
                    zero1: bool = False) -> torch.optim.Optimizer | Optimizers:
    """AdamW with decoupled weight decay on matrices only: norms' gains and biases are not pulled to zero.
    `zero1`: each rank keeps (and updates) the optimizer state of its share of the parameters only. With
    train.optimizer=muon, the blocks' matrices go to Muon (pipeline/train/muon.py) instead; a LoRA adapter's
    matrices stay on AdamW, as the embeddings and the head do."""
    muon = muon_matrices(model) if params.optimizer == "muon" else []
    embed, head = own_lr_matrices(model, params)
    taken = {id(p) for p in muon + embed + head}
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2 and id(p) not in taken]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    groups = [{"params": decay, "weight_decay": params.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    # the embedding's and the head's own lrs (nanochat's split), as scales of the schedule of train.lr; groups
    # only when set, so a run without them keeps the optimizer state (and checkpoints) it always had
    groups += [{"params": ps, "weight_decay": params.weight_decay, "lr_scale": lr / params.lr, "name": name}
               for name, ps, lr in (("embed", embed, params.embed_lr), ("head", head, params.head_lr)) if ps]
    kwargs = {"lr": params.lr, "betas": (params.beta1, params.beta2), "fused": device.type == "cuda"}
    adamw = sharded(torch.optim.AdamW, groups, zero1, **kwargs)
    if not muon:
        return adamw
    # the loop sets every group's lr from the schedule of train.lr; lr_scale makes the Muon group's muon_lr.
    # Under ZeRO-1 each rank updates whole matrices of its share and broadcasts them.
    matrices = sharded(Muon, [{"params": muon, "lr_scale": params.muon_lr / params.lr}], zero1, lr=params.muon_lr,
                       momentum=params.muon_momentum, momentum_start=params.muon_momentum_start,
                       momentum_warmup=params.muon_momentum_warmup, weight_decay=params.muon_weight_decay)
    return (ZeroOptimizers if zero1 else Optimizers)(adamw, matrices)


def sharded(kind: type, groups: list[dict], zero1: bool, **kwargs) -> torch.optim.Optimizer:
    """`kind(groups, **kwargs)`, or with `zero1` a ZeroRedundancyOptimizer of it: each rank keeps the state of (and
    updates) whole parameters of its share, then broadcasts them."""
    if not zero1:
        return kind(groups, **kwargs)
    from torch.distributed.optim import ZeroRedundancyOptimizer

    return ZeroRedundancyOptimizer(groups, optimizer_class=kind, **kwargs)


def own_lr_matrices(model: torch.nn.Module, params: TrainParams) -> tuple[list, list]:
    """The trainable token (and position) embeddings when train.embed_lr is set, and the untied LM head when
    train.head_lr is. A tied head is the embedding matrix: embed_lr sets its lr, and head_lr is refused."""
    gpt = distributed.unwrap(model)
    tied = gpt.lm_head.weight is gpt.tok_emb.weight
    if params.head_lr is not None and tied:
        raise UserError(f"params: train.head_lr={params.head_lr:g}: expected null with model.tie_embeddings=true "
                        "(the head is the embedding matrix; train.embed_lr sets its lr)")
    embeddings = [m.weight for m in (gpt.tok_emb, getattr(gpt, "pos_emb", None)) if m is not None]
    embed = [p for p in embeddings if p.requires_grad] if params.embed_lr is not None else []
    head = [gpt.lm_head.weight] if params.head_lr is not None and gpt.lm_head.weight.requires_grad else []
    return embed, head


def muon_matrices(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The trainable 2-D weights inside the transformer blocks, but an adapter's (LoRA's A and B)."""
    blocks = distributed.unwrap(model).blocks
    return [p for name, p in blocks.named_parameters() if p.requires_grad and p.dim() == 2 and "lora_" not in name]


def lr_at(step: int, total: int, params: TrainParams) -> float:
    """Linear warmup, then cosine to `min_lr` or (WSD) flat then a linear decay over `decay_fraction`."""
    if step < params.warmup_steps:
        return params.lr * (step + 1) / params.warmup_steps
    if params.schedule == "wsd":
        decay_start = total - max(1, round(total * params.decay_fraction))
        if step < decay_start:
            return params.lr
        frac = (step - decay_start + 1) / (total - decay_start)
        return params.lr - frac * (params.lr - params.min_lr)
    frac = (step - params.warmup_steps) / max(1, total - params.warmup_steps)
    return params.min_lr + 0.5 * (1 + math.cos(math.pi * min(frac, 1.0))) * (params.lr - params.min_lr)


@dataclass
class Run:
    """What one call of `train` needs besides the model."""

    params: TrainParams
    total_steps: int
    micro_batch_tokens: int
    loss_fn: Callable
    batches: Iterator
    evaluate: Callable[[torch.nn.Module], dict]
    checkpoints: Checkpoints
    curves_dir: Path
    flops_per_token: float  # 0: the loss's tokens are not the rows' (GRPO), so no MFU is claimed
    name: str = "train"
    world: World = SINGLE
    # The loss's own numbers since the last log (GRPO's rewards, clip ratios), logged beside the loss; the keys
    # in `show` also go on the progress line.
    log_metrics: Callable[[], dict] | None = None
    show: tuple[str, ...] = ()
    # what a non-finite loss may come from besides the learning rate, said when one stops the run (GRPO's reward)
    suspect: str = ""
    section: str = "train"  # the params section whose batch_size (and lora_rank) an error about memory names


def accumulation_steps(params: TrainParams, micro_batch_tokens: int, world_size: int = 1) -> int:
    per_pass = micro_batch_tokens * world_size
    if params.batch_tokens % per_pass:
        raise UserError(f"params: train.batch_tokens={params.batch_tokens}: expected a multiple of "
                        f"train.batch_size x sequence length x processes = {per_pass}")
    return params.batch_tokens // per_pass


class Step:
    """One optimizer step exactly as `train` takes it: the micro-batches of gradient accumulation with (scaled)
    backward and one gradient reduction, the loss averaged over ranks, a guard that stops before a non-finite
    loss reaches the weights, clipping, the update. `kiln bench train` times this same object."""

    def __init__(self, model: torch.nn.Module, forward: Callable, optimizer: torch.optim.Optimizer,
                 scaler: torch.amp.GradScaler, loss_fn: Callable, accum: int, params: TrainParams,
                 device: torch.device, after_update: Callable[[torch.nn.Module], None] | None = None):
        """`after_update(model)`: run after each update (float8.after_optimizer_step's)."""
        self.model, self.forward, self.optimizer, self.scaler = model, forward, optimizer, scaler
        self.loss_fn, self.accum, self.params, self.device = loss_fn, accum, params, device
        self.after_update = after_update

    def __call__(self, batches: Iterator, lr: float, on_bad_loss: Callable[[float], None],
                 accum: int | None = None, stats: StepStats | None = None) -> tuple[float, torch.Tensor]:
        """(loss, gradient norm) of a step of `accum` micro-batches (default: the full batch's); `on_bad_loss(loss)`
        raises when the loss is not finite. `stats` (attached) reads the gradients and the update."""
        accum = accum or self.accum
        for group in self.optimizer.param_groups:
            group["lr"] = lr * group.get("lr_scale", 1.0)
        total = torch.zeros((), device=self.device)
        for micro in range(accum):
            batch = [t.to(self.device, non_blocking=True) for t in next(batches)]
            with distributed.gradient_sync(self.model, sync=micro == accum - 1):
                with autocast(self.device, self.params.precision):
                    micro_loss = self.loss_fn(self.forward, batch) / accum
                self.scaler.scale(micro_loss).backward()
            total += micro_loss.detach()
        loss = distributed.mean(total).item()
        if not math.isfinite(loss):  # before the update, so the weights in memory stay good too
            on_bad_loss(loss)
        self.scaler.unscale_(self.optimizer)
        if stats is not None:
            stats.gradients()
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.params.grad_clip or float("inf"))
        self.scaler.step(self.optimizer)
        self.scaler.update()
        if self.after_update is not None:
            self.after_update(self.model)
        if stats is not None:
            stats.updates(self.optimizer.param_groups)
        self.optimizer.zero_grad(set_to_none=True)
        return loss, norm


def train(model: torch.nn.Module, run: Run) -> dict:
    """Train `model` in place (under torchrun: wrapped for the run; `distributed.full_state_dict` gathers it),
    holding the checkpoint folder so that a second run on it refuses instead of overwriting this one's."""
    with run.checkpoints.lock() if run.world.main else contextlib.nullcontext():
        return _train(model, run)


def _train(model: torch.nn.Module, run: Run) -> dict:
    training = Training(model, run)
    params, due = run.params, training.due
    with Progress(run.name, unit="steps", total=run.total_steps, start=training.step) as progress:
        while training.step < run.total_steps:
            lr, norm = training.take_step()
            if due(params.log_every):
                training.log(progress, lr, norm)
            progress.advance(1)
            if due(params.eval_every):
                training.evaluate()
            if due(params.checkpoint_every):
                training.checkpoint()
    return training.summary()


class Training:
    """One call of `train` under way: the wrapped model, its optimizer and scaler, the step reached, the clocks,
    the curves. Building it resumes from the newest checkpoint of these params, if there is one."""

    def __init__(self, model: torch.nn.Module, run: Run):
        params, world = run.params, run.world
        self.run, self.device = run, next(model.parameters()).device
        accum = accumulation_steps(params, run.micro_batch_tokens, world.size)
        sharded = distributed.shards(params.parallel)
        if params.precision == "fp8":  # before wrapping and compiling, as TorchAO's float8 needs
            to_float8_training(model, params.fp8_recipe, self.device, run.section, sharded=sharded)
        self.model = model = distributed.wrap(model, params.parallel, PRECISIONS[params.precision], self.device)
        if distributed.is_sharded(model) and (held := distributed.frozen_bytes(model))[1]:
            console.print(f"{run.name}: FSDP shards the frozen weights: {held[0]:,} of {held[1]:,} bytes on each rank",
                          highlight=False)
        if not distributed.is_sharded(model):  # FSDP's state is each rank's share, which the model does not count
            inner = distributed.unwrap(model)
            shape = Shape(inner.config, params.precision, resolve_kernels(params.kernels, self.device) != "torch",
                          params.activation_checkpointing, params.compile)
            check_run_memory(inner, shape, run.micro_batch_tokens, self.device, run.section)
        self.optimizer = build_optimizer(model, params, self.device, zero1=params.zero1 and world.size > 1)
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=params.precision == "fp16")
        self.step, self.seconds_before, self.loss = self.resume()
        forward = compile_forward(model, params)
        self.optimizer_step = Step(model, forward, self.optimizer, self.scaler, run.loss_fn, accum, params, self.device,
                                   after_optimizer_step(params.precision, params.fp8_recipe, sharded))
        self.curves = Curves(run.curves_dir, self.step, write=world.main)
        self.peak = peak_flops(self.device, params.precision)[0] if run.flops_per_token else None
        self.ramp = BatchRamp(params.batch_tokens, run.micro_batch_tokens * world.size, params.batch_ramp_tokens)
        self.last_eval: dict = {}
        self.timer_tokens, self.timer_start = 0, time.perf_counter()  # since the last log
        self.start = time.perf_counter()
        model.train()

    def resume(self) -> tuple[int, float, float]:
        """(step, training seconds, last loss) of the newest checkpoint, loaded into the model, optimizer, scaler and
        batches; (0, 0, NaN) for a fresh start."""
        run = self.run
        step, seconds_before, loss = 0, 0.0, float("nan")
        latest = run.checkpoints.newest()
        if latest is not None and not curves_kept(run.curves_dir):
            console.print(f"{run.name}: {latest.path} is not resumed: the curves up to it are gone from "
                          f"{run.curves_dir}; starting afresh, so that they are whole", highlight=False)
            latest = None
        if latest is not None:
            state = run.checkpoints.load(latest, self.model, self.optimizer, self.scaler)
            run.batches.load_state_dict(state["loader"])
            step, seconds_before, loss = state["step"], state.get("train_seconds", 0.0), state.get("train_loss", loss)
            console.print(f"{run.name}: resuming from {latest.path} (step {step})", highlight=False)
        elif run.world.main and (others := run.checkpoints.others()):
            console.print(f"{run.name}: no checkpoint of these params in {run.checkpoints.root}, only of others "
                          f"(newest {others[-1]}); starting afresh beside them, and they stay"
                          + (" (--resume-from one of them goes on from it with these params)"
                             if run.checkpoints.command else ""), highlight=False)
        return step, seconds_before, loss

    def due(self, every: int) -> bool:
        """Whether the step just taken is a multiple of `every`, or the last: that one is always logged, evaluated
        and checkpointed, whatever the cadence."""
        return self.step % every == 0 or self.step == self.run.total_steps

    def stop(self, loss: float) -> None:
        """The NaN guard (`Step`'s on_bad_loss): names the step about to be taken and the way on from there."""
        suspect = f"{self.run.suspect} " if self.run.suspect else ""
        raise StageError(f"{self.run.name}: loss is {loss} at step {self.step + 1}; stopped. {suspect}"
                         f"{self.run.checkpoints.advice()}")

    def take_step(self) -> tuple[float, torch.Tensor]:
        """One optimizer step at the scheduled lr and (ramped) batch; (lr, gradient norm)."""
        params, ramp, step = self.run.params, self.ramp, self.step
        lr = lr_at(step, self.run.total_steps, params) * ramp.lr_scale(step)
        observe = bool(params.stats_every) and self.run.world.main and (step + 1) % params.stats_every == 0
        with observing(self.model, observe) as inspect:  # hooks for this step only
            self.loss, norm = self.optimizer_step(self.run.batches, lr, self.stop, ramp.accumulation(step), inspect)
        self.timer_tokens += ramp.tokens(step)
        self.step += 1
        if inspect is not None:
            self.curves.add(self.step, {k: round(v, 6) for k, v in inspect.results().items()})
        return lr, norm

    def log(self, progress: Progress, lr: float, norm: torch.Tensor) -> None:
        """The step's loss, lr and gradient norm, and the throughput (and MFU) since the last log, to the curves and
        the progress line."""
        run, params, world, device, step = self.run, self.run.params, self.run.world, self.device, self.step
        if device.type == "cuda":
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - self.timer_start
        tps = self.timer_tokens / elapsed
        grad_norm = distributed.whole(norm).item()
        extra = run.log_metrics() if run.log_metrics else {}
        self.curves.add(step, {"loss": round(self.loss, 5), "lr": lr, "grad_norm": round(grad_norm, 5),
                               "tokens_per_s": round(tps, 1),
                               **({"batch_tokens": self.ramp.tokens(step - 1)} if params.batch_ramp_tokens else {}),
                               **{k: round(v, 5) for k, v in extra.items()}})
        if self.peak and device.type == "cpu" and run.flops_per_token * tps > self.peak * world.size:
            # above 100%: a measured CPU peak can only be too low (the machine was busy), measure again
            self.peak, _ = peak_flops(device, params.precision)
        mfu = run.flops_per_token * tps / (self.peak * world.size) if self.peak else None  # tps counts every rank
        progress.advance(0, loss=self.loss, **{k: round(extra[k], 3) for k in run.show if k in extra}, lr=lr,
                         **{"tok/s now": round(tps)},  # since the last log; the stage's average is in its summary
                         **({"mfu": f"{mfu:.1%}"} if mfu is not None else {}))
        self.timer_tokens, self.timer_start = 0, time.perf_counter()

    def evaluate(self) -> None:
        self.last_eval = evaluate(self.run, self.model, self.step)
        self.curves.add(self.step, {k: round(v, 5) for k, v in self.last_eval.items()})
        self.model.train()

    def checkpoint(self) -> None:
        self.run.checkpoints.save(self.step, self.model, self.optimizer, self.scaler, self.run.batches.state_dict(),
                                  {"train_seconds": self.seconds(), "train_loss": self.loss})

    def seconds(self) -> float:
        """Training time over every run of these params, resumed ones included."""
        return self.seconds_before + time.perf_counter() - self.start

    def summary(self) -> dict:
        """The run's metrics: the last loss and evaluation, steps, tokens, time, throughput, MFU, peak memory."""
        run, params, world, device, step = self.run, self.run.params, self.run.world, self.device, self.step
        if not self.last_eval:  # resumed from the final checkpoint: nothing trained, but the metrics still need it
            self.last_eval = evaluate(run, self.model, step)
        self.curves.end()
        if params.stats_every and world.main:
            draw(run.curves_dir)
        seconds = self.seconds()
        tokens = self.ramp.seen(step)
        tps = tokens / seconds if seconds else 0.0
        result = {"train_loss": round(self.loss, 5), **{k: round(v, 5) for k, v in self.last_eval.items()},
                  "steps": step, "tokens": tokens, "seconds": round(seconds, 2), "tokens_per_s": round(tps, 1)}
        peak, _ = peak_flops(device, params.precision)  # again: on a CPU the best of two measurements
        if peak and run.flops_per_token:
            result["mfu"] = round(run.flops_per_token * tps / (peak * world.size), 5)
        result["peak_memory_gb"] = round(peak_memory_bytes(device) / 1e9, 3)
        return result


def evaluate(run: Run, model: torch.nn.Module, step: int) -> dict:
    """run.evaluate under the run's precision (entered once for all it measures), refusing a non-finite result: a
    NaN validation loss means the model is broken, not a metric."""
    with autocast(next(model.parameters()).device, run.params.precision):
        result = run.evaluate(model)
    bad = [k for k, v in result.items() if not math.isfinite(v)]
    if bad:
        raise StageError(f"{run.name}: {bad[0]} is {result[bad[0]]} at step {step}; stopped. "
                         f"{run.checkpoints.advice()}")
    return result


def peak_memory_bytes(device: torch.device) -> int:
    """Peak tensor memory on CUDA; elsewhere the process's peak resident set (all of Python, not only tensors)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
