"""`kiln bench serve`: the serving engine against static batching on the same requests, in one run.

Workload: N requests arriving as a Poisson process at `--rate` requests per second (0: all at once), prompt
lengths uniform from 8 to half the context, output lengths geometric with a mean of an eighth of the context
(`--output-lengths geometric`, capped by the room the prompt leaves) or uniform from 4 to a quarter of it
(`uniform`). Geometric is what a model that ends its answer with a fixed chance at every token produces, and
it has the long tail of real chat traffic (a few answers many times the mean), which is what batching
strategies differ on; uniform is the kinder case for static batching. Every output runs its drawn length
(greedy, no stop tokens), so each variant computes the same tokens. Per variant: output tokens per second over
the whole run (first arrival to last token), time to first token and inter-token latency (p50, p99, from each
token's wall-clock time), and the KV cache held.

- static: `model/generate.py`'s batched path (what `kiln generate` ran before the engine). Whatever has arrived
  when a batch starts (up to `--batch` requests, and only while the longest prompt plus the longest output fit
  the context) runs as one left-padded batch for as many steps as its longest output; newcomers wait for the
  whole batch, and the cache holds batch x (longest prompt + longest output) slots throughout.
- engine: continuous batching over the paged cache (`pipeline/serve/engine.py`); arrivals join at the next
  step, finished requests leave at once.
- prefix caching: a second workload whose prompts all open with the same system prompt (half the context),
  run by the engine with prefix caching off and on: the prefill tokens computed, and the speed.
- batch 1: 8 requests one after another, each answering at length (half a context, or the room its prompt
  leaves), on an engine whose cache holds one context; with `--draft` (a model with the same vocabulary) also with speculative decoding (`--speculate`
  tokens a step), with the draft's acceptance rate.
- rollouts: GRPO's shape (64 prompts x 8 completions at temperature 1) by the batched generator and by the
  engine, a group as one request and its forks; on the torch attention path also without its cascade (the
  groups' shared prompts then gathered for every row, and nothing grouped on the host).
- transformers: `generate` of the model exported as `kiln convert to-hf` would (the same config and tensor
  mapping), one request at a time, when transformers is installed.

Weights are random unless `--model` names a trained folder (`--draft` then defaults to none): speed does not
depend on them, but a draft's acceptance does, so speculative numbers mean something only for trained pairs.
"""

from __future__ import annotations

import copy
import math
import statistics
import time
from pathlib import Path

import numpy as np
import torch
from rich.table import Table

from kiln.model.checkpoint import load_model
from kiln.model.config import ModelConfig
from kiln.model.generate import decode_steps, generate, left_pad
from kiln.model.gpt import GPT
from kiln.model.quantize import check_quantize, quantize
from kiln.pipeline.errors import UserError
from kiln.pipeline.outputs import write_json
from kiln.pipeline.progress import console
from kiln.pipeline.serve.engine import Engine
from kiln.pipeline.serve.graphs import GRAPH_BATCH
from kiln.pipeline.serve.request import Request, SamplingParams, fork_groups
from kiln.pipeline.tools.bench_http import run_http
from kiln.pipeline.tools.machine import machine
from kiln.pipeline.tools.serve_workload import OUTPUT_LENGTHS, Workload, percentile, workload

ROLLOUT_PROMPTS, ROLLOUT_GROUP = 64, 8  # the GRPO-shaped row: prompts x completions of each


def summarise(name: str, load: Workload, times: list[list[float]], start: float, extra: dict) -> dict:
    """A row from each request's token times (seconds since `start`)."""
    ttft = [t[0] - a for t, a in zip(times, load.arrivals)]
    itl = [b - a for t in times for a, b in zip(t, t[1:])]
    tokens = sum(len(t) for t in times)
    span = max(t[-1] for t in times) - min(load.arrivals)
    return {"variant": name, "requests": len(times), "output_tokens": tokens,
            "output_tokens_per_s": round(tokens / span, 1), "seconds": round(span, 3),
            "ttft_p50_ms": round(1e3 * percentile(ttft, 50), 2), "ttft_p99_ms": round(1e3 * percentile(ttft, 99), 2),
            "itl_p50_ms": round(1e3 * percentile(itl, 50), 2), "itl_p99_ms": round(1e3 * percentile(itl, 99), 2),
            **extra}


