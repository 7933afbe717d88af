"""`kiln bench train`: tokens/s and MFU of one training step, fp32 vs bf16, eager vs torch.compile and torch vs
Triton kernels, in one run.

A step is the loop's own `Step` (what `kiln pretrain` runs) for one micro-batch without accumulation: forward
under autocast, backward, the loss read back for the NaN guard, gradient clipping and AdamW (fused on CUDA). The
batch is random token ids already on the device, so data loading is left out: the figure is what the model
and the step cost, the ceiling that training can reach. Every variant starts from a copy of the same initial
weights; the first variant is the baseline of the speedup column, so ratios come from one process and machine.
A compile variant's first step is reported as its compile time; torch's on-disk compile cache shortens it on a
rerun of the same shape (35 s cold, 4 s warm for the default shape on a 2-core CPU).

Only torch, rich and kiln's light modules are imported, so this runs on a GPU machine without the data stack
(dvc, datasets, tokenizers, tiktoken).
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import time
from pathlib import Path

import torch
from rich.table import Table

from kiln.kernels.backend import BACKENDS
from kiln.model import GPT
from kiln.pipeline.errors import StageError, UserError
from kiln.pipeline.outputs import write_json
from kiln.pipeline.progress import Progress, console
from kiln.pipeline.tools.bench import machine
from kiln.pipeline.train.lm import lm_loss
from kiln.pipeline.train.loop import PRECISIONS, Step, build_optimizer, check_kernels, pick_device, setup_precision
from kiln.pipeline.train.params import ModelParams, TrainParams
from kiln.pipeline.train.stats import observing
from kiln.pipeline.train.throughput import peak_flops

MODES = ("eager", "compile")
DEVICES = ("auto", "cpu", "cuda", "mps")
# The optimizer's settings (lr, betas, decay) do not change what a step costs; the defaults stand in for them.
OPTIM = TrainParams()


def parse_variants(text: str, kernels: str = "torch") -> list[tuple[str, bool, str]]:
    """'fp32-eager,bf16-compile-triton' -> [("fp32", False, kernels), ("bf16", True, "triton")]: a variant
    without a third part uses `kernels` (--kernels); repeats are dropped, order is kept."""
    if kernels not in BACKENDS:
        raise UserError(f"--kernels {kernels!r}: expected one of {', '.join(BACKENDS)}")
    variants = []
    for item in dict.fromkeys(w.strip() for w in text.split(",") if w.strip()):
        precision, mode, backend = (item.split("-") + [kernels])[:3] if item.count("-") in (1, 2) else (item, "", "")
        if precision not in PRECISIONS:
            raise UserError(f"--variants {item!r}: unknown precision {precision!r} "
                            f"(expected one of {', '.join(PRECISIONS)})")
        if mode not in MODES or backend not in BACKENDS:
            raise UserError(f"--variants {item!r}: expected PRECISION-MODE or PRECISION-MODE-KERNELS, MODE eager or "
                            f"compile, KERNELS one of {', '.join(BACKENDS)}")
        variants.append((precision, mode == "compile", backend))
    if not variants:
        raise UserError("--variants: expected at least one PRECISION-MODE, e.g. fp32-eager")
    return variants


def resolve_device(name: str) -> torch.device:
    if name.split(":")[0] not in DEVICES:
        raise UserError(f"--device {name!r}: expected auto, cpu, cuda, cuda:N or mps")
    try:
        return pick_device(name)
    except UserError:  # its message names train.device, which this command does not read
        raise UserError(f"--device {name!r}: CUDA is not available on this machine") from None


def synchronize(device: torch.device) -> None:
    """Wait for queued kernels, so that a timer read afterwards covers them."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


PROFILED_STEPS = 3
TOP_OPS = 12


