"""`kiln bench generate`: prefill and decode tokens/s of `kiln.model.generate`, with and without the KV cache, for
batch 1 and a larger batch, in one run.

Each variant runs the generator that `kiln generate`, `kiln chat` and the eval samples use, greedily and without
stop tokens, so every row decodes the full length: the time to its first token is the prefill (one forward over
the prompts), the rest is the decode (one forward per new token). Without the cache a decode step recomputes the
whole sequence so far, so its cost grows with the position; the ratio to the cached run is the point of the
table. Weights are random unless `--model` names a trained folder: the cost of a forward does not depend on them.

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
from kiln.model.generate import decode_steps, left_pad
from kiln.model.gpt import GPT
from kiln.model.quantize import check_quantize, quantize
from kiln.pipeline.errors import UserError
from kiln.pipeline.outputs import write_json
from kiln.pipeline.progress import Progress, console
from kiln.pipeline.tools.bench_train import resolve_device, synchronize
from kiln.pipeline.tools.machine import machine
from kiln.pipeline.train.params import ModelParams

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


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


def bench_generate(model_params: ModelParams, model_dir: Path | None, vocab_size: int, batch_sizes: list[int],
                   prompt_len: int | None, new_tokens: int | None, repeats: int, dtype: str, device_name: str,
                   out: Path, quantize_kinds: list[str] = ()) -> dict:
    """`quantize_kinds`: cached rows of the model quantized so (`kiln generate --quantize`) beside the original's."""
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

    rows = []
    models = {None: model} | {kind: quantize(copy.deepcopy(model), kind) for kind in quantize_kinds}
    variants = [(b, cache, None) for b in batch_sizes for cache in (True, False)] + \
        [(b, True, kind) for kind in quantize_kinds for b in batch_sizes]
    with Progress("bench generate", unit="runs", total=len(variants) * (repeats + 1)) as progress:
        for batch_size, cache, kind in variants:
            name = f"batch {batch_size}, {'cache' if cache else 'no cache'}" + (f", {kind}" if kind else "")
            progress.advance(0, variant=name)
            time_generation(models[kind], batch_size, prompt_len, min(new_tokens, 4), cache, seed=0)  # warm-up
            progress.advance(1)
            runs = []
            for r in range(repeats):
                runs.append(time_generation(models[kind], batch_size, prompt_len, new_tokens, cache, seed=r))
                progress.advance(1)
            prefill = statistics.median(run["prefill_s"] for run in runs)
            decode = statistics.median(run["decode_s"] for run in runs)
            rows.append({"variant": name, "batch_size": batch_size, "cache": cache, "quantize": kind,
                         "prefill_ms": round(prefill * 1e3, 3),
                         "prefill_tokens_per_s": round(batch_size * prompt_len / prefill, 1),
                         "decode_ms_per_token": round(decode / (new_tokens - 1) * 1e3, 3),
                         "decode_tokens_per_s": round(batch_size * (new_tokens - 1) / decode, 1)})
    for row in rows:
        uncached = next(r for r in rows if r["batch_size"] == row["batch_size"] and not r["cache"])
        row["decode_speedup_vs_no_cache"] = round(row["decode_tokens_per_s"] / uncached["decode_tokens_per_s"], 2)
        if row["quantize"]:  # against the original model's cached row of the same batch
            original = next(r for r in rows if r["batch_size"] == row["batch_size"] and r["cache"]
                            and not r["quantize"])
            row["decode_speedup_vs_original"] = round(row["decode_tokens_per_s"] / original["decode_tokens_per_s"], 3)

    c = model.config
    device_label = torch.cuda.get_device_name(device) if device.type == "cuda" else machine()["processor"]
    table = Table(title=f"generation: {c.arch} {c.n_layer}x{c.d_model}, {model.num_params() / 1e6:.2f}M params, "
                        f"{dtype}, prompt {prompt_len} + {new_tokens} new tokens, median of {repeats}, "
                        f"{device.type} ({device_label})"
                        + (f", {torch.get_num_threads()} threads" if device.type == "cpu" else ""))
    for col in ("variant", "prefill ms", "prefill tok/s", "decode ms/token", "decode tok/s", "cache speedup",
                "vs original"):
        table.add_column(col)
    for row in rows:
        table.add_row(row["variant"], f"{row['prefill_ms']:.1f}", f"{row['prefill_tokens_per_s']:,.0f}",
                      f"{row['decode_ms_per_token']:.2f}", f"{row['decode_tokens_per_s']:,.0f}",
                      f"{row['decode_speedup_vs_no_cache']:.2f}x",
                      f"{row['decode_speedup_vs_original']:.2f}x" if row["quantize"] else "-")
    console.print(table)
    result = {"benchmark": "generate", "device": device.type, "device_name": device_label, "torch": torch.__version__,
              "threads": torch.get_num_threads(), "machine": machine(), "model": c.to_dict(),
              "model_dir": None if model_dir is None else str(model_dir), "params": model.num_params(),
              "dtype": dtype, "prompt_len": prompt_len, "new_tokens": new_tokens, "repeats": repeats,
              "results": rows}
    write_json(out, result)
    console.print(f"wrote {out}", highlight=False)
    return result
