"""`kiln`: one typer app, one command per stage (what dvc.yaml runs) plus tools around them.

Every stage command reads its section of params.yaml (`--params`), takes `--set key=value` overrides, and
exits 0 on success, 1 when the work fails, 2 on bad input, with one line saying what was wrong.
"""

from __future__ import annotations

import functools
import math
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape

from kiln.pipeline import layout
from kiln.pipeline.errors import KilnError, UserError
from kiln.pipeline.progress import console

app = typer.Typer(help="kiln: an LLM training pipeline, one command per DVC stage.", no_args_is_help=True, add_completion=False,
                  pretty_exceptions_enable=False)
data_app = typer.Typer(help="Corpus and token shards: prepare, shard, inspect.", no_args_is_help=True)
tokenizer_app = typer.Typer(help="Byte-level BPE: train, encode, decode.", no_args_is_help=True)
bench_app = typer.Typer(help="Benchmarks that print a table and write JSON.", no_args_is_help=True)
scaling_app = typer.Typer(help="Scaling laws: an IsoFLOP sweep, Chinchilla's approaches 2 and 3 fitted to it, the model size "
                               "they give.",
                          no_args_is_help=True)
app.add_typer(data_app, name="data")
app.add_typer(tokenizer_app, name="tokenizer")
app.add_typer(bench_app, name="bench")
app.add_typer(scaling_app, name="scaling")
convert_app = typer.Typer(help="Hugging Face interop: GPT-2 and Llama checkpoints in, transformers folders out.",
                          no_args_is_help=True)
app.add_typer(convert_app, name="convert")
debug_app = typer.Typer(help="Checks that a model can learn at all.", no_args_is_help=True)
app.add_typer(debug_app, name="debug")
plan_app = typer.Typer(help="What a configuration will need, before it runs.", no_args_is_help=True)
app.add_typer(plan_app, name="plan")

ParamsOpt = Annotated[Path, typer.Option("--params", help="The params file to read.")]
SetOpt = Annotated[list[str], typer.Option("--set", help="Override a param: key=value (repeatable).")]
CorpusOpt = Annotated[Path, typer.Option(help="Corpus folder with train.parquet and val.parquet.")]
TokenizerOpt = Annotated[Path, typer.Option(help="The tokenizer.json to use.")]
OutOpt = Annotated[Path, typer.Option(help="Output folder (replaced whole, only when the stage succeeds).")]
ResumeOpt = Annotated[Path | None, typer.Option(help="A checkpoint (a step_NNNNNNNN folder, of any run) to go on from "
                                                     "with these params while this run has none of its own.")]


def SamplingOpt(help: str, kind: type = float):
    """A sampling option of `generate` and `chat`: unset means the one default both share (serve/text_model.py)."""
    return Annotated[kind | None, typer.Option(help=f"{help} (default: kiln's sampling default)")]




def reports_errors(fn):
    """Turn a KilnError into its one-line message and exit code instead of a traceback; refuse a non-finite
    number in any float option (click parses `inf` and `nan`) before the command sees it."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            for name, value in kwargs.items():
                if isinstance(value, float) and not math.isfinite(value):
                    raise UserError(f"--{name.replace('_', '-')}={value}: expected a finite number")
            return fn(*args, **kwargs)
        except KilnError as e:
            # escape: a message quotes input, and "[/x]" in it would be read as rich markup
            console.print(f"[bold red]error:[/] {escape(str(e))}", highlight=False, soft_wrap=True)
            raise typer.Exit(e.exit_code) from None
        except KeyboardInterrupt:
            console.print("interrupted; no output was written", highlight=False)
            raise typer.Exit(130) from None

    return wrapper


@data_app.command("prepare")
@reports_errors
def data_prepare(params: ParamsOpt = layout.PARAMS, set_: SetOpt = [], out: OutOpt = layout.CORPUS):
    """Build train/val parquet files from `data.source` (stage `prepare`)."""
    from kiln.pipeline.config import load_section
    from kiln.pipeline.text.prepare import prepare
    from kiln.pipeline.text.sources import DataParams

    metrics = prepare(load_section(DataParams, params, set_), out)
    _print_metrics("prepare", metrics)


@data_app.command("shard")
@reports_errors
def data_shard(params: ParamsOpt = layout.PARAMS, set_: SetOpt = [], corpus: CorpusOpt = layout.CORPUS,
               tokenizer: TokenizerOpt = layout.TOKENIZER, out: OutOpt = layout.SHARDS,
               checkpoints: Annotated[Path, typer.Option(help="The finished shards of a killed run, to resume.")] =
               layout.checkpoints("shard")):
    """Tokenize both splits into binary shards and a manifest (stage `shard`); a rerun after a kill keeps the
    shards already finished."""
    from kiln.pipeline.config import load_section
    from kiln.pipeline.text.shard import ShardParams, shard

    metrics = shard(load_section(ShardParams, params, set_), corpus, tokenizer, out, checkpoints)
    _print_metrics("shard", metrics)


@data_app.command("inspect")
@reports_errors
def data_inspect(path: Annotated[Path, typer.Argument(help="A shard file (.bin).")],
                 tokenizer: TokenizerOpt = layout.TOKENIZER,
                 tokens: Annotated[int, typer.Option("-n", "--tokens", help="How many tokens to decode.")] = 64):
    """Print a shard's header, token count and its first tokens decoded."""
    from kiln.pipeline.text.shard_format import ShardHeader, open_tokens
    from kiln.pipeline.text.tokens import load_tokenizer

    header = ShardHeader.read(path)
    ids = [int(i) for i in open_tokens(path, header)[:tokens]]
    typer.echo(f"file:       {path}\nformat:     v{header.version}, {header.dtype.name}\n"
               f"tokens:     {header.tokens:,}\nvocab size: {header.vocab_size:,}\n"
               f"tokenizer:  sha256 {header.tokenizer_sha256}")
    if tokenizer.is_file():
        typer.echo(f"first {len(ids)} tokens:\n{load_tokenizer(tokenizer).decode(ids, skip_special_tokens=False)}")
    else:
        typer.echo(f"first {len(ids)} ids: {ids}")


