"""`kiln bench`: benchmarks that print a table and write JSON.

Their results go to metrics/bench/ (layout.BENCH), committed on purpose: there a named output may replace what is
tracked. Anywhere else an output path the user names goes through the rule of pipeline/protected.py."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from kiln.pipeline import layout
from kiln.pipeline.commands.shared import CorpusOpt, ParamsOpt, SetOpt, TokenizerOpt, reports_errors, writes

app = typer.Typer(help="Benchmarks that print a table and write JSON.", no_args_is_help=True)


@app.command("shard")
@reports_errors
@writes(layout.BENCH, out=False)
def bench_shard(corpus: CorpusOpt = layout.CORPUS, tokenizer: TokenizerOpt = layout.TOKENIZER,
                split: str = "train",
                max_mb: Annotated[float, typer.Option(help="Encode at most this many MB of text.")] = 8.0,
                out: Annotated[Path, typer.Option(help="Where to write the JSON results.")] =
                layout.BENCH / "shard.json"):
    """Sharding throughput against a single-process loop over HF `Tokenizer.encode`, in one run."""
    from kiln.pipeline.tools.bench_shard import bench_shard as run

    run(corpus, tokenizer, split, max_mb, out)


@app.command("data")
@reports_errors
@writes(layout.BENCH, out=False)
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


@app.command("train")
@reports_errors
@writes(layout.BENCH, out=False, profile=True)
def bench_train(params: ParamsOpt = layout.PARAMS, set_: SetOpt = [],
                variants: Annotated[str, typer.Option(
                    help="Comma-separated PRECISION-MODE[-KERNELS[:OP+OP...]] list: PRECISION "
                         "fp32|bf16|fp16|fp8|fp8rowwise (fp8: tensorwise scales), MODE eager|compile, KERNELS "
                         "auto|triton|torch (default: --kernels), OPs the ones that take "
                         "KERNELS (some of norm, mlp, attention, head; the rest run torch's; default all), e.g. "
                         "bf16-compile-triton:head. Rows run in this order, "
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
                top_ops: Annotated[bool, typer.Option(
                    help="Profile 3 more steps per variant and keep its top operators by self device time (GPU "
                         "kernels on CUDA) in the JSON and the table, without writing traces.")] = False,
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
        plan_batch, device_gb, top_ops)


def parse_kinds(text: str) -> list[str]:
    """--quantize 'int8,fp8' -> ["int8", "fp8"] ('' none), each a kind `kiln serve --quantize` takes."""
    from kiln.model.quantize import KINDS

    kinds = list(dict.fromkeys(k.strip() for k in text.split(",") if k.strip()))
    for kind in kinds:
        if kind not in KINDS:
            raise typer.BadParameter(f"{kind!r}: expected some of {', '.join(KINDS)}", param_hint="--quantize")
    return kinds


@app.command("post")
@reports_errors
@writes(layout.BENCH, out=False)
def bench_post(data: Annotated[list[str], typer.Option(
                   help="A chat data file or hf:<dataset> in any of SFT's formats (or GSM8K's question/answer); "
                        "repeat for several, e.g. the shared Dolly/HH-RLHF, GSM8K and Alpaca files.")],
               params: ParamsOpt = layout.PARAMS, set_: SetOpt = [], tokenizer: TokenizerOpt = layout.TOKENIZER,
               seq_len: Annotated[int, typer.Option(help="Context the examples are rendered and trained at.")]
               = 1024,
               batch_size: Annotated[int, typer.Option(help="Rows per micro-batch.")] = 8,
               steps: Annotated[int, typer.Option(help="Timed micro-batches per layout.")] = 20,
               warmup: Annotated[int, typer.Option(help="Untimed micro-batches before them.")] = 2,
               check: Annotated[int, typer.Option(help="Examples whose summed loss each layout must agree on.")]
               = 64,
               max_examples: Annotated[int | None, typer.Option(help="Rows to keep of each --data.")] = None,
               group_size: Annotated[int, typer.Option(help="GRPO rows: completions per prompt.")] = 8,
               completion_tokens: Annotated[int, typer.Option(help="GRPO rows: a completion's most tokens.")] = 64,
               repeats: Annotated[int, typer.Option(help="Times each layout is timed, taking turns with the "
                                                         "other; the median is reported, every ratio kept.")] = 3,
               device: Annotated[str, typer.Option(help="auto (cuda, then mps, then cpu), cpu, cuda, cuda:N or mps.")]
               = "auto",
               out: Annotated[Path, typer.Option(help="Where to write the JSON results.")] =
               layout.BENCH / "post.json"):
    """SFT's padded rows against its packed rows (sft.packing) on real chat data: non-pad tokens/s, the rows' fill
    and peak memory side by side in one run, each layout training a copy of the same model (the `model` section's
    shape at --seq-len), after checking both give the same summed loss on the same examples; and GRPO's training
    pass on groups of completions of the data's prompts, a row per completion against a row per group."""
    from kiln.pipeline.config import load_section
    from kiln.pipeline.tools.bench_post import bench_post as run
    from kiln.pipeline.train.params import ModelParams

    run(load_section(ModelParams, params, set_), data, tokenizer, seq_len, batch_size, steps, warmup, check,
        max_examples, device, out, group_size, completion_tokens, repeats)


