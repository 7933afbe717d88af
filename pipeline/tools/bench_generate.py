"""`kiln bench generate`: prefill and decode tokens/s of `kiln.model.generate`, with and without the KV cache, for
batch 1 and a larger batch, in one run; with `--quantize`, each quantized kind beside the original: its speed, its
weight memory and what it costs in quality.

Each variant runs the generator that `kiln generate`, `kiln chat` and the eval samples use, greedily and without
stop tokens, so every row decodes the full length: the time to its first token is the prefill (one forward over
the prompts), the rest is the decode (one forward per new token). Without the cache a decode step recomputes the
whole sequence so far, so its cost grows with the position; the ratio to the cached run is the point of the
table. Weights are random unless `--model` names a trained folder: the cost of a forward does not depend on them.

The variants' timed calls are interleaved (every variant's first call, then every variant's second, ...), so a
machine that slows down for a while slows all of them alike; each row gives its median and the spread of its
calls, and a quantized row's speed against the original's also the spread of the per-call ratios (call r of
each side by side). Quality is measured on text the original model writes itself (QUALITY_ROWS rows sampled at
temperature 1 from one random token each, the bench's full length): on it, teacher-forced, each quantized
model's mean KL divergence from the original's next-token distributions, its NLL of the text less the
original's (what the quantization costs on the model's own text: KL's sampled estimate), its largest logit
difference and how often its top token is the original's. On random weights the logits are all near zero and
so are these figures: they mean something for a trained model (`--model`).

Only torch, rich and kiln's light modules are imported, so this runs on a GPU machine without the data stack.
"""

from __future__ import annotations

import copy
import statistics
import time
from pathlib import Path

import torch
from rich.table import Table

from kiln.model.checkpoint import load_model
from kiln.model.generate import decode_steps, generate, left_pad
from kiln.model.gpt import GPT
from kiln.model.quantize import check_quantize, quantize, weight_bytes
from kiln.pipeline.errors import UserError
from kiln.pipeline.outputs import write_json
from kiln.pipeline.progress import Progress, console
from kiln.pipeline.tools.bench_train import resolve_device, synchronize
from kiln.pipeline.tools.machine import machine
from kiln.pipeline.train.params import ModelParams

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
QUALITY_ROWS = 4


def time_generation(model: GPT, batch_size: int, prompt_len: int, new_tokens: int, cache: bool, seed: int) -> dict:
    """Seconds to the first new token (prefill) and for the remaining new_tokens - 1 (decode) of one call."""
    device = next(model.parameters()).device
    generator = torch.Generator().manual_seed(seed)
    prompts = torch.randint(model.config.vocab_size, (batch_size, prompt_len), generator=generator).tolist()
    x, pad = left_pad(prompts, device)
    with torch.inference_mode():
        synchronize(device)
        start = time.perf_counter()
        steps = decode_steps(model, x, pad, new_tokens, 0.0, None, None, [], None, cache)
        next(steps)
        synchronize(device)
        first = time.perf_counter()
        produced = 1 + sum(1 for _ in steps)
        synchronize(device)
        end = time.perf_counter()
    if produced != new_tokens:
        raise AssertionError(f"generated {produced} tokens, expected {new_tokens}")
    return {"prefill_s": first - start, "decode_s": end - first}


def quality(original: GPT, quantized: GPT, text: torch.Tensor) -> dict:
    """What `quantized` changes in `original`'s predictions of `text` (B, T), teacher-forced: mean KL divergence
    (original || quantized) and NLL difference in nats per token, the largest logit difference, top-1 agreement.
    A row at a time: a GPT-2 vocabulary's float64 logits are 0.3 GB a row of a thousand tokens."""
    kl, nll, top1, largest = [], [], [], 0.0
    for row in text:
        with torch.inference_mode():
            # float64: the two distributions differ by little, and KL's float32 sums would round below zero
            want, got = original(row[None, :-1])[0].double(), quantized(row[None, :-1])[0].double()
        p, q = want.log_softmax(-1), got.log_softmax(-1)
        kl.append((p.exp() * (p - q)).sum(-1))
        nll.append((p - q).gather(-1, row[1:, None])[:, 0])
        top1.append(got.argmax(-1) == want.argmax(-1))
        largest = max(largest, (got - want).abs().max().item())
    return {"kl_vs_original": torch.cat(kl).mean().item(), "nll_delta": torch.cat(nll).mean().item(),
            "max_logit_diff": largest, "top1_agreement": torch.cat(top1).float().mean().item()}


def spread(values: list[float]) -> list[float]:
    return [min(values), max(values)]


def seconds(run: dict) -> float:
    return run["decode_s"]