@tokenizer_app.command("train")
@reports_errors
def tokenizer_train(params: ParamsOpt = layout.PARAMS, set_: SetOpt = [], corpus: CorpusOpt = layout.CORPUS,
                    out: OutOpt = layout.TOKENIZER_DIR):
    """Train the byte-level BPE on the train split, or build GPT-2's with `source=gpt2` (stage `tokenizer`)."""
    from kiln.pipeline.config import load_section
    from kiln.pipeline.text.tokenizer import TokenizerParams, train_tokenizer

    metrics = train_tokenizer(load_section(TokenizerParams, params, set_), corpus, out)
    _print_metrics("tokenizer", metrics)


@tokenizer_app.command("encode")
@reports_errors
def tokenizer_encode(text: Annotated[str, typer.Argument(help="Text to encode ('-' reads stdin).")],
                     tokenizer: TokenizerOpt = layout.TOKENIZER):
    """Print the ids of TEXT, then its pieces (special-token text becomes the special token)."""
    from kiln.pipeline.errors import UserError
    from kiln.pipeline.text.corpus import SURROGATE
    from kiln.pipeline.text.tokens import load_tokenizer, token_bytes

    tok = load_tokenizer(tokenizer)
    text = sys.stdin.read() if text == "-" else text
    if bad := SURROGATE.search(text):
        raise UserError(f"TEXT: not valid Unicode (lone surrogate {bad.group()!r} at character {bad.start()})")
    ids = tok.encode(text).ids
    typer.echo(" ".join(map(str, ids)))
    pieces = (token_bytes(tok, i) for i in ids)
    # A piece that ends inside a UTF-8 character shows as bytes rather than as a replacement character.
    typer.echo(" ".join(repr(p.decode()) if _is_utf8(p) else repr(p) for p in pieces))


@tokenizer_app.command("decode")
@reports_errors
def tokenizer_decode(ids: Annotated[list[str], typer.Argument(help="Token ids, space- or comma-separated.")],
                     tokenizer: TokenizerOpt = layout.TOKENIZER):
    """Print the text of token IDS."""
    from kiln.pipeline.errors import UserError
    from kiln.pipeline.text.tokens import load_tokenizer

    tok = load_tokenizer(tokenizer)
    words = [w for item in ids for w in item.replace(",", " ").split()]
    bad = [w for w in words if not w.isdigit() or int(w) >= tok.get_vocab_size()]
    if bad:
        raise UserError(f"ids: {bad[0]!r} is not a token id (expected 0..{tok.get_vocab_size() - 1})")
    typer.echo(tok.decode([int(w) for w in words], skip_special_tokens=False))


@app.command("pretrain")
@app.command("train", hidden=True)
@reports_errors
def pretrain_command(params: ParamsOpt = layout.PARAMS, set_: SetOpt = [],
                  shards: Annotated[Path, typer.Option(help="Shard folder with manifest.json.")] = layout.SHARDS,
                  tokenizer: TokenizerOpt = layout.TOKENIZER, out: OutOpt = layout.BASE_MODEL,
                  checkpoints: Annotated[Path, typer.Option(help="Resume state folder.")] =
                  layout.checkpoints("pretrain"),
                  size: Annotated[Path, typer.Option(help="With model.size=auto: the choice `kiln scaling size` wrote.")]
                  = layout.SIZE, resume_from: ResumeOpt = None):
    """Pretrain the base model on the shards, resuming from the newest checkpoint (stage `pretrain`).

    Reads the `model` and `train` sections; `--set` takes `model.*` and `train.*` keys (bare keys mean train).
    With `train.nproc_per_node` > 1 it starts itself under torchrun on this machine; run it under your own
    `torchrun` (`torchrun ... -m kiln.pipeline.cli pretrain`) for several machines; `kiln train` is an alias.
    """
    from kiln.pipeline.config import load_sections
    from kiln.pipeline.train.params import ModelParams, TrainParams
    from kiln.pipeline.train.pretrain import pretrain

    train, model = load_sections((TrainParams, ModelParams), params, set_)
    _train_stage("pretrain", train, lambda: pretrain(model, train, shards, tokenizer, out, checkpoints, size,
                                                     resume_from))