def run_static(model: GPT, load: Workload, batch: int) -> dict:
    """Arrival-order batches of whatever has arrived, each run to its longest output."""
    device = next(model.parameters()).device
    times: list[list[float]] = [[] for _ in load.prompts]
    start, pending, peak_slots = time.perf_counter(), list(range(len(load.prompts))), 0
    context = model.config.max_seq_len
    with torch.inference_mode():
        while pending:
            now = time.perf_counter() - start
            if load.arrivals[pending[0]] > now:
                time.sleep(load.arrivals[pending[0]] - now)
                now = time.perf_counter() - start
            group = []  # what has arrived, in order, while the batch's padded prompt + longest output fit
            for i in pending:
                members = group + [i]
                fits = max(len(load.prompts[j]) for j in members) + max(load.outputs[j] for j in members) - 1 <= context
                if len(group) == batch or load.arrivals[i] > now or not fits:
                    break
                group.append(i)
            pending = pending[len(group):]
            steps = max(load.outputs[i] for i in group)
            x, pad = left_pad([load.prompts[i] for i in group], device)
            peak_slots = max(peak_slots, len(group) * (x.size(1) + steps - 1))
            for step, _ in enumerate(decode_steps(model, x, pad, steps, 0.0, None, None, [], None)):
                stamp = time.perf_counter() - start
                for i in group:
                    if step < load.outputs[i]:
                        times[i].append(stamp)
    return summarise("static batching", load, times, start, {"kv_slots_peak": peak_slots})


def run_engine(model: GPT, load: Workload, name: str, blocks: int, block_size: int, budget: int,
               prefix_caching: bool = True, draft: GPT | None = None, speculate: int = 4, temperature: float = 0.0,
               seed: int = 0, graph_batch: int = GRAPH_BATCH) -> dict:
    """The engine, with requests added as their arrival time passes (request i sampled with seed + i)."""
    engine = Engine(model, blocks, block_size, budget, prefix_caching=prefix_caching, draft=draft,
                    speculate=speculate, graph_batch=graph_batch)
    requests = [Request(p, SamplingParams(max_tokens=n, temperature=temperature, seed=seed + i))
                for i, (p, n) in enumerate(zip(load.prompts, load.outputs))]
    index = {id(r): i for i, r in enumerate(requests)}
    times: list[list[float]] = [[] for _ in requests]
    engine.runner.timing = True
    start, added, peak_blocks, over, steps, step_seconds = time.perf_counter(), 0, 0, 0, 0, 0.0
    while added < len(requests) or engine.has_work():
        now = time.perf_counter() - start
        if not engine.has_work() and load.arrivals[added] > now:
            time.sleep(load.arrivals[added] - now)
            now = time.perf_counter() - start
        while added < len(requests) and load.arrivals[added] <= now:
            engine.add(requests[added])
            added += 1
        events = engine.step()
        stamp = time.perf_counter() - start
        steps += 1
        step_seconds += stamp - now
        for request, _ in events:
            times[index[id(request)]].append(stamp)
        peak_blocks = max(peak_blocks, engine.pool.in_use())
        # KV held beyond one block per running sequence of the tokens it holds (0 is the goal)
        held = sum(engine.pool.blocks_for(r.length) for r in engine.scheduler.running)
        over = max(over, engine.pool.in_use() - held)
    extra = {"kv_blocks_peak": peak_blocks, "kv_slots_peak": peak_blocks * block_size,
             "kv_blocks_over_need": over, "prefill_tokens": engine.scheduler.prefill_tokens,
             "preemptions": engine.scheduler.preemptions, **step_costs(engine, steps, step_seconds)}
    if draft is not None:
        extra["acceptance_rate"] = round(engine.scheduler.accepted / max(engine.scheduler.drafted, 1), 4)
    return summarise(name, load, times, start, extra)


def step_costs(engine: Engine, steps: int, seconds: float) -> dict:
    """What a step costs beside the device's work: host microseconds (a step's wall time less its forward,
    sampling and the forks' block copies, and the adding of requests) and the copies to the device and reads
    back."""
    costs = {"steps": steps,
             "host_us_per_step": round(1e6 * (seconds - engine.runner.device_seconds) / max(steps, 1), 1),
             "copies_per_step": round((engine.cache.transfer.uploads + engine.runner.reads) / max(steps, 1), 3)}
    if engine.runner.graphs is not None:  # on CUDA: the decode steps that replayed a graph
        costs["graph_steps"] = engine.runner.graphs.steps
    return costs