def profile_steps(one, device: torch.device, trace: Path) -> list[dict]:
    """Run a few more steps under torch.profiler, write their trace (Chrome/Perfetto JSON) to `trace`, and return
    the operators that took the most self time on the device that did the work (CUDA kernels, else the CPU)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        for _ in range(PROFILED_STEPS):
            one()
        synchronize(device)
    trace.parent.mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(str(trace))
    key = "self_device_time_total" if cuda else "self_cpu_time_total"
    events = sorted(prof.key_averages(), key=lambda e: getattr(e, key), reverse=True)[:TOP_OPS]
    total = sum(getattr(e, key) for e in prof.key_averages()) or 1.0
    return [{"op": e.key, "self_ms_per_step": round(getattr(e, key) / 1e3 / PROFILED_STEPS, 3),
             "share": round(getattr(e, key) / total, 4), "calls_per_step": e.count // PROFILED_STEPS}
            for e in events]


def time_variant(template: GPT, precision: str, compiled: bool, kernels: str, device: torch.device,
                 batch_size: int, seq_len: int, steps: int, warmup: int, progress: Progress,
                 trace: Path | None = None, checkpointing: bool = False, stats_every: int = 0) -> dict:
    setup_precision(device, precision)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    model = copy.deepcopy(template).set_kernels(kernels).set_checkpointing(checkpointing).to(device)
    params = dataclasses.replace(OPTIM, precision=precision, compile=compiled, kernels=kernels)
    optimizer = build_optimizer(model, params, device)
    scaler = torch.amp.GradScaler(device.type, enabled=precision == "fp16")
    forward = torch.compile(model) if compiled else model
    step = Step(model, forward, optimizer, scaler, lm_loss, 1, params, device)
    batch = itertools.repeat(tuple(torch.randint(template.config.vocab_size, (2, batch_size, seq_len), device=device)))

    def stop(loss: float) -> None:
        raise StageError(f"bench train {precision}-{MODES[compiled]}-{kernels}: loss is {loss}")

    taken = 0

    def one():
        nonlocal taken
        taken += 1
        with observing(model, bool(stats_every) and taken % stats_every == 0) as stats:  # as the loop does
            step(batch, OPTIM.lr, stop, 1, stats)
        if stats is not None:
            stats.results()  # the values read back, a cost of the loop's statistics steps too
        progress.advance(1)

    start = time.perf_counter()
    one()  # compiles the forward and backward graphs when compiled; allocates optimizer state either way
    synchronize(device)
    first = time.perf_counter() - start
    for _ in range(warmup - 1):
        one()
    synchronize(device)
    start = time.perf_counter()
    for _ in range(steps):
        one()
    synchronize(device)
    seconds = time.perf_counter() - start
    top = profile_steps(one, device, trace) if trace is not None else None
    if compiled:
        torch._dynamo.reset()  # drop the graphs, and the model they hold, before the next variant
    peak_memory = torch.cuda.max_memory_allocated(device) / 1e9 if device.type == "cuda" else None
    tokens_per_s = batch_size * seq_len * steps / seconds
    return {"step_ms": round(seconds / steps * 1e3, 3), "tokens_per_s": round(tokens_per_s, 1),
            "compile_seconds": round(first, 2) if compiled else None,
            "peak_memory_gb": None if peak_memory is None else round(peak_memory, 3),
            **({"trace": str(trace), "top_ops": top} if trace is not None else {})}


def bench_train(model_params: ModelParams, variants: list[tuple[str, bool, str]], vocab_size: int, batch_size: int,
                seq_len: int | None, steps: int, warmup: int, device_name: str, out: Path,
                profile: Path | None = None, checkpointing: bool = False, stats_every: int = 0) -> dict:
    """`profile`: a folder for one trace per variant, of PROFILED_STEPS steps after the timed ones (so the
    profiler's overhead is not in the timings), and a table of each variant's top operators by self time.
    `checkpointing` and `stats_every`: each variant runs again with blocks recomputed in the backward
    (train.activation_checkpointing), and again with statistics every that many steps (train.stats_every),
    rows of their own beside it, so their costs are measured side by side in one process."""
    for option, value in (("--vocab-size", vocab_size), ("--batch-size", batch_size), ("--steps", steps),
                          ("--warmup", warmup)):
        if value < 1:
            raise UserError(f"{option} {value}: expected a positive integer")
    seq_len = model_params.max_seq_len if seq_len is None else seq_len
    if not 1 <= seq_len <= model_params.max_seq_len:
        raise UserError(f"--seq-len {seq_len}: expected 1..{model_params.max_seq_len} (model.max_seq_len)")
    device = resolve_device(device_name)
    config = model_params.config(vocab_size)
    torch.manual_seed(0)
    for _, _, kernels in variants:
        check_kernels(kernels, device, "--variants kernels")
    # Initialised once on the CPU and copied, so every variant starts from the same weights.
    template = GPT(config)
    num_params, flops_per_token = template.num_params(), template.flops_per_token(seq_len)
    device_label = torch.cuda.get_device_name(device) if device.type == "cuda" else machine()["processor"]
    rows = []
    if stats_every < 0:
        raise UserError(f"--stats-every {stats_every}: expected a number of steps >= 0")
    extras = [("", False, 0)] + ([("+checkpointing", True, 0)] if checkpointing else []) + \
        ([(f"+stats/{stats_every}", False, stats_every)] if stats_every else [])
    profiled = PROFILED_STEPS if profile is not None else 0
    runs = [(v, e) for v in variants for e in extras]
    with Progress("bench train", unit="steps", total=len(runs) * (warmup + steps + profiled)) as progress:
        for (precision, compiled, kernels), (suffix, recompute, every) in runs:
            name = f"{precision}-{MODES[compiled]}-{kernels}{suffix}"
            progress.advance(0, variant=name)
            rows.append({"variant": name, "precision": precision, "compile": compiled, "kernels": kernels,
                         "activation_checkpointing": recompute, "stats_every": every,
                         **time_variant(template, precision, compiled, kernels, device, batch_size, seq_len, steps,
                                        warmup, progress, profile / f"{name}.json" if profile else None,
                                        recompute, every)})
    for row in rows:
        peak, _ = peak_flops(device, row["precision"])
        row["peak_flops"] = peak
        row["mfu"] = round(flops_per_token * row["tokens_per_s"] / peak, 6) if peak else None
        row["speedup"] = round(row["tokens_per_s"] / rows[0]["tokens_per_s"], 3)
    cuda = device.type == "cuda"
    table = Table(title=f"training step: {config.arch} {config.n_layer}x{config.d_model}, "
                        f"{num_params / 1e6:.2f}M params, vocab {vocab_size}, batch {batch_size}x{seq_len}, "
                        f"{steps} timed steps after {warmup}, {device.type} ({device_label})"

                        + (f", {torch.get_num_threads()} threads" if device.type == "cpu" else ""))
    for col in ("variant", "step ms", "tokens/s", "MFU", "speedup", "compile s", *(["peak GB"] if cuda else [])):
        table.add_column(col)
    for row in rows:
        table.add_row(row["variant"], f"{row['step_ms']:.1f}", f"{row['tokens_per_s']:,.0f}",
                      "-" if row["mfu"] is None else f"{row['mfu']:.2%}", f"{row['speedup']:.2f}x",
                      "-" if row["compile_seconds"] is None else f"{row['compile_seconds']:.1f}",
                      *([f"{row['peak_memory_gb']:.2f}"] if cuda else []))
    console.print(table)
    for row in rows if profile is not None else ():
        ops = Table(title=f"{row['variant']}: top operators by self {'CUDA' if cuda else 'CPU'} time, "
                          f"{PROFILED_STEPS} steps (trace: {row['trace']}, opens in ui.perfetto.dev)")
        for col in ("operator", "ms/step", "share", "calls/step"):
            ops.add_column(col)
        for op in row["top_ops"]:
            ops.add_row(op["op"], f"{op['self_ms_per_step']:.2f}", f"{op['share']:.1%}", str(op["calls_per_step"]))
        console.print(ops)
    result = {"benchmark": "train", "device": device.type, "device_name": device_label,
              "torch": torch.__version__, "threads": torch.get_num_threads(), "machine": machine(),
              "model": config.to_dict(), "params": num_params, "flops_per_token": flops_per_token,
              "batch_size": batch_size, "seq_len": seq_len, "steps": steps, "warmup": warmup,
              "baseline": rows[0]["variant"], "results": rows}
    write_json(out, result)
    console.print(f"wrote {out}", highlight=False)
    return result