@app.command("sft")
@reports_errors
def sft_command(params: ParamsOpt = layout.PARAMS, set_: SetOpt = [],
                base: Annotated[Path, typer.Option(help="The model to start from.")] = layout.BASE_MODEL,
                tokenizer: TokenizerOpt = layout.TOKENIZER, corpus: CorpusOpt = layout.CORPUS,
                out: OutOpt = layout.SFT_MODEL,
                checkpoints: Annotated[Path, typer.Option(help="Resume state folder.")] = layout.checkpoints("sft"),
                resume_from: ResumeOpt = None):
    """Supervised fine-tuning on chat examples: the built-in task or a dataset (stage `sft`).

    Reads the `sft` section, and `train` for the device, precision, kernels, Adam settings and processes (as
    pretrain's); bare `--set` keys mean sft.
    """
    from kiln.pipeline.config import load_sections
    from kiln.pipeline.post.params import SFTParams
    from kiln.pipeline.post.sft import sft
    from kiln.pipeline.train.params import TrainParams

    sft_params, train = load_sections((SFTParams, TrainParams), params, set_)
    _train_stage("sft", train, lambda: sft(sft_params, train, base, tokenizer, corpus, out, checkpoints,
                                           resume_from=resume_from))


@app.command("dpo")
@reports_errors
def dpo_command(params: ParamsOpt = layout.PARAMS, set_: SetOpt = [],
                sft_model: Annotated[Path, typer.Option("--sft", help="The SFT model: policy start and reference.")] =
                layout.SFT_MODEL,
                tokenizer: TokenizerOpt = layout.TOKENIZER, corpus: CorpusOpt = layout.CORPUS,
                out: OutOpt = layout.DPO_MODEL,
                checkpoints: Annotated[Path, typer.Option(help="Resume state folder.")] = layout.checkpoints("dpo"),
                resume_from: ResumeOpt = None):
    """Direct preference optimisation from the SFT model on preference pairs (stage `dpo`).

    Reads the `dpo` section, and `train` for the device, precision, kernels, Adam settings and processes (as
    pretrain's); bare `--set` keys mean dpo.
    """
    from kiln.pipeline.config import load_sections
    from kiln.pipeline.post.dpo import dpo
    from kiln.pipeline.post.params import DPOParams
    from kiln.pipeline.train.params import TrainParams

    dpo_params, train = load_sections((DPOParams, TrainParams), params, set_)
    _train_stage("dpo", train, lambda: dpo(dpo_params, train, sft_model, tokenizer, corpus, out, checkpoints,
                                           resume_from=resume_from))


@app.command("grpo")
@reports_errors
def grpo_command(params: ParamsOpt = layout.PARAMS, set_: SetOpt = [],
                 start: Annotated[Path | None, typer.Option(help="The model to start from (default: data/models/"
                                                                 "<grpo.init>).")] = None,
                 tokenizer: TokenizerOpt = layout.TOKENIZER, corpus: CorpusOpt = layout.CORPUS,
                 out: OutOpt = layout.GRPO_MODEL,
                 checkpoints: Annotated[Path, typer.Option(help="Resume state folder.")] = layout.checkpoints("grpo"),
                 resume_from: ResumeOpt = None):
    """Reinforcement learning from verifiable rewards (GRPO) on prompts with answers (stage `grpo`).

    Reads the `grpo` section, and `train` for the device, precision, kernels, Adam settings and processes (as
    pretrain's); bare `--set` keys mean grpo.
    """
    from kiln.pipeline.config import load_sections
    from kiln.pipeline.post.grpo import grpo
    from kiln.pipeline.post.grpo_params import GRPOParams
    from kiln.pipeline.train.params import TrainParams

    grpo_params, train = load_sections((GRPOParams, TrainParams), params, set_)
    start = layout.MODELS / grpo_params.init if start is None else start
    _train_stage("grpo", train, lambda: grpo(grpo_params, train, start, tokenizer, corpus, out, checkpoints,
                                             resume_from=resume_from))


@app.command("evaluate")
@app.command("eval", hidden=True)
@reports_errors
def evaluate_command(params: ParamsOpt = layout.PARAMS, set_: SetOpt = [],
                 models: Annotated[Path, typer.Option(help="The folder holding the eval.models folders.")] =
                 layout.MODELS,
                 shards: Annotated[Path, typer.Option(help="Shard folder with manifest.json (val split).")] =
                 layout.SHARDS,
                 tokenizer: TokenizerOpt = layout.TOKENIZER, corpus: CorpusOpt = layout.CORPUS,
                 metrics: Annotated[Path, typer.Option(help="Folder for eval.json.")] = layout.METRICS,
                 samples: Annotated[Path, typer.Option(help="Folder for <model>.md generations.")] =
                 layout.SAMPLES):
    """Val loss/perplexity/bits per byte, multiple-choice tasks, post-training accuracy and samples of every
    model in eval.models, side by side in metrics/eval.json (stage `evaluate`).

    Reads the `eval` section, `train` for the device, precision and kernels, and `sft`/`dpo` for their held-out
    data; bare `--set` keys mean eval. `kiln eval` is an alias.
    """
    from kiln.pipeline.config import load_sections
    from kiln.pipeline.evals.evaluate import EvalParams, evaluate
    from kiln.pipeline.post.params import DPOParams, SFTParams
    from kiln.pipeline.train.params import TrainParams

    eval_params, train, sft_params, dpo_params = load_sections((EvalParams, TrainParams, SFTParams, DPOParams), params,
                                                               set_)
    evaluate(eval_params, train, sft_params, dpo_params, shards, tokenizer, corpus, models, metrics, samples)