def run_rollouts(model: GPT, prompts: list[list[int]], group: int, new_tokens: int, stops: tuple[int, ...],
                 seed: int) -> list[dict]:
    """GRPO-shaped work: `group` completions of each prompt at temperature 1, ending at a stop id or new_tokens,
    by the batched generator (every row in one left-padded batch, each prefilling its prompt) and by the engine
    (a group as one request and its forks, as GRPO has it: a prompt computed once). Completion tokens/s each."""
    rows = [p for p in prompts for _ in range(group)]
    out = []
    forwards = []  # the generator's model calls: its steps, to set beside the engine's
    hook = model.register_forward_hook(lambda *_: forwards.append(1))
    start = time.perf_counter()
    try:
        with torch.inference_mode():
            done = generate(model, rows, new_tokens, temperature=1.0, stop_ids=stops, seed=seed)
    finally:
        hook.remove()
    seconds = time.perf_counter() - start
    tokens = sum(map(len, done))
    out.append({"variant": f"rollouts {len(prompts)} x {group}: batched generator", "requests": len(rows),
                "output_tokens": tokens, "output_tokens_per_s": round(tokens / seconds, 1),
                "seconds": round(seconds, 3), "steps": len(forwards)})
    # the torch attention path runs the rollouts twice: with its cascade (the shared prompts read once, grouped
    # on the host every step) and without, what the cascade costs the host and saves the device
    for cascade in (True, False):
        requests = [Request(p, SamplingParams(new_tokens, 1.0, seed=seed + j, stop_ids=stops))
                    for j, p in enumerate(rows)]
        heads = fork_groups(requests, group)  # a group is one request and its forks, as GRPO samples
        engine = Engine.sized_for(model, heads, cascade=cascade)
        engine.runner.timing = True
        start, steps = time.perf_counter(), 0
        for request in heads:
            engine.add(request)
        while engine.has_work():
            engine.step()
            steps += 1
        seconds = time.perf_counter() - start
        tokens = sum(len(r.output) for r in requests)
        out.append({"variant": f"rollouts {len(prompts)} x {group}: engine{'' if cascade else ', no cascade'}",
                    "requests": len(rows), "output_tokens": tokens, "output_tokens_per_s": round(tokens / seconds, 1),
                    "seconds": round(seconds, 3), "prefill_tokens": engine.scheduler.prefill_tokens,
                    "speedup_vs_generator": round(tokens / seconds / out[0]["output_tokens_per_s"], 3),
                    **step_costs(engine, steps, seconds)})
        if engine.cache.triton:  # the paged kernel has no cascade to turn off
            break
    return out


def run_transformers(model: GPT, load: Workload) -> dict:
    """transformers' generate, one request at a time, on the model as `kiln convert to-hf` exports it."""
    import transformers

    from kiln.model.hf import hf_config, to_hf_tensors

    config = model.config
    hf = hf_config(config, {"bos_token_id": None, "eos_token_id": None, "pad_token_id": None})
    kind = transformers.LlamaForCausalLM if config.arch == "llama" else transformers.GPT2LMHeadModel
    hf_model = kind(kind.config_class(**{k: v for k, v in hf.items() if k != "architectures"}))
    hf_model.load_state_dict(to_hf_tensors(model.state_dict(), config), strict=False)
    hf_model.eval().to(next(model.parameters()).device)
    times: list[list[float]] = [[] for _ in load.prompts]
    start = time.perf_counter()
    with torch.inference_mode():
        for i, (prompt, n) in enumerate(zip(load.prompts, load.outputs)):
            now = time.perf_counter() - start
            if load.arrivals[i] > now:
                time.sleep(load.arrivals[i] - now)
            ids = torch.tensor([prompt], device=hf_model.device)
            hf_model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
            stamp = time.perf_counter() - start
            times[i] = [stamp] * n  # generate returns all at once: every token counts as arriving at the end
    return summarise("transformers generate (batch 1)", load, times, start, {})