@app.command("structured")
@reports_errors
@writes(layout.BENCH, out=False)
def bench_structured(model: Annotated[Path, typer.Option(help="A chat model folder (SFT, DPO or GRPO).")] =
                     layout.SFT_MODEL, tokenizer: TokenizerOpt = layout.TOKENIZER,
                     schemas: Annotated[int, typer.Option(help="Random JSON schemas asked for.")] = 50,
                     n: Annotated[int, typer.Option(help="Samples of each, at temperature 1.")] = 4,
                     concurrent: Annotated[int, typer.Option(help="Requests at once in the load rows.")] = 64,
                     constrained: Annotated[int, typer.Option(help="Of them, following a schema.")] = 16,
                     max_tokens: Annotated[int | None, typer.Option(
                         help="A request's most tokens (default and at most: the context's room).")] = None,
                     repeats: Annotated[int, typer.Option(help="Times each load row runs, taking turns.")] = 3,
                     seed: Annotated[int, typer.Option(help="Schemas and sampling.")] = 0,
                     device: Annotated[str, typer.Option(help="auto | cpu | cuda")] = "auto",
                     out: Annotated[Path, typer.Option(help="Where to write the JSON results.")] =
                     layout.BENCH / "structured.json"):
    """Structured outputs on a trained chat model: the share of outputs that parse and validate over random JSON
    schemas at temperature 1, compile times, and loaded throughput with a share of the requests constrained
    against none, in one run."""
    from kiln.pipeline.tools.bench_structured import bench_structured as run

    run(model, tokenizer, schemas, n, concurrent, constrained, max_tokens, repeats, seed, device, out)


@app.command("generate")
@reports_errors
@writes(layout.BENCH, out=False)
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
                   quantize: Annotated[str, typer.Option(
                       help="Comma-separated quantization kinds (int8, int4, fp8) for cached rows of the model quantized "
                            "so, beside the original's (kiln generate --quantize).")] = "",
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
        device, out, parse_kinds(quantize))


@app.command("serve")
@reports_errors
@writes(layout.BENCH, out=False)
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
                http: Annotated[int, typer.Option(help="Also this many concurrent streaming clients through a real "
                                                       "`kiln serve` (the openai package's async client), "
                                                       "against the engine called directly (0: not run).")] = 0,
                tokenizer: TokenizerOpt = layout.TOKENIZER,
                quantize: Annotated[str, typer.Option(
                    help="Comma-separated quantization kinds (int8, int4, fp8): the loaded and batch-1 engine rows again "
                         "on the model quantized so (kiln serve --quantize), against the original's.")] = "",
                out: Annotated[Path, typer.Option(help="Where to write the JSON results.")] =
                layout.BENCH / "serve.json"):
    """Output tokens/s, time to first token and inter-token latency of the serving engine against static
    batching, prefix caching, speculative decoding at batch 1 and transformers' generate, in one run."""
    from kiln.pipeline.config import load_section
    from kiln.pipeline.tools.bench_serve import bench_serve as run
    from kiln.pipeline.train.params import ModelParams

    config = load_section(ModelParams, params, set_).config(vocab_size)
    run(config, model, draft, requests, rate, batch, block_size, max_batch_tokens, seed, device, out, output_lengths,
        speculate, http, tokenizer, parse_kinds(quantize))


@app.command("adapters")
@reports_errors
@writes(layout.BENCH, out=False)
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
    from kiln.pipeline.text.bpe import load_tokenizer
    from kiln.pipeline.tools.bench_adapters import bench_adapters as run
    from kiln.pipeline.tools.bench_adapters import default_shapes
    from kiln.pipeline.train.params import ModelParams

    model, sft = load_sections((ModelParams, SFTParams), params, set_)
    vocab = load_tokenizer(tokenizer).get_vocab_size() if tokenizer.is_file() else 1024
    run(default_shapes(model.config(vocab)), sft.lora_rank, sft.lora_alpha, sft.lora_targets, device, tokens, out)


@app.command("kernels")
@reports_errors
@writes(layout.BENCH, out=False)
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


@app.command("gpu")
@reports_errors
@writes(layout.BENCH, out=True, work=True, pack=False)
def bench_gpu(size: Annotated[str, typer.Option(
                  help="quick: every step but generate and grpo in one short pass (limits summing to 480 s); full: "
                       "every step, every shape of the issue and the train grid (split it with --steps to fit "
                       "10-minute calls); smoke: toy shapes on a CPU, to check the command works.")] = "quick",
              steps: Annotated[str | None, typer.Option(
                  help="Comma-separated subset of env, train, kernels, tests, pretrain, generate, serve, grpo "
                       "(default: the size's steps; run in this order; grpo starts from pretrain's model).")]
              = None,
              out: Annotated[Path, typer.Option(help="Folder for the JSON, logs and curves.")] =
              layout.BENCH / "gpu" / "new",
              work: Annotated[Path | None, typer.Option(
                  help="Scratch folder for the pretrain step's data and model (default: a new temp folder).")]
              = None,
              pack: Annotated[Path | None, typer.Option(
                  help="Also archive --out into this .tgz after every step (what a cut-off run returns).")]
              = None):
    """The GPU session's whole measurement in one command, the headline first: the compiled training step with
    torch's kernels and kiln's, then the kernel benchmarks, native kernel tests, a real pretrain run of the GPT-2
    124M shape, generation (full only) and serving; exits 1 if any step failed."""
    from kiln.pipeline.tools.bench_gpu import bench_gpu as run

    summary = run(size, steps.split(",") if steps else None, out, work, pack)
    if any(step["status"] != "ok" for step in summary["steps"]):
        raise typer.Exit(1)