@app.command("generate")
@reports_errors
def generate_command(
        prompt: Annotated[list[str], typer.Option(help="Text to continue (repeatable: one completion each).")],
        model: Annotated[Path, typer.Option(help="A model folder (config.json + model.safetensors).")] =
        layout.BASE_MODEL,
        tokenizer: TokenizerOpt = layout.TOKENIZER,
        max_new_tokens: Annotated[int | None, typer.Option(help="Tokens to add (default: fill the context).")] = None,
        temperature: SamplingOpt("0 is greedy.") = None,
        top_k: SamplingOpt("Sample among the k likeliest tokens.", int) = None,
        top_p: SamplingOpt("Sample among the likeliest tokens holding this mass.") = None,
        seed: Annotated[int | None, typer.Option(help="Make sampling reproducible.")] = None,
        device: Annotated[str, typer.Option(help="auto | cpu | cuda | mps")] = "auto"):
    """Continue each --prompt with a trained model, stopping at <|endoftext|>."""
    from kiln.pipeline.runtime import pick_device
    from kiln.pipeline.serve.text_model import Sampling, TextModel

    lm = TextModel(model, tokenizer, pick_device(device))
    outs = lm.complete(prompt, Sampling.with_defaults(max_new_tokens, temperature, top_k, top_p, seed))
    for text, out in zip(prompt, outs, strict=True):
        typer.echo(text + out)
        if len(prompt) > 1:
            typer.echo("-" * 40)


@app.command("chat")
@reports_errors
def chat_command(
        model: Annotated[Path, typer.Option(help="A chat model folder (SFT or DPO).")] = layout.DPO_MODEL,
        tokenizer: TokenizerOpt = layout.TOKENIZER,
        system: Annotated[str | None, typer.Option(help="A system message that opens the conversation.")] = None,
        max_new_tokens: Annotated[int | None, typer.Option(help="Most tokens per answer (default: a quarter of the "
                                                                "context).")] = None,
        temperature: SamplingOpt("0 is greedy.") = None,
        top_k: SamplingOpt("Sample among the k likeliest tokens.", int) = None,
        top_p: SamplingOpt("Sample among the likeliest tokens holding this mass.") = None,
        seed: Annotated[int | None, typer.Option(help="Make sampling reproducible.")] = None,
        device: Annotated[str, typer.Option(help="auto | cpu | cuda | mps")] = "auto"):
    """Talk to a chat model: each line you type is a user turn, the answer streams back (/reset starts over,
    /quit or end of input stops)."""
    from kiln.pipeline.runtime import pick_device
    from kiln.pipeline.serve.text_model import ChatSession, Sampling, TextModel

    session = ChatSession(TextModel(model, tokenizer, pick_device(device)),
                          Sampling.with_defaults(max_new_tokens, temperature, top_k, top_p, seed), system)
    interactive = sys.stdin.isatty()
    while True:
        try:
            line = input("you> " if interactive else "")
        except EOFError:
            break
        if line.strip() in ("/quit", "/exit"):
            break
        if line.strip() == "/reset":
            session.turns = []
            continue
        if not line.strip():
            continue
        typer.echo("kiln> ", nl=False)
        for piece in session.reply(line):
            typer.echo(piece, nl=False)
        typer.echo()


@app.command("serve")
@reports_errors
def serve_command(
        model: Annotated[Path, typer.Option(help="A model folder (config.json + model.safetensors).")] =
        layout.DPO_MODEL,
        tokenizer: TokenizerOpt = layout.TOKENIZER,
        host: Annotated[str, typer.Option(help="Address to listen on.")] = "127.0.0.1",
        port: Annotated[int, typer.Option(help="Port to listen on.")] = 8000,
        device: Annotated[str, typer.Option(help="auto | cpu | cuda | mps")] = "auto",
        kv_blocks: Annotated[int | None, typer.Option(help="KV cache blocks (default: 16 full contexts).")] = None,
        block_size: Annotated[int, typer.Option(help="Tokens per KV cache block.")] = 16,
        max_batch_tokens: Annotated[int, typer.Option(help="Most tokens one engine step runs (decodes, then "
                                                           "prefill chunks).")] = 256,
        name: Annotated[str | None, typer.Option(help="The model's name in the API (default: the folder's).")] =
        None,
        draft: Annotated[Path | None, typer.Option(help="A smaller model with the same tokenizer for speculative "
                                                        "decoding.")] = None,
        speculate: Annotated[int, typer.Option(help="Tokens the draft proposes per step.")] = 4):
    """Serve a model over the OpenAI HTTP API (/v1/completions, /v1/chat/completions, /v1/models, /health) on a
    continuous-batching engine with a paged KV cache."""
    from kiln.pipeline.serve.server import serve

    serve(model, tokenizer, host, port, device, kv_blocks, block_size, max_batch_tokens, name, draft, speculate)


