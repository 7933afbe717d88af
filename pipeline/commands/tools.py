"""The tools around the stages: `kiln convert` (Hugging Face in and out), `kiln debug overfit` and
`kiln plan memory`."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from kiln.pipeline import layout
from kiln.pipeline.commands.shared import ForceOpt, ParamsOpt, SetOpt, TokenizerOpt, reports_errors, writes
from kiln.pipeline.errors import UserError
from kiln.pipeline.protected import check_output

convert_app = typer.Typer(help="Hugging Face interop: GPT-2 and Llama checkpoints in, transformers folders out.",
                          no_args_is_help=True)
debug_app = typer.Typer(help="Checks that a model can learn at all.", no_args_is_help=True)
plan_app = typer.Typer(help="What a configuration will need, before it runs.", no_args_is_help=True)
compare_app = typer.Typer()


@compare_app.command("compare")
@reports_errors
@writes(out=True)
def compare(folders: Annotated[list[Path], typer.Argument(help="Two or more `kiln seeds` folders, the baseline "
                                                               "first.")],
            target: Annotated[float | None, typer.Option(help="The val loss to reach (default: the first group's "
                                                              "highest final val loss).")] = None,
            out: Annotated[Path | None, typer.Option(help="Where compare.json and compare.png go (default "
                                                          "runs/compare-<digest>/).")] = None):
    """Tokens and training seconds each group of seed runs takes to reach a target val loss, interpolated from
    their val curves, and each group's ratio to the first with a 95% bootstrap interval over seeds."""
    from kiln.pipeline.commands.shared import run_folder
    from kiln.pipeline.tools.compare import compare as run_compare
    from kiln.pipeline.tools.compare import print_compare

    out = out or check_output(run_folder("compare", [str(f) for f in folders] + [str(target)]), "--out", True)
    print_compare(run_compare(folders, target, out), out)


@debug_app.command("overfit")
@reports_errors
@writes(out=False)
def debug_overfit(params: ParamsOpt = layout.PARAMS, set_: SetOpt = [],
                  shards: Annotated[Path, typer.Option(help="Shard folder with manifest.json.")] = layout.SHARDS,
                  tokenizer: TokenizerOpt = layout.TOKENIZER,
                  steps: Annotated[int, typer.Option(help="Most steps to take.")] = 300,
                  target: Annotated[float, typer.Option(help="The loss (nats/token) that counts as learned.")] = 0.1,
                  lr: Annotated[float | None, typer.Option(help="The learning rate (default: train.lr; 0 shows "
                                                                "what a model that cannot learn looks like).")] = None,
                  out: Annotated[Path | None, typer.Option(help="Also write the curve and verdict as JSON.")] = None):
    """Train the configured model on one batch until its loss is near zero: exit 0 when it gets there, 1 when
    it cannot (a bug, or a learning rate that cannot work). Reads the `model` and `train` sections (`--set`:
    bare keys mean train)."""
    from kiln.pipeline.config import load_sections
    from kiln.pipeline.tools.overfit import overfit
    from kiln.pipeline.train.params import ModelParams, TrainParams

    train, model = load_sections((TrainParams, ModelParams), params, set_)
    if not overfit(model, train, shards, tokenizer, steps, target, lr, out).learned:
        raise typer.Exit(1)


@plan_app.command("memory")
@reports_errors
@writes(out=False)
def plan_memory(params: ParamsOpt = layout.PARAMS, set_: SetOpt = [],
                batch_size: Annotated[int | None, typer.Option(help="Sequences per micro-batch (default: "
                                                                     "train.batch_size).")] = None,
                seq_len: Annotated[int | None, typer.Option(help="Tokens per sequence (default: model.max_seq_len).")]
                = None,
                vocab_size: Annotated[int | None, typer.Option(help="Vocabulary (default: tokenizer.vocab_size).")]
                = None,
                device_gb: Annotated[float | None, typer.Option(help="Device memory in GB for the largest micro-batch "
                                                                     "(default: this machine's free memory, its "
                                                                     "GPU's if it has one).")] = None,
                measure: Annotated[bool, typer.Option(help="Also train 2 steps on this CPU and print the measured "
                                                           "peak of tensor bytes beside the estimate.")] = False,
                out: Annotated[Path | None, typer.Option(help="Also write the plan as JSON.")] = None):
    """Bytes of weights, gradients, optimizer state (train.optimizer), activations (per token and layer, with train.precision,
    train.kernels, train.activation_checkpointing and train.compile) and KV cache for the `model` and `train`
    sections, and the largest micro-batch that fits. `--set`: bare keys mean train; train.kernels auto counts as
    the kernels a run on this machine would use."""
    from kiln.pipeline.config import load_sections
    from kiln.pipeline.text.tokenizer import TokenizerParams
    from kiln.pipeline.tools.plan_memory import plan_memory as run
    from kiln.pipeline.train.params import ModelParams, TrainParams

    train, model, tokenizer = load_sections((TrainParams, ModelParams, TokenizerParams), params, set_)
    vocab_size = tokenizer.vocab_size if vocab_size is None else vocab_size
    if vocab_size < 1:
        raise UserError(f"--vocab-size {vocab_size}: expected a positive integer")
    run(model.config(vocab_size), train.precision, train.kernels, train.activation_checkpointing, train.compile,
        train.batch_size if batch_size is None else batch_size, model.max_seq_len if seq_len is None else seq_len,
        device_gb, measure, out, train.optimizer)


@convert_app.command("from-hf")
@reports_errors
def convert_from_hf(
        src: Annotated[str, typer.Argument(help="An HF model folder (config.json + safetensors), or a hub id to "
                                                "download.")],
        out: Annotated[Path, typer.Argument(help="The kiln model folder to write (replaced whole).")],
        force: ForceOpt = False):
    """Convert a GPT2LMHeadModel or LlamaForCausalLM into a kiln model folder (with its tokenizer.json, if any),
    refusing any setting kiln's model would not compute exactly."""
    from kiln.pipeline.tools.convert import from_hf

    from_hf(src, check_output(out, "OUT"))


@convert_app.command("to-hf")
@reports_errors
def convert_to_hf(
        model: Annotated[Path, typer.Argument(help="A kiln model folder (config.json + model.safetensors).")],
        out: Annotated[Path, typer.Argument(help="The transformers folder to write (replaced whole).")],
        tokenizer: Annotated[Path | None, typer.Option(help="The model's tokenizer.json (default: MODEL/tokenizer.json "
                                                            "if there, else data/tokenizer/tokenizer.json).")] = None,
        adapter: Annotated[bool, typer.Option("--adapter", help="For a model trained with a LoRA/QLoRA adapter: write "
                                                                "the model it was trained on, and OUT/adapter/ in "
                                                                "PEFT's format.")] = False,
        force: ForceOpt = False):
    """Convert a kiln model into a folder that transformers' AutoModelForCausalLM and AutoTokenizer load."""
    from kiln.pipeline.tools.convert import to_hf

    out = check_output(out, "OUT")
    if tokenizer is None:
        tokenizer = model / "tokenizer.json" if (model / "tokenizer.json").is_file() else layout.TOKENIZER
    to_hf(model, out, tokenizer, adapter)
