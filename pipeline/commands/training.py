"""The training stages: `kiln pretrain`, `sft`, `dpo` and `grpo`, each started under torchrun when it asks for
several processes."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from kiln.pipeline import layout
from kiln.pipeline.commands.shared import (
    CorpusOpt,
    ForceOpt,
    OutOpt,
    ParamsOpt,
    ResumeOpt,
    SetOpt,
    TokenizerOpt,
    hand_runs,
    params_help,
    print_metrics,
    reports_errors,
    run_folder,
)

app = typer.Typer()


@app.command("pretrain", epilog=params_help("train", "model"))
@app.command("train", hidden=True)
@reports_errors
@hand_runs("pretrain", "model")
def pretrain_command(params: ParamsOpt = layout.PARAMS, set_: SetOpt = [],
                  shards: Annotated[Path, typer.Option(help="Shard folder with manifest.json.")] = layout.SHARDS,
                  tokenizer: TokenizerOpt = layout.TOKENIZER, out: OutOpt = layout.BASE_MODEL,
                  checkpoints: Annotated[Path, typer.Option(help="Resume state folder.")] =
                  layout.checkpoints("pretrain"),
                  size: Annotated[Path, typer.Option(help="With model.size=auto: the choice `kiln scaling size` wrote.")]
                  = layout.SIZE, resume_from: ResumeOpt = None, force: ForceOpt = False):
    """Pretrain the base model on the shards, resuming from the newest checkpoint (stage `pretrain`).

    Reads the `model` and `train` sections; `--set` takes `model.*` and `train.*` keys (bare keys mean train).
    With `train.nproc_per_node` > 1 it starts itself under torchrun on this machine; run it under your own
    `torchrun` (`torchrun ... -m kiln.pipeline.cli pretrain`) for several machines; `kiln train` is an alias.
    """
    from kiln.pipeline.config import load_sections
    from kiln.pipeline.train.params import ModelParams, TrainParams

    train, model = load_sections((TrainParams, ModelParams), params, set_)
    # the stage's code (torch) is imported once the params are known good: a bad value fails in a blink
    from kiln.pipeline.train.pretrain import pretrain
    train_stage("pretrain", train, lambda: pretrain(model, train, shards, tokenizer, out, checkpoints, size,
                                                     resume_from))


@app.command("sft", epilog=params_help("sft"))
@reports_errors
@hand_runs("sft", "model")
def sft_command(params: ParamsOpt = layout.PARAMS, set_: SetOpt = [],
                base: Annotated[Path, typer.Option(help="The model to start from.")] = layout.BASE_MODEL,
                tokenizer: TokenizerOpt = layout.TOKENIZER, corpus: CorpusOpt = layout.CORPUS,
                out: OutOpt = layout.SFT_MODEL,
                checkpoints: Annotated[Path, typer.Option(help="Resume state folder.")] = layout.checkpoints("sft"),
                resume_from: ResumeOpt = None, force: ForceOpt = False):
    """Supervised fine-tuning on chat examples: the built-in task or a dataset (stage `sft`).

    Reads the `sft` section, and `train` for the device, precision, kernels, Adam settings and processes (as
    pretrain's); bare `--set` keys mean sft.
    """
    from kiln.pipeline.config import load_sections
    from kiln.pipeline.post.params import SFTParams
    from kiln.pipeline.train.params import TrainParams

    sft_params, train = load_sections((SFTParams, TrainParams), params, set_)
    sft_params.check_train(train)
    # the stage's code (torch) is imported once the params are known good: a bad value fails in a blink
    from kiln.pipeline.post.sft import sft
    train_stage("sft", train, lambda: sft(sft_params, train, base, tokenizer, corpus, out, checkpoints,
                                           resume_from=resume_from))


@app.command("dpo", epilog=params_help("dpo"))
@reports_errors
@hand_runs("dpo", "model")
def dpo_command(params: ParamsOpt = layout.PARAMS, set_: SetOpt = [],
                sft_model: Annotated[Path, typer.Option("--sft", help="The SFT model: policy start and reference.")] =
                layout.SFT_MODEL,
                tokenizer: TokenizerOpt = layout.TOKENIZER, corpus: CorpusOpt = layout.CORPUS,
                out: OutOpt = layout.DPO_MODEL,
                checkpoints: Annotated[Path, typer.Option(help="Resume state folder.")] = layout.checkpoints("dpo"),
                resume_from: ResumeOpt = None, force: ForceOpt = False):
    """Direct preference optimisation from the SFT model on preference pairs (stage `dpo`).

    Reads the `dpo` section, and `train` for the device, precision, kernels, Adam settings and processes (as
    pretrain's); bare `--set` keys mean dpo.
    """
    from kiln.pipeline.config import load_sections
    from kiln.pipeline.post.params import DPOParams
    from kiln.pipeline.train.params import TrainParams

    dpo_params, train = load_sections((DPOParams, TrainParams), params, set_)
    dpo_params.check_train(train)
    # the stage's code (torch) is imported once the params are known good: a bad value fails in a blink
    from kiln.pipeline.post.dpo import dpo
    train_stage("dpo", train, lambda: dpo(dpo_params, train, sft_model, tokenizer, corpus, out, checkpoints,
                                           resume_from=resume_from))


@app.command("grpo", epilog=params_help("grpo"))
@reports_errors
@hand_runs("grpo", "model")
def grpo_command(params: ParamsOpt = layout.PARAMS, set_: SetOpt = [],
                 start: Annotated[Path | None, typer.Option(help="The model to start from (default: data/models/"
                                                                 "<grpo.init>).")] = None,
                 tokenizer: TokenizerOpt = layout.TOKENIZER, corpus: CorpusOpt = layout.CORPUS,
                 out: OutOpt = layout.GRPO_MODEL,
                 checkpoints: Annotated[Path, typer.Option(help="Resume state folder.")] = layout.checkpoints("grpo"),
                 resume_from: ResumeOpt = None, force: ForceOpt = False):
    """Reinforcement learning from verifiable rewards (GRPO) on prompts with answers (stage `grpo`).

    Reads the `grpo` section, and `train` for the device, precision, kernels, Adam settings and processes (as
    pretrain's); bare `--set` keys mean grpo.
    """
    from kiln.pipeline.config import load_sections
    from kiln.pipeline.post.grpo_params import GRPOParams
    from kiln.pipeline.train.params import TrainParams

    grpo_params, train = load_sections((GRPOParams, TrainParams), params, set_)
    grpo_params.check_train(train)
    # the stage's code (torch) is imported once the params are known good: a bad value fails in a blink
    from kiln.pipeline.post.grpo import grpo
    start = layout.MODELS / grpo_params.init if start is None else start
    train_stage("grpo", train, lambda: grpo(grpo_params, train, start, tokenizer, corpus, out, checkpoints,
                                             resume_from=resume_from))


@app.command("seeds")
@reports_errors
def seeds_command(stage: Annotated[str, typer.Argument(help="pretrain | sft | dpo | grpo")],
                  seeds: Annotated[str, typer.Option(help="The seeds, comma-separated (at least two).")] = "1,2,3",
                  params: ParamsOpt = layout.PARAMS, set_: SetOpt = [],
                  out: Annotated[Path | None, typer.Option(help="The folder of every seed's run and seeds.json "
                                                                 "(default runs/seeds-<stage>-<digest>/, the same for "
                                                                 "the same command); given again, "
                                                                 "finished seeds are kept and the rest run.")] = None):
    """Run a training stage once per seed (each a hand run: `--set <section>.seed=N --out <out>/seed-N`, with
    your --set) and print every metric's per-seed values, mean, std, spread and 95% t-interval of the mean,
    also written to <out>/seeds.json. Nothing of the DAG's is touched."""
    from kiln.pipeline.tools.seeds import parse_seeds, print_summary, run_seeds

    print_summary(run_seeds(stage, parse_seeds(seeds), params, set_,
                            out or run_folder(f"seeds-{stage}", [seeds, *set_], params)))


def train_stage(stage: str, train, run) -> None:
    """Run a training stage's `run()`: with `train.nproc_per_node` > 1 and no launcher around this process, under
    torchrun on this machine instead; the process group is left however it ends, and rank 0 alone prints. A hand
    run's model/ holding what no model folder holds is refused here, before training, not when the model is saved
    (--force lets the run replace it)."""
    from kiln.model.atomic import check_replaceable
    from kiln.model.checkpoint import MODEL_FOLDER
    from kiln.pipeline import runtime
    from kiln.pipeline.train import distributed

    if (root := layout.hand_run_root()) is not None:
        check_replaceable(root / "model", MODEL_FOLDER, "model")
    if train.nproc_per_node > 1 and not runtime.launched():
        args = sys.argv[1:]
        if root is not None and "--out" not in args:  # every rank writes the one run
            args = [*args, "--out", str(root)]
        raise typer.Exit(distributed.relaunch(train.nproc_per_node, args))
    try:
        metrics = run()
    finally:
        runtime.leave()
    if runtime.from_env().main:
        print_metrics(stage, metrics)