@scaling_app.command("sweep")
@reports_errors
def scaling_sweep_command(
        params: ParamsOpt = layout.PARAMS, set_: SetOpt = [],
        shards: Annotated[Path, typer.Option(help="Shard folder with manifest.json.")] = layout.SHARDS,
        tokenizer: TokenizerOpt = layout.TOKENIZER,
        out: Annotated[Path, typer.Option(help="Folder for runs.csv and each run's curves (kept across runs).")] =
        layout.SCALING,
        checkpoints: Annotated[Path, typer.Option(help="Resume state of the run in progress.")] =
        layout.checkpoints("scaling")):
    """Train the IsoFLOP grid scaling.budgets x scaling.depths, skipping runs already in runs.csv (stage
    `scaling_sweep`).

    Reads the `scaling` section (the grid and the optimiser its runs train with) and `model` (arch, sequence
    length); bare `--set` keys mean scaling.
    """
    from kiln.pipeline.config import load_sections
    from kiln.pipeline.scaling.params import ScalingParams
    from kiln.pipeline.scaling.sweep import sweep
    from kiln.pipeline.train.params import ModelParams

    scaling, model = load_sections((ScalingParams, ModelParams), params, set_)
    _print_metrics("scaling sweep", sweep(scaling, model, shards, tokenizer, out, checkpoints))


@scaling_app.command("size")
@reports_errors
def scaling_size_command(
        params: ParamsOpt = layout.PARAMS, set_: SetOpt = [],
        fit: Annotated[Path, typer.Option(help="The fit `kiln scaling fit` wrote.")] = layout.FIT,
        tokenizer: TokenizerOpt = layout.TOKENIZER,
        out: Annotated[Path, typer.Option(help="Where to write the choice (JSON).")] = layout.SIZE):
    """With model.size=auto, pick the depth-dial model and token count for scaling.target_flops from the fit
    (stage `scaling_size`); with model.size=fixed, record just that.

    Reads the `scaling` and `model` sections; bare `--set` keys mean scaling.
    """
    from kiln.pipeline.config import load_sections
    from kiln.pipeline.scaling.params import ScalingParams
    from kiln.pipeline.scaling.size import scaling_size
    from kiln.pipeline.train.params import ModelParams

    scaling, model = load_sections((ScalingParams, ModelParams), params, set_)
    scaling_size(scaling, model, fit, tokenizer, out)


@scaling_app.command("fit")
@reports_errors
def scaling_fit_command(
        runs: Annotated[Path, typer.Option(help="CSV with params,tokens,loss[,flops] columns, or the CS336 JSON list "
                                                "of {parameters, compute_budget, final_loss}.")],
        out: Annotated[Path, typer.Option(help="Where to write the fitted values (JSON).")],
        target_flops: Annotated[float | None, typer.Option(help="Give the compute-optimal N, D and loss for this "
                                                                "many FLOPs (default: scaling.target_flops).")] = None,
        plots: Annotated[Path | None, typer.Option(help="Folder for the PNGs and their CSV rows.")] = None,
        bootstrap: Annotated[int | None, typer.Option(help="Resamples for the confidence intervals (0: none; "
                                                           "default: scaling.bootstrap).")] = None,
        seed: Annotated[int, typer.Option(help="Seed of the bootstrap resampling.")] = 0,
        metrics: Annotated[Path | None, typer.Option(help="Also write the fitted scalars here, for dvc metrics.")]
        = None,
        params: ParamsOpt = layout.PARAMS, set_: SetOpt = []):
    """Fit IsoFLOP profiles (approach 2) and L(N, D) = E + A/N^alpha + B/D^beta (approach 3) to finished runs
    (stage `scaling_fit`). Reads scaling.target_flops and scaling.bootstrap unless the options give them."""
    from kiln.pipeline.config import load_section
    from kiln.pipeline.scaling.fit import print_summary, scaling_fit
    from kiln.pipeline.scaling.params import ScalingParams

    scaling = load_section(ScalingParams, params, set_)
    target_flops = scaling.target_flops if target_flops is None else target_flops
    bootstrap = scaling.bootstrap if bootstrap is None else bootstrap
    print_summary(scaling_fit(runs, out, target_flops, plots, bootstrap, seed, metrics), out)


@bench_app.command("shard")
@reports_errors
def bench_shard(corpus: CorpusOpt = layout.CORPUS, tokenizer: TokenizerOpt = layout.TOKENIZER,
                split: str = "train",
                max_mb: Annotated[float, typer.Option(help="Encode at most this many MB of text.")] = 8.0,
                out: Annotated[Path, typer.Option(help="Where to write the JSON results.")] =
                layout.BENCH / "shard.json"):
    """Sharding throughput against a single-process loop over HF `Tokenizer.encode`, in one run."""
    from kiln.pipeline.tools.bench import bench_shard as run

    run(corpus, tokenizer, split, max_mb, out)


@bench_app.command("data")
@reports_errors
def bench_data(params: ParamsOpt = layout.PARAMS,
               scales: Annotated[str, typer.Option(help="Corpus sizes: copies of Shakespeare, comma-separated "
                                                        "(x8, 40 MB, is past the size prepare starts workers at).")] =
               "1,8",
               max_mb: Annotated[float | None, typer.Option(help="Take at most this many MB of Shakespeare per "
                                                              "copy (default: all of it).")] = None,
               out: Annotated[Path, typer.Option(help="Where to write the JSON results.")] = layout.BENCH / "data.json"):
    """Throughput per core and peak memory of prepare, tokenizer and shard at two corpus sizes (the `data`,
    `tokenizer` and `shard` params), each stage in its own process."""
    from kiln.pipeline.errors import UserError
    from kiln.pipeline.tools.bench_data import bench_data as run

    try:
        sizes = [int(s) for s in scales.split(",")]
    except ValueError:
        raise UserError(f"--scales {scales!r}: expected comma-separated integers, e.g. 1,8") from None
    run(params, sizes, max_mb, out)