def bench_serve(config: ModelConfig, model_dir: Path | None, draft_dir: Path | None, requests: int, rate: float,
                batch: int, block_size: int, budget: int, seed: int, device_name: str, out: Path,
                output_lengths: str = "geometric", speculate: int = 4, http: int = 0,
                tokenizer: Path | None = None, quantize_kinds: list[str] = ()) -> dict:
    """`quantize_kinds`: the loaded and batch-1 engine rows again with the model quantized so (TorchAO, as
    `kiln serve --quantize`), each against the original's."""
    if requests < 1 or batch < 1 or block_size < 1 or budget < 1 or speculate < 1 or not rate >= 0 or \
            math.isinf(rate) or http < 0:
        raise UserError(f"--requests {requests}, --batch {batch}, --block-size {block_size}, --max-batch-tokens "
                        f"{budget}, --speculate {speculate}, --rate {rate}: expected positive integers and a "
                        "finite rate >= 0")
    if output_lengths not in OUTPUT_LENGTHS:
        raise UserError(f"--output-lengths {output_lengths}: expected one of {', '.join(OUTPUT_LENGTHS)}")
    device = torch.device("cuda" if device_name == "auto" and torch.cuda.is_available() else
                          "cpu" if device_name == "auto" else device_name)
    for kind in quantize_kinds:
        check_quantize(kind, device)
    if model_dir is not None:
        model = load_model(model_dir, device)[0]
    else:
        torch.manual_seed(seed)
        model = GPT(config).to(device)
    model.eval()
    draft = load_model(draft_dir, device)[0].eval() if draft_dir is not None else None
    c = model.config
    # as much cache as static batching may hold at its largest (a full context per row): the engine gets no more
    blocks = math.ceil(batch * c.max_seq_len / block_size)
    mixed = workload(requests, rate, c, seed, output_lengths=output_lengths)
    system = c.max_seq_len // 2 - 8  # a shared system prompt of about half the context
    shared = workload(requests, rate, c, seed + 1, shared=system, output_lengths=output_lengths)
    rows = [run_static(model, mixed, batch),
            run_engine(model, mixed, "engine", blocks, block_size, budget)]
    rows[1]["speedup_vs_static"] = round(rows[1]["output_tokens_per_s"] / rows[0]["output_tokens_per_s"], 3)
    if device.type == "cuda":  # what the decode steps' CUDA graphs buy
        rows.append(run_engine(model, mixed, "engine, eager (no CUDA graphs)", blocks, block_size, budget,
                               graph_batch=0))
        rows[-1]["speedup_vs_static"] = round(rows[-1]["output_tokens_per_s"] / rows[0]["output_tokens_per_s"], 3)
    for caching in (False, True):
        rows.append(run_engine(model, shared, f"engine, shared prompt, prefix caching {'on' if caching else 'off'}",
                               blocks, block_size, budget, prefix_caching=caching))
    # what caching can save: the shared prompt's whole blocks (a block is shared only when full), as a share of
    # the prompt tokens
    prompt_tokens = sum(map(len, shared.prompts))
    rows[-1]["prefill_drop"] = round(1 - rows[-1]["prefill_tokens"] / rows[-2]["prefill_tokens"], 4)
    rows[-1]["shared_share"] = round(len(shared.prompts) * system / prompt_tokens, 4)
    rows[-1]["shared_whole_block_share"] = round(len(shared.prompts) * (system // block_size * block_size)
                                                 / prompt_tokens, 4)
    # batch 1: a few requests one after another, each answering at length (half a context, or the room its
    # prompt leaves), where decoding, what speculation speeds up, dominates over the prompt
    alone = workload(min(requests, 8), 0.0, c, seed + 2)
    alone.outputs = [min(c.max_seq_len // 2, c.max_seq_len + 1 - len(p)) for p in alone.prompts]
    # a cache of one full context, as transformers' grows to: zeroing the 256-row cache for every request would
    # time the allocation, not the decoding (a server allocates it once)
    one = math.ceil(c.max_seq_len / block_size)
    # Speculation is measured greedy and sampled at temperature 1: greedy keeps a draft token only when it is the
    # model's argmax, sampling keeps it with probability min(1, p/q), so the two accept at different rates.
    helpers = [("", None)] + ([(", speculative", draft)] if draft is not None else [])
    for temperature in (0.0, 1.0) if draft is not None else (0.0,):
        how = "" if temperature == 0 else f", temperature {temperature:g}"
        for name, helper in helpers:
            runs = [run_engine(model, subset(alone, i), "", one, block_size, budget, draft=helper,
                               speculate=speculate, temperature=temperature, seed=i) for i in range(len(alone.prompts))]
            rows.append(merge(runs, f"engine, batch 1{name}{how}"))
        if draft is not None:
            rows[-1]["speedup_vs_batch_1"] = round(rows[-1]["output_tokens_per_s"] / rows[-2]["output_tokens_per_s"],
                                                   3)
    if device.type == "cuda":
        rows.append(merge([run_engine(model, subset(alone, i), "", one, block_size, budget, seed=i, graph_batch=0)
                           for i in range(len(alone.prompts))], "engine, batch 1, eager (no CUDA graphs)"))
    loaded, single = rows[1], next(r for r in rows if r["variant"] == "engine, batch 1")
    for kind in quantize_kinds:  # the same workloads on the quantized model, each against the original's row
        quantized = quantize(copy.deepcopy(model), kind)
        rows.append(run_engine(quantized, mixed, f"engine, {kind}", blocks, block_size, budget))
        rows.append(merge([run_engine(quantized, subset(alone, i), "", one, block_size, budget, seed=i)
                           for i in range(len(alone.prompts))], f"engine, batch 1, {kind}"))
        for row, original in zip(rows[-2:], (loaded, single)):
            row["speedup_vs_original"] = round(row["output_tokens_per_s"] / original["output_tokens_per_s"], 3)
    # GRPO's shape: long prompts (passages), short completions, group_size 8; a stop id ends a completion with a
    # chance of 1/16 a token, so they end at different lengths
    rng = np.random.default_rng(seed + 3)
    new_tokens = max(1, c.max_seq_len // 8)
    passages = [rng.integers(0, c.vocab_size, rng.integers(c.max_seq_len // 2, c.max_seq_len + 2 - new_tokens))
                .tolist() for _ in range(ROLLOUT_PROMPTS)]
    stops = tuple(range(max(1, c.vocab_size // 16)))
    rows += run_rollouts(model, passages, ROLLOUT_GROUP, new_tokens, stops, seed)
    if http:  # through the real server: N streaming clients at once, against the engine called directly
        rows += run_http(model, model_dir, tokenizer, http, seed)
    missing = []
    try:
        rows.append(run_transformers(model, alone))
    except ImportError as e:
        missing.append(f"transformers: {e}")
    result = {"benchmark": "serve", "device": str(device), "machine": machine(), "model": c.to_dict(),
              "model_dir": None if model_dir is None else str(model_dir),
              "draft_dir": None if draft_dir is None else str(draft_dir), "requests": requests, "rate": rate,
              "output_lengths": output_lengths, "speculate": speculate, "batch": batch, "kv_blocks": blocks,
              "block_size": block_size, "max_batch_tokens": budget,
              "results": rows, "missing": missing}
    show(result)
    write_json(out, result)
    console.print(f"wrote {out}", highlight=False)
    return result


def subset(load: Workload, i: int) -> Workload:
    return Workload([0.0], [load.prompts[i]], [load.outputs[i]])


def merge(rows: list[dict], name: str) -> dict:
    """One row for requests run one after another: tokens over the summed time, latencies averaged."""
    tokens, seconds = sum(r["output_tokens"] for r in rows), sum(r["seconds"] for r in rows)
    out = {"variant": name, "requests": len(rows), "output_tokens": tokens,
           "output_tokens_per_s": round(tokens / seconds, 1), "seconds": round(seconds, 3)}
    for key in ("ttft_p50_ms", "itl_p50_ms", "acceptance_rate"):
        if key in rows[0]:
            out[key] = round(statistics.mean(r[key] for r in rows), 4)
    return out


def show(result: dict) -> None:
    table = Table(title=f"serving: {result['requests']} requests at {result['rate']}/s, "
                        f"{result['model']['n_layer']}x{result['model']['d_model']}, {result['device']}")
    for column in ("variant", "tok/s", "TTFT p50/p99 ms", "ITL p50/p99 ms", "KV slots peak", "notes"):
        table.add_column(column)
    for r in result["results"]:
        notes = [f"{k}={r[k]}" for k in ("speedup_vs_static", "speedup_vs_generator", "steps", "prefill_tokens",
                                         "prefill_drop", "shared_whole_block_share", "kv_blocks_over_need",
                                         "preemptions", "acceptance_rate", "speedup_vs_batch_1",
                                         "speedup_vs_original", "host_us_per_step",
                                         "errors", "http_vs_engine", "server_cpu_vs_engine",
                                         "copies_per_step") if k in r]
        table.add_row(r["variant"], f"{r['output_tokens_per_s']:,.1f}",
                      f"{r.get('ttft_p50_ms', float('nan'))}/{r.get('ttft_p99_ms', '-')}",
                      f"{r.get('itl_p50_ms', float('nan'))}/{r.get('itl_p99_ms', '-')}",
                      str(r.get("kv_slots_peak", "-")), ", ".join(notes))
    console.print(table)
    for line in result["missing"]:
        console.print(f"not run: {line}", highlight=False)