def bench_generate(model_params: ModelParams, model_dir: Path | None, vocab_size: int, batch_sizes: list[int],
                   prompt_len: int | None, new_tokens: int | None, repeats: int, dtype: str, device_name: str,
                   out: Path, quantize_kinds: list[str] = ()) -> dict:
    """`quantize_kinds`: cached rows of the model quantized so (`kiln generate --quantize`) beside the original's,
    and a table of what each kind costs and buys."""
    device = resolve_device(device_name)
    if dtype not in DTYPES:
        raise UserError(f"--dtype {dtype!r}: expected one of {', '.join(DTYPES)}")
    for kind in quantize_kinds:
        check_quantize(kind, device)
    if model_dir is not None:
        try:
            model, _ = load_model(model_dir, device)
        except ValueError as e:
            raise UserError(str(e)) from None
    else:
        torch.manual_seed(0)
        model = GPT(model_params.config(vocab_size)).to(device)
    model = model.to(DTYPES[dtype]).eval()
    context = model.config.max_seq_len
    prompt_len = context // 2 if prompt_len is None else prompt_len
    new_tokens = context - prompt_len + 1 if new_tokens is None else new_tokens
    for option, value in (("--repeats", repeats), ("--prompt-len", prompt_len), ("--new-tokens", new_tokens),
                          *(("--batch-sizes", b) for b in batch_sizes)):
        if value < 1:
            raise UserError(f"{option} {value}: expected a positive integer")
    if new_tokens < 2 or prompt_len + new_tokens - 1 > context:
        raise UserError(f"--prompt-len {prompt_len} + --new-tokens {new_tokens} - 1: expected at least 2 new tokens "
                        f"and at most max_seq_len={context} in all")

    models = {None: model} | {kind: quantize(copy.deepcopy(model), kind) for kind in quantize_kinds}
    variants = [(b, cache, None) for b in batch_sizes for cache in (True, False)] + \
        [(b, True, kind) for kind in quantize_kinds for b in batch_sizes]
    runs: dict[tuple, list[dict]] = {v: [] for v in variants}
    with Progress("bench generate", unit="runs", total=len(variants) * (repeats + 1)) as progress:
        for batch_size, cache, kind in variants:  # warm-up
            progress.advance(0, variant=name(batch_size, cache, kind))
            time_generation(models[kind], batch_size, prompt_len, min(new_tokens, 4), cache, seed=0)
            progress.advance(1)
        for r in range(repeats):
            for variant in variants:
                progress.advance(0, variant=f"{name(*variant)}, call {r + 1}")
                runs[variant].append(time_generation(models[variant[2]], variant[0], prompt_len, new_tokens,
                                                     variant[1], seed=r))
                progress.advance(1)

    rows = []
    for (batch_size, cache, kind), timed in runs.items():
        prefill = statistics.median(run["prefill_s"] for run in timed)
        decode = statistics.median(run["decode_s"] for run in timed)
        rows.append({"variant": name(batch_size, cache, kind), "batch_size": batch_size, "cache": cache,
                     "quantize": kind, "prefill_ms": round(prefill * 1e3, 3),
                     "prefill_tokens_per_s": round(batch_size * prompt_len / prefill, 1),
                     "decode_ms_per_token": round(decode / (new_tokens - 1) * 1e3, 3),
                     "decode_tokens_per_s": round(batch_size * (new_tokens - 1) / decode, 1),
                     "decode_tokens_per_s_spread": [round(batch_size * (new_tokens - 1) / run["decode_s"], 1)
                                                    for run in (max(timed, key=seconds), min(timed, key=seconds))]})
    for row in rows:
        uncached = next(r for r in rows if r["batch_size"] == row["batch_size"] and not r["cache"])
        row["decode_speedup_vs_no_cache"] = round(row["decode_tokens_per_s"] / uncached["decode_tokens_per_s"], 2)
        if row["quantize"]:  # against the original model's cached row of the same batch, and call by call
            original = next(r for r in rows if r["batch_size"] == row["batch_size"] and r["cache"]
                            and not r["quantize"])
            row["decode_speedup_vs_original"] = round(row["decode_tokens_per_s"] / original["decode_tokens_per_s"], 3)
            paired = [a["decode_s"] / b["decode_s"] for a, b in zip(runs[row["batch_size"], True, None],
                                                                    runs[row["batch_size"], True, row["quantize"]])]
            row["decode_speedup_vs_original_spread"] = [round(x, 3) for x in spread(paired)]
    kinds = compare_kinds(models, rows, batch_sizes[0], prompt_len + new_tokens - 1) if quantize_kinds else []

    c = model.config
    device_label = torch.cuda.get_device_name(device) if device.type == "cuda" else machine()["processor"]
    threads = f", {torch.get_num_threads()} threads" if device.type == "cpu" else ""
    table = Table(title=f"generation: {c.arch} {c.n_layer}x{c.d_model}, {model.num_params() / 1e6:.2f}M params, "
                        f"{dtype}, prompt {prompt_len} + {new_tokens} new tokens, median of {repeats} interleaved "
                        f"calls, {device.type} ({device_label}){threads}")
    for col in ("variant", "prefill ms", "prefill tok/s", "decode ms/token", "decode tok/s", "(slowest-fastest)",
                "cache speedup", "vs original (per call)"):
        table.add_column(col)
    for row in rows:
        low, high = row["decode_tokens_per_s_spread"]
        table.add_row(row["variant"], f"{row['prefill_ms']:.1f}", f"{row['prefill_tokens_per_s']:,.0f}",
                      f"{row['decode_ms_per_token']:.2f}", f"{row['decode_tokens_per_s']:,.0f}",
                      f"{low:,.0f}-{high:,.0f}", f"{row['decode_speedup_vs_no_cache']:.2f}x",
                      "{:.2f}x ({:.2f}-{:.2f})".format(row["decode_speedup_vs_original"],
                                                       *row["decode_speedup_vs_original_spread"])
                      if row["quantize"] else "-")
    console.print(table)
    if kinds:
        print_kinds(kinds, dtype, batch_sizes[0], model_dir is None)
    result = {"benchmark": "generate", "device": device.type, "device_name": device_label, "torch": torch.__version__,
              "threads": torch.get_num_threads(), "machine": machine(), "model": c.to_dict(),
              "model_dir": None if model_dir is None else str(model_dir), "params": model.num_params(),
              "dtype": dtype, "prompt_len": prompt_len, "new_tokens": new_tokens, "repeats": repeats,
              "results": rows, "quantize": kinds}
    write_json(out, result)
    console.print(f"wrote {out}", highlight=False)
    return result