@bench_app.command("train")
@reports_errors
def bench_train(params: ParamsOpt = layout.PARAMS, set_: SetOpt = [],
                variants: Annotated[str, typer.Option(
                    help="Comma-separated PRECISION-MODE[-KERNELS] list: PRECISION fp32|bf16|fp16, MODE "
                         "eager|compile, KERNELS auto|triton|torch (default: --kernels). Rows run in this order, "
                         "the first is the speedup baseline; put compile + triton last (a device-side assert ends "
                         "the process; the rows before it are saved). On a CPU keep it short: bf16 runs over 10x "
                         "slower than fp32 without bf16 instructions, and a compile variant compiles for ~40 s "
                         "(less once cached).")] =
                "fp32-eager,fp32-compile,bf16-eager,bf16-compile",
                compile_modes: Annotated[str, typer.Option(
                    help="Comma-separated torch.compile modes (as train.compile_mode): default, reduce-overhead, "
                         "max-autotune-no-cudagraphs, max-autotune. Each compile variant runs in every one, a row "
                         "each; the first is its own row's and the other rows' mode.")] = "default",
                plan_batch: Annotated[bool, typer.Option(
                    help="Also run each variant at the largest micro-batch `kiln plan memory` fits in the "
                         "device's memory (--device-gb), a row beside it.")] = False,
                device_gb: Annotated[float | None, typer.Option(
                    help="Memory --plan-batch fits the micro-batch in, GB (default: the device's free memory).")]
                = None,
                vocab_size: Annotated[int, typer.Option(help="Vocabulary the random token ids come from.")] = 4096,
                batch_size: Annotated[int, typer.Option(help="Sequences per step.")] = 16,
                seq_len: Annotated[int | None, typer.Option(help="Tokens per sequence (default: model.max_seq_len).")]
                = None,
                steps: Annotated[int, typer.Option(help="Timed steps per variant.")] = 10,
                warmup: Annotated[int, typer.Option(help="Untimed steps before them; the first one compiles.")] = 2,
                device: Annotated[str, typer.Option(help="auto (cuda, then mps, then cpu), cpu, cuda, cuda:N or mps.")]
                = "auto",
                kernels: Annotated[str, typer.Option(help="auto | triton | torch, as train.kernels, for variants "
                                                          "that name none.")] = "torch",
                profile: Annotated[Path | None, typer.Option(
                    help="A folder for a torch.profiler trace of 3 more steps per variant (Chrome/Perfetto JSON); "
                         "prints each variant's top operators by self time.")] = None,
                checkpointing: Annotated[bool, typer.Option(
                    help="Also run each variant with its blocks recomputed in the backward "
                         "(train.activation_checkpointing), a row beside it.")] = False,
                stats_every: Annotated[int, typer.Option(
                    help="Also run each variant with training statistics every this many steps "
                         "(train.stats_every), a row beside it; 0: not.")] = 0,
                out: Annotated[Path, typer.Option(help="Where to write the JSON results.")] =
                layout.BENCH / "train.json"):
    """Training-step tokens/s, MFU and peak memory (beside plan memory's estimate), fp32 vs bf16, eager vs
    torch.compile in its modes, torch vs Triton kernels, at a batch of your choice and plan memory's largest, in one
    run; exits 1 if a row failed (its error is in the JSON and the table).

    A step is forward, backward, clipping and AdamW on random token ids, for the shape in the `model` section
    (`--set model.key=value` changes it).
    """
    from kiln.pipeline.config import load_section
    from kiln.pipeline.tools.bench_train import bench_train as run
    from kiln.pipeline.tools.bench_train import parse_compile_modes, parse_variants
    from kiln.pipeline.train.params import ModelParams

    run(load_section(ModelParams, params, set_), parse_variants(variants, kernels), vocab_size, batch_size, seq_len,
        steps, warmup, device, out, profile, checkpointing, stats_every, parse_compile_modes(compile_modes),
        plan_batch, device_gb)


@bench_app.command("generate")
@reports_errors
def bench_generate(params: ParamsOpt = layout.PARAMS, set_: SetOpt = [],
                   model: Annotated[Path | None, typer.Option(
                       help="A trained model folder (default: random weights in the `model` section's shape).")] = None,
                   vocab_size: Annotated[int, typer.Option(help="Vocabulary of the random model.")] = 4096,
                   batch_sizes: Annotated[str, typer.Option(help="Comma-separated batch sizes.")] = "1,16",
                   prompt_len: Annotated[int | None, typer.Option(help="Prompt tokens (default: half the context).")]
                   = None,
                   new_tokens: Annotated[int | None, typer.Option(
                       help="Tokens generated per row (default: the rest of the context).")] = None,
                   repeats: Annotated[int, typer.Option(help="Timed calls per variant (the median is reported).")] = 3,
                   dtype: Annotated[str, typer.Option(help="Weights and cache dtype: fp32 | bf16 | fp16.")] = "fp32",
                   device: Annotated[str, typer.Option(help="auto (cuda, then mps, then cpu), cpu, cuda, cuda:N or mps.")]
                   = "auto",
                   out: Annotated[Path, typer.Option(help="Where to write the JSON results.")] =
                   layout.BENCH / "generate.json"):
    """Prefill and decode tokens/s of generation with and without the KV cache, for each batch size, in one run."""
    from kiln.pipeline.config import load_section
    from kiln.pipeline.tools.bench_generate import bench_generate as run
    from kiln.pipeline.train.params import ModelParams

    try:
        sizes = [int(b) for b in batch_sizes.split(",")]
    except ValueError:
        raise typer.BadParameter(f"{batch_sizes!r}: expected comma-separated integers", param_hint="--batch-sizes")
    run(load_section(ModelParams, params, set_), model, vocab_size, sizes, prompt_len, new_tokens, repeats, dtype,
        device, out)


