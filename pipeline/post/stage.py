"""The one post-training stage that SFT, DPO and GRPO each fill in with their data, loss and evaluation.

`run_stage` is the sequence all three run, in this order: repair the output folder, build the stage (its rows,
reference scores, rollouts), evaluate the starting model, fingerprint the run, train on the one loop, save the
model, then (rank 0) plot the curves and write the metrics. A stage module holds only what `Stage` asks for.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kiln.pipeline import layout
from kiln.pipeline.code_digest import stage_code_sha256
from kiln.pipeline.outputs import recover, write_metrics
from kiln.pipeline.post.common import Start
from kiln.pipeline.progress import Progress, console
from kiln.pipeline.train import distributed
from kiln.pipeline.train.checkpoints import Checkpoints
from kiln.pipeline.train.curves import Panel, plot_png
from kiln.pipeline.train.loop import Run, accumulation_steps, train
from kiln.pipeline.train.params import run_identity


@dataclass
class Stage:
    """What a post-training stage fills into `run_stage`."""

    name: str  # the stage's, as DVC and the CLI call it: its checkpoints, logs, metrics file and code digest
    loss_fn: Callable
    batches: Callable[[int], Iterator]  # the loop's micro-batches, given how many make up an optimizer step
    evaluate: Callable[[torch.nn.Module], dict]
    data: str  # digest of the training data, in the fingerprint
    micro_batch_tokens: int
    summary: str  # the line printed before training, after "<name>: " and before where the ranks run
    panels: list[Panel]
    title: str  # what it trains on, in the curves' title after "<name>: " and before the steps
    # (the loop's result, `evaluate` of the starting model) -> the stage's metrics
    metrics: Callable[[dict, dict], dict]
    fingerprint: dict = field(default_factory=dict)  # the stage's own entries, between data and train
    flops_per_token: float | None = None  # None: the start's (Start.flops_per_token)
    log_metrics: Callable[[], dict] | None = None
    show: tuple[str, ...] = ()
    suspect: str = ""  # Run.suspect


def run_stage(s: Start, prepare: Callable[[], Stage], out_dir: Path, checkpoint_dir: Path, curves_dir: Path | None,
              resume_from: Path | None) -> dict:
    """Train the stage `prepare` builds from `s` and save it to out_dir: the metrics on rank 0, the loop's
    result on the others. `prepare` runs once out_dir is repaired, before the starting model is evaluated.
    `curves_dir` None: the stage's own (`layout.curves`, a hand run's folder while inside one)."""
    model, loop, world = s.model, s.loop, s.world
    if world.main:  # rank 0 alone writes, so it alone repairs what a killed write of the model left
        recover(out_dir)
    with Progress(f"{s.stage}: building its rows" + (" and reference scores" if s.stage == "dpo" else "")):
        stage = prepare()
    curves_dir = layout.curves(stage.name) if curves_dir is None else curves_dir
    with Progress(f"{stage.name}: scoring the start model on the held-out data"):
        before = stage.evaluate(model)
    fingerprint = {**s.identity(), "data": stage.data, **stage.fingerprint, "code": stage_code_sha256(stage.name),
                   "train": run_identity(loop)}
    micro = stage.micro_batch_tokens
    run = Run(params=loop, total_steps=loop.max_steps, micro_batch_tokens=micro, loss_fn=stage.loss_fn,
              batches=stage.batches(accumulation_steps(loop, micro, world.size)), evaluate=stage.evaluate,
              checkpoints=Checkpoints(checkpoint_dir, fingerprint, loop.keep_checkpoints, world, resume_from,
                                      f"kiln {stage.name}"),
              curves_dir=curves_dir,
              flops_per_token=s.flops_per_token() if stage.flops_per_token is None else stage.flops_per_token,
              name=stage.name, log_metrics=stage.log_metrics, show=stage.show, world=world, suspect=stage.suspect,
              section=stage.name)
    console.print(f"{stage.name}: {stage.summary}{distributed.spread(world, loop.parallel)}", highlight=False)
    result = train(model, run)
    with Progress(f"{stage.name}: saving the model to {out_dir}"):
        s.save(out_dir)
    if not world.main:
        return result
    metrics = stage.metrics(result, before)
    plot_png(curves_dir, curves_dir / "curves.png", stage.panels,
             f"{stage.name}: {stage.title}, {result['steps']} steps")
    write_metrics(stage.name, metrics)
    return metrics