def name(batch_size: int, cache: bool, kind: str | None) -> str:
    return f"batch {batch_size}, {'cache' if cache else 'no cache'}" + (f", {kind}" if kind else "")


def compare_kinds(models: dict, rows: list[dict], batch_size: int, length: int) -> list[dict]:
    """Per kind (None: the original): its weight bytes, its cached decode rate at `batch_size`, and its quality
    on QUALITY_ROWS sequences of `length` tokens that the original samples."""
    original = models[None]
    device = next(original.parameters()).device
    starts = torch.randint(original.config.vocab_size, (QUALITY_ROWS, 1), generator=torch.Generator().manual_seed(0))
    sampled = generate(original, starts.tolist(), length - 1, temperature=1.0, seed=0)
    text = torch.cat([starts, torch.tensor(sampled)], dim=1).to(device)
    kinds = []
    for kind, m in models.items():
        row = next(r for r in rows if r["batch_size"] == batch_size and r["cache"] and r["quantize"] == kind)
        entry = {"quantize": kind, **weight_bytes(m), "batch_size": batch_size,
                 "decode_tokens_per_s": row["decode_tokens_per_s"],
                 "decode_tokens_per_s_spread": row["decode_tokens_per_s_spread"]}
        if kind is not None:
            entry |= {"decode_speedup_vs_original": row["decode_speedup_vs_original"],
                      "decode_speedup_vs_original_spread": row["decode_speedup_vs_original_spread"],
                      **{k: float(f"{v:.4g}") for k, v in quality(original, m, text).items()}}
        kinds.append(entry)
    return kinds


def print_kinds(kinds: list[dict], dtype: str, batch_size: int, random_weights: bool) -> None:
    table = Table(title=f"what each kind costs and buys: the blocks' linear weights, batch-{batch_size} decode, and "
                        f"its predictions against the original's on {QUALITY_ROWS} sequences the original sampled"
                        + (" (random weights: the quality figures are near zero; --model for a trained one)"
                           if random_weights else ""))
    for col in ("weights", "linear MB", "model MB", "decode tok/s", "vs original (per call)", "KL nats/token",
                "NLL delta", "max |logit diff|", "top-1 agree"):
        table.add_column(col)
    for k in kinds:
        low, high = k.get("decode_speedup_vs_original_spread", (1.0, 1.0))
        q = k["quantize"] is not None
        table.add_row(k["quantize"] or dtype, f"{k['linear_bytes'] / 1e6:.2f}", f"{k['model_bytes'] / 1e6:.2f}",
                      f"{k['decode_tokens_per_s']:,.0f}",
                      f"{k['decode_speedup_vs_original']:.2f}x ({low:.2f}-{high:.2f})" if q else "-",
                      f"{k['kl_vs_original']:.2e}" if q else "-", f"{k['nll_delta']:+.2e}" if q else "-",
                      f"{k['max_logit_diff']:.3g}" if q else "-", f"{k['top1_agreement']:.1%}" if q else "-")
    console.print(table)