@debug_app.command("overfit")
@reports_errors
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
    """Bytes of weights, gradients, AdamW state, activations (per token and layer, with train.precision,
    train.kernels and train.activation_checkpointing) and KV cache for the `model` and `train` sections, and the
    largest micro-batch that fits. `--set`: bare keys mean train; train.kernels auto counts as triton."""
    from kiln.pipeline.config import load_sections
    from kiln.pipeline.text.tokenizer import TokenizerParams
    from kiln.pipeline.tools.plan_memory import plan_memory as run
    from kiln.pipeline.train.params import ModelParams, TrainParams

    train, model, tokenizer = load_sections((TrainParams, ModelParams, TokenizerParams), params, set_)
    vocab_size = tokenizer.vocab_size if vocab_size is None else vocab_size
    if vocab_size < 1:
        raise UserError(f"--vocab-size {vocab_size}: expected a positive integer")
    run(model.config(vocab_size), train.precision, train.kernels, train.activation_checkpointing,
        train.batch_size if batch_size is None else batch_size, model.max_seq_len if seq_len is None else seq_len,
        device_gb, measure, out)


@bench_app.command("serve")
@reports_errors
def bench_serve(params: ParamsOpt = layout.PARAMS, set_: SetOpt = [],
                model: Annotated[Path | None, typer.Option(
                    help="A trained model folder (default: random weights in the `model` section's shape).")] = None,
                draft: Annotated[Path | None, typer.Option(help="A draft model for the speculative row.")] = None,
                vocab_size: Annotated[int, typer.Option(help="Vocabulary of the random model.")] = 4096,
                requests: Annotated[int, typer.Option(help="Requests in the workload.")] = 32,
                rate: Annotated[float, typer.Option(help="Poisson arrivals per second (0: all at once).")] = 50.0,
                batch: Annotated[int, typer.Option(help="Static batching's largest batch.")] = 16,
                block_size: Annotated[int, typer.Option(help="Tokens per KV cache block.")] = 16,
                max_batch_tokens: Annotated[int, typer.Option(help="Most tokens per engine step.")] = 256,
                output_lengths: Annotated[str, typer.Option(help="geometric (long-tailed, mean an eighth of "
                                                                 "the context) | uniform.")] = "geometric",
                speculate: Annotated[int, typer.Option(help="Tokens the draft proposes per step.")] = 4,
                seed: Annotated[int, typer.Option(help="Workload and random weights.")] = 0,
                device: Annotated[str, typer.Option(help="auto | cpu | cuda")] = "auto",
                out: Annotated[Path, typer.Option(help="Where to write the JSON results.")] =
                layout.BENCH / "serve.json"):
    """Output tokens/s, time to first token and inter-token latency of the serving engine against static
    batching, prefix caching, speculative decoding at batch 1 and transformers' generate, in one run."""
    from kiln.pipeline.config import load_section
    from kiln.pipeline.tools.bench_serve import bench_serve as run
    from kiln.pipeline.train.params import ModelParams

    config = load_section(ModelParams, params, set_).config(vocab_size)
    run(config, model, draft, requests, rate, batch, block_size, max_batch_tokens, seed, device, out, output_lengths,
        speculate)


@bench_app.command("adapters")
@reports_errors
def bench_adapters(params: ParamsOpt = layout.PARAMS, set_: SetOpt = [],
                   tokenizer: TokenizerOpt = layout.TOKENIZER,
                   tokens: Annotated[int, typer.Option(help="Tokens in the one training step taken.")] = 64,
                   device: Annotated[str, typer.Option(help="auto (cuda, else cpu), cpu or cuda.")] = "auto",
                   out: Annotated[Path, typer.Option(help="Where to write the JSON results.")] =
                   layout.BENCH / "adapters.json"):
    """Weights, gradients and AdamW state of full, LoRA and QLoRA fine-tuning, for the `model` section's shape
    and GPT-2 124M's (rank, alpha and targets from the `sft` section)."""
    from kiln.pipeline.config import load_sections
    from kiln.pipeline.post.params import SFTParams
    from kiln.pipeline.text.tokens import load_tokenizer
    from kiln.pipeline.tools.bench_adapters import bench_adapters as run
    from kiln.pipeline.tools.bench_adapters import default_shapes
    from kiln.pipeline.train.params import ModelParams

    model, sft = load_sections((ModelParams, SFTParams), params, set_)
    vocab = load_tokenizer(tokenizer).get_vocab_size() if tokenizer.is_file() else 1024
    run(default_shapes(model.config(vocab)), sft.lora_rank, sft.lora_alpha, sft.lora_targets, device, tokens, out)


