"""`kiln evaluate`: every model of `eval.models` side by side (stage `evaluate`)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from kiln.pipeline import layout
from kiln.pipeline.commands.shared import (
    CorpusOpt,
    ParamsOpt,
    SetOpt,
    TokenizerOpt,
    hand_runs,
    params_help,
    reports_errors,
)

app = typer.Typer()


@app.command("evaluate", epilog=params_help("eval"))
@app.command("eval", hidden=True)
@reports_errors
@hand_runs("evaluate", "metrics")
def evaluate_command(params: ParamsOpt = layout.PARAMS, set_: SetOpt = [],
                 models: Annotated[Path, typer.Option(help="The folder holding the eval.models folders.")] =
                 layout.MODELS,
                 shards: Annotated[Path, typer.Option(help="Shard folder with manifest.json (val split).")] =
                 layout.SHARDS,
                 tokenizer: TokenizerOpt = layout.TOKENIZER, corpus: CorpusOpt = layout.CORPUS,
                 out: Annotated[Path, typer.Option(help="Folder for eval.json, report.md and samples/; given, or with "
                                                        "--set or another input, a hand run's own folder (its "
                                                        "metrics/ then holds them).")] = layout.METRICS):
    """Val loss/perplexity/bits per byte, multiple-choice tasks, post-training accuracy and samples of every
    model in eval.models, side by side in metrics/eval.json (stage `evaluate`).

    Reads the `eval` section, `train` for the device, precision and kernels, and `sft`/`dpo` for their held-out
    data; bare `--set` keys mean eval. `kiln eval` is an alias.
    """
    from kiln.pipeline.config import load_sections
    from kiln.pipeline.evaluate.params import EvalParams
    from kiln.pipeline.post.params import DPOParams, SFTParams
    from kiln.pipeline.train.params import TrainParams

    eval_params, train, sft_params, dpo_params = load_sections((EvalParams, TrainParams, SFTParams, DPOParams), params,
                                                               set_)
    # the stage's code (torch) is imported once the params are known good: a bad value fails in a blink
    from kiln.pipeline.evaluate.evaluate import evaluate
    from kiln.pipeline.post.held_out import HeldOut

    evaluate(eval_params, train, HeldOut(sft_params, dpo_params), shards, tokenizer, corpus, models, out)