@bench_app.command("kernels")
@reports_errors
def bench_kernels(ops: Annotated[str | None, typer.Option(
                      help="Comma-separated subset: rms_norm, swiglu, rope, cross_entropy, linear_cross_entropy, "
                           "flash_attention, nf4_dequantize (default: all).")] = None,
                  size: Annotated[str, typer.Option(
                      help="full: the whole shape grid; quick: fewer shapes (a GPU minute or two); smoke: tiny "
                           "shapes that also run on CPU through Triton's interpreter (checks the command, times "
                           "nothing).")] = "full",
                  compile_baseline: Annotated[bool, typer.Option(
                      "--compile/--no-compile", help="Also time torch.compile of each reference.")] = True,
                  out: Annotated[Path, typer.Option(help="Where to write the JSON results.")] =
                  layout.BENCH / "kernels.json"):
    """Each Triton kernel vs torch eager, torch.compile and Liger-Kernel: ms, GB/s, % of copy bandwidth, peak
    memory, goal met (CUDA; `--size smoke` on CPU)."""
    from kiln.pipeline.tools.bench_kernels import bench_kernels as run

    run(ops.split(",") if ops else None, size, compile_baseline, out)


@bench_app.command("gpu")
@reports_errors
def bench_gpu(size: Annotated[str, typer.Option(
                  help="quick: every step in one short pass (limits summing to 8 minutes); full: every shape of "
                       "the issue and the train grid (split it with --steps to fit 10-minute calls); smoke: toy "
                       "shapes on a CPU, to check the command works.")] = "quick",
              steps: Annotated[str | None, typer.Option(
                  help="Comma-separated subset of env, train, kernels, tests, pretrain, generate (default: all, "
                       "in this order).")]
              = None,
              out: Annotated[Path, typer.Option(help="Folder for the JSON, logs and curves.")] =
              layout.BENCH / "gpu",
              work: Annotated[Path | None, typer.Option(
                  help="Scratch folder for the pretrain step's data and model (default: a new temp folder).")]
              = None,
              pack: Annotated[Path | None, typer.Option(
                  help="Also archive --out into this .tgz after every step (what a cut-off run returns).")]
              = None):
    """The GPU session's whole measurement in one command, the headline first: the compiled training step with
    torch's kernels and kiln's, then the kernel benchmarks, native kernel tests, a real pretrain run of the GPT-2
    124M shape and generation; exits 1 if any step failed."""
    from kiln.pipeline.tools.bench_gpu import bench_gpu as run

    summary = run(size, steps.split(",") if steps else None, out, work, pack)
    if any(step["status"] != "ok" for step in summary["steps"]):
        raise typer.Exit(1)


@convert_app.command("from-hf")
@reports_errors
def convert_from_hf(
        src: Annotated[str, typer.Argument(help="An HF model folder (config.json + safetensors), or a hub id to "
                                                "download.")],
        out: Annotated[Path, typer.Argument(help="The kiln model folder to write (replaced whole).")]):
    """Convert a GPT2LMHeadModel or LlamaForCausalLM into a kiln model folder (with its tokenizer.json, if any),
    refusing any setting kiln's model would not compute exactly."""
    from kiln.pipeline.tools.convert import from_hf

    from_hf(src, out)


@convert_app.command("to-hf")
@reports_errors
def convert_to_hf(
        model: Annotated[Path, typer.Argument(help="A kiln model folder (config.json + model.safetensors).")],
        out: Annotated[Path, typer.Argument(help="The transformers folder to write (replaced whole).")],
        tokenizer: Annotated[Path | None, typer.Option(help="The model's tokenizer.json (default: MODEL/tokenizer.json "
                                                            "if there, else data/tokenizer/tokenizer.json).")] = None,
        adapter: Annotated[bool, typer.Option("--adapter", help="For a model trained with a LoRA/QLoRA adapter: write "
                                                                "the model it was trained on, and OUT/adapter/ in "
                                                                "PEFT's format.")] = False):
    """Convert a kiln model into a folder that transformers' AutoModelForCausalLM and AutoTokenizer load."""
    from kiln.pipeline.tools.convert import to_hf

    if tokenizer is None:
        tokenizer = model / "tokenizer.json" if (model / "tokenizer.json").is_file() else layout.TOKENIZER
    to_hf(model, out, tokenizer, adapter)


def _is_utf8(data: bytes) -> bool:
    try:
        data.decode()
        return True
    except UnicodeDecodeError:
        return False


def _train_stage(stage: str, train, run) -> None:
    """Run a training stage's `run()`: with `train.nproc_per_node` > 1 and no launcher around this process, under
    torchrun on this machine instead; the process group is left however it ends, and rank 0 alone prints."""
    from kiln.pipeline import runtime
    from kiln.pipeline.train import distributed

    if train.nproc_per_node > 1 and not runtime.launched():
        raise typer.Exit(distributed.relaunch(train.nproc_per_node, sys.argv[1:]))
    try:
        metrics = run()
    finally:
        runtime.leave()
    if runtime.from_env().main:
        _print_metrics(stage, metrics)


def _print_metrics(stage: str, metrics: dict) -> None:
    console.print(f"{stage}: " + ", ".join(f"{k}={v}" for k, v in metrics.items()), highlight=False)


def main() -> None:
    app()


if __name__ == "__main__":  # `python -m kiln.pipeline.cli`, as torchrun starts it
    main()
