"""`kiln bench train`: tokens/s and MFU of one training step, fp32 vs bf16, eager vs torch.compile (in its modes)
and torch vs Triton kernels, in one run.

A step is the loop's own `Step` (what `kiln pretrain` runs) for one micro-batch without accumulation: forward
under autocast, backward, the loss read back for the NaN guard, gradient clipping and AdamW (fused on CUDA: each
row says whether the optimizer it built was). The batch is random token ids already on the device, so data
loading is left out: the figure is what the model and the step cost, the ceiling that training can reach. Every
variant starts from a copy of the same initial weights; the first row is the baseline of the speedup column, so
ratios come from one process and machine. A compile variant's first step is reported as its compile time;
torch's on-disk compile cache shortens it on a rerun of the same shape (35 s cold, 4 s warm for the default
shape on a 2-core CPU).

The levers a GPU run weighs side by side, each adding rows beside every variant rather than multiplying with the
others: `compile_modes` (each compile variant once per torch.compile mode), `plan_batch` (the largest micro-batch
`kiln plan memory` fits in the device's memory), `checkpointing`, `stats_every`. Every row also gives the peak
memory measured (CUDA) beside plan memory's estimate for it, and the vocabulary rows the model allocated (padded
to a multiple of 64). A row that fails (a compile error, out of memory) is recorded with its error and the rest
still run; the JSON is rewritten after every row, so one that ends the process (a device-side assert) loses only
the rows after it: name compile + Triton variants last.

Only torch, rich and kiln's light modules are imported, so this runs on a GPU machine without the data stack
(dvc, datasets, tokenizers, tiktoken).
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import gc
import itertools
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from rich.table import Table

from kiln.kernels.backend import BACKENDS
from kiln.model.config import memory_available
from kiln.model.gpt import GPT, KERNEL_OPS
from kiln.pipeline.errors import StageError, UserError
from kiln.pipeline.outputs import write_json
from kiln.pipeline.progress import Progress, console
from kiln.pipeline.runtime import PRECISIONS, check_kernels, pick_device, resolve_kernels, setup_precision
from kiln.pipeline.tools.bench_kernels import one_line
from kiln.pipeline.tools.machine import machine
from kiln.pipeline.tools.plan_memory import Shape, plan
from kiln.pipeline.train.float8 import to_float8_training
from kiln.pipeline.train.lm import lm_loss
from kiln.pipeline.train.loop import Step, build_optimizer, compile_forward
from kiln.pipeline.train.params import COMPILE_MODES, ModelParams, TrainParams
from kiln.pipeline.train.stats import observing
from kiln.pipeline.train.throughput import peak_flops

MODES = ("eager", "compile")
# a variant's PRECISION: train.precision's values, and fp8 under each of its recipes (fp8 is the default's,
# tensorwise) -> (train.precision, train.fp8_recipe)
VARIANT_PRECISIONS = {**{p: (p, None) for p in PRECISIONS if p != "fp8"}, "fp8": ("fp8", "tensorwise"),
                      "fp8rowwise": ("fp8", "rowwise")}
DEVICES = ("auto", "cpu", "cuda", "mps")
# The optimizer's settings (lr, betas, decay) do not change what a step costs; the defaults stand in for them.
OPTIM = TrainParams()


def parse_variants(text: str, kernels: str = "torch") -> list[tuple[str, bool, str]]:
    """'fp32-eager,bf16-compile-triton' -> [("fp32", False, kernels), ("bf16", True, "triton")]: a variant
    without a third part uses `kernels` (--kernels); repeats are dropped, order is kept. KERNELS may name the
    ops that take it, the others running torch's: 'bf16-compile-triton:head' keeps "triton:head"."""
    if kernels not in BACKENDS:
        raise UserError(f"--kernels {kernels!r}: expected one of {', '.join(BACKENDS)}")
    variants = []
    for item in dict.fromkeys(w.strip() for w in text.split(",") if w.strip()):
        precision, mode, choice = (item.split("-") + [kernels])[:3] if item.count("-") in (1, 2) else (item, "", "")
        if precision not in VARIANT_PRECISIONS:
            raise UserError(f"--variants {item!r}: unknown precision {precision!r} "
                            f"(expected one of {', '.join(VARIANT_PRECISIONS)})")
        backend, ops = kernel_choice(choice)
        if mode not in MODES or backend not in BACKENDS or not set(ops or ()) <= set(KERNEL_OPS) or ops == ():
            raise UserError(f"--variants {item!r}: expected PRECISION-MODE or PRECISION-MODE-KERNELS[:OP+OP...], "
                            f"MODE eager or compile, KERNELS one of {', '.join(BACKENDS)}, OP some of "
                            f"{', '.join(KERNEL_OPS)}")
        variants.append((precision, mode == "compile", choice))
    if not variants:
        raise UserError("--variants: expected at least one PRECISION-MODE, e.g. fp32-eager")
    return variants


def kernel_choice(choice: str) -> tuple[str, tuple[str, ...] | None]:
    """'triton:attention+head' -> ("triton", ("attention", "head")); 'triton' -> ("triton", None): all ops."""
    backend, colon, ops = choice.partition(":")
    return backend, tuple(op for op in ops.split("+") if op) if colon else None


def resolve_choice(choice: str, device: torch.device) -> tuple[str, tuple[str, ...] | None]:
    """A variant's KERNELS on `device`: (triton or torch, the ops that take it or None for all)."""
    backend, ops = kernel_choice(choice)
    return resolve_kernels(backend, device), ops


def fused_head(choice: str, device: torch.device) -> bool:
    """Whether the variant's loss is kiln's fused head: what `kiln plan memory`'s kernels count."""
    backend, ops = resolve_choice(choice, device)
    return backend != "torch" and (ops is None or "head" in ops)


def parse_compile_modes(text: str) -> list[str]:
    """'default,reduce-overhead' -> ["default", "reduce-overhead"] (torch.compile's modes, as train.compile_mode;
    the first is the compile variants' own row, each other one a row beside it)."""
    modes = list(dict.fromkeys(m.strip() for m in text.split(",") if m.strip()))
    allowed = COMPILE_MODES[1:]
    for mode in modes:
        if mode not in allowed:
            raise UserError(f"--compile-modes {mode!r}: expected some of {', '.join(allowed)}")
    if not modes:
        raise UserError(f"--compile-modes: expected at least one of {', '.join(allowed)}")
    return modes


@dataclass
class Run:
    """One row: a variant with its mode, batch and extras."""

    name: str
    precision: str
    compiled: bool
    kernels: str  # as asked (auto kept, for the name); resolved for the device when it runs
    mode: str | None  # torch.compile's mode, None when eager
    batch_size: int
    checkpointing: bool = False
    stats_every: int = 0


def plan_runs(variants: list[tuple[str, bool, str]], modes: list[str], batch_size: int,
              planned: dict[tuple[str, str, bool], int], checkpointing: bool, stats_every: int,
              device: torch.device) -> list[Run]:
    """Every variant's rows in order: its own (in the first mode), one per other compile mode, then one each for
    the planned batch, checkpointing and statistics where asked (`planned`: (precision, fused head, compiled) ->
    batch)."""
    runs = []
    for precision, compiled, kernels in variants:
        name = f"{precision}-{MODES[compiled]}-{kernels}"
        mode = modes[0] if compiled else None
        runs.append(Run(name, precision, compiled, kernels, mode, batch_size))
        runs += [Run(f"{name}+{other}", precision, compiled, kernels, other, batch_size)
                 for other in (modes[1:] if compiled else [])]
        if planned:
            batch = planned[precision, fused_head(kernels, device), compiled]
            runs.append(Run(f"{name}+batch{batch}", precision, compiled, kernels, mode, batch))
        if checkpointing:
            runs.append(Run(f"{name}+checkpointing", precision, compiled, kernels, mode, batch_size, True))
        if stats_every:
            runs.append(Run(f"{name}+stats/{stats_every}", precision, compiled, kernels, mode, batch_size, False,
                            stats_every))
    return runs


def plan_batches(variants: list[tuple[str, bool, str]], config, seq_len: int, room: int,
                 device: torch.device) -> dict[tuple[str, str, bool], int]:
    """The largest micro-batch `kiln plan memory` fits in `room` bytes (less its headroom) for each variant's
    precision, head (kiln's
    fused one or torch's) and compile (a compiled torch head holds one logits tensor to eager's three, so its
    batch is larger)."""
    planned = {}
    for precision, compiled, kernels in variants:
        key = (precision, fused_head(kernels, device), compiled)
        shape = Shape(config, VARIANT_PRECISIONS[precision][0], key[1], compiled=compiled,
                      fused_adamw=device.type == "cuda")
        planned[key] = plan(shape, 1, seq_len, room)["largest_batch_size"]
        if not planned[key]:
            raise UserError(f"--plan-batch: not one sequence of {seq_len} tokens fits {room / 1e9:.3g} GB with "
                            f"{precision}, {MODES[compiled]} and {'kiln' if key[1] else 'torch'}'s LM head "
                            "(kiln plan memory)")
    return planned


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
TOP_OPS = 25  # enough to account for most of a GPT-2 step (its top 12 held ~60 %)


def profile_steps(one, device: torch.device, trace: Path | None) -> tuple[list[dict], float]:
    """Run a few more steps under torch.profiler, write their trace (Chrome/Perfetto JSON) to `trace` if given,
    and return the operators that took the most self time on the device that did the work, and that device's
    busy milliseconds per step. On CUDA these are the kernels (and copies) alone: an aten op's row would count
    its kernels' time a second time, so the shares add up to the GPU's busy time, and a step's time above it is
    the GPU waiting (on the host, or on a sync). On a CPU: the operators' self times."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        for _ in range(PROFILED_STEPS):
            one()
        synchronize(device)
    if trace is not None:
        trace.parent.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(trace))
    key = "self_device_time_total" if cuda else "self_cpu_time_total"
    times, calls = collections.Counter(), collections.Counter()
    for e in prof.events():
        # A record_function range (AdamW.step's) is drawn on the GPU's timeline too: a span, not work.
        if cuda and (e.device_type != DeviceType.CUDA or e.is_user_annotation):
            continue
        times[e.key] += getattr(e, key)
        calls[e.key] += 1
    total = sum(times.values()) or 1.0
    top = [{"op": name, "self_ms_per_step": round(us / 1e3 / PROFILED_STEPS, 3), "share": round(us / total, 4),
            "calls_per_step": calls[name] // PROFILED_STEPS} for name, us in times.most_common(TOP_OPS)]
    return top, round(total / 1e3 / PROFILED_STEPS, 3)


def fused_adamw(optimizer) -> bool:
    """Whether the step's AdamW (alone, or beside Muon) runs torch's fused kernel."""
    adamw = next(o for o in getattr(optimizer, "optimizers", [optimizer]) if isinstance(o, torch.optim.AdamW))
    return bool(adamw.defaults.get("fused"))


def time_variant(template: GPT, run: Run, device: torch.device, seq_len: int, steps: int, warmup: int,
                 progress: Progress, profiled: bool = False, trace: Path | None = None) -> dict:
    """`profiled`: after the timed steps, PROFILED_STEPS more under torch.profiler (their trace to `trace` if
    given), whose top operators the row keeps."""
    kernels, ops = resolve_choice(run.kernels, device)
    precision, recipe = VARIANT_PRECISIONS[run.precision]
    setup_precision(device, precision)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    model = copy.deepcopy(template).set_kernels(kernels, ops).set_checkpointing(run.checkpointing).to(device)
    if recipe:  # as the loop converts a train.precision=fp8 run
        to_float8_training(model, recipe, device)
    params = dataclasses.replace(OPTIM, precision=precision, compile=run.compiled, compile_mode=run.mode,
                                 kernels=kernels)
    optimizer = build_optimizer(model, params, device)
    scaler = torch.amp.GradScaler(device.type, enabled=precision == "fp16")
    step = Step(model, compile_forward(model, params), optimizer, scaler, lm_loss, 1, params, device)
    shape = (2, run.batch_size, seq_len)
    batch = itertools.repeat(tuple(torch.randint(template.config.vocab_size, shape, device=device)))

    def stop(loss: float) -> None:
        raise StageError(f"bench train {run.name}: loss is {loss}")

    taken = 0

    def one():
        nonlocal taken
        taken += 1
        with observing(model, bool(run.stats_every) and taken % run.stats_every == 0) as stats:  # as the loop does
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
    top, busy = profile_steps(one, device, trace) if profiled else (None, None)
    peak_memory = torch.cuda.max_memory_allocated(device) / 1e9 if device.type == "cuda" else None
    tokens_per_s = run.batch_size * seq_len * steps / seconds
    return {"kernels": kernels if ops is None else f"{kernels}:{'+'.join(ops)}", "fused_adamw": fused_adamw(optimizer),
            "padded_vocab_size": model.lm_head.weight.shape[0],
            "step_ms": round(seconds / steps * 1e3, 3), "tokens_per_s": round(tokens_per_s, 1),
            "compile_seconds": round(first, 2) if run.compiled else None,
            "peak_memory_gb": None if peak_memory is None else round(peak_memory, 3),
            **({"top_ops": top, "device_busy_ms_per_step": busy} if profiled else {}),
            **({"trace": str(trace)} if trace is not None else {})}


def release(device: torch.device) -> None:
    """Drop the last row's compiled graphs (which hold its model) and hand its memory back, so the next row,
    a planned batch above all, starts from an empty device."""
    torch._dynamo.reset()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def bench_train(model_params: ModelParams, variants: list[tuple[str, bool, str]], vocab_size: int, batch_size: int,
                seq_len: int | None, steps: int, warmup: int, device_name: str, out: Path,
                profile: Path | None = None, checkpointing: bool = False, stats_every: int = 0,
                compile_modes: list[str] = ("default",), plan_batch: bool = False,
                device_gb: float | None = None, top_ops: bool = False) -> dict:
    """`profile`: a folder for one trace per row, of PROFILED_STEPS steps after the timed ones (so the
    profiler's overhead is not in the timings), and a table of each row's top operators by self time;
    `top_ops`: the same steps and table without the traces (each row's JSON keeps its top operators either way).
    `compile_modes`, `plan_batch` (in `device_gb`, default the device's free memory), `checkpointing` and
    `stats_every` add rows beside each variant (see the module's docstring)."""
    for option, value in (("--vocab-size", vocab_size), ("--batch-size", batch_size), ("--steps", steps),
                          ("--warmup", warmup)):
        if value < 1:
            raise UserError(f"{option} {value}: expected a positive integer")
    seq_len = model_params.max_seq_len if seq_len is None else seq_len
    if not 1 <= seq_len <= model_params.max_seq_len:
        raise UserError(f"--seq-len {seq_len}: expected 1..{model_params.max_seq_len} (model.max_seq_len)")
    if stats_every < 0:
        raise UserError(f"--stats-every {stats_every}: expected a number of steps >= 0")
    if device_gb is not None and not device_gb > 0:
        raise UserError(f"--device-gb {device_gb}: expected a positive number of GB")
    device = resolve_device(device_name)
    config = model_params.config(vocab_size)
    torch.manual_seed(0)
    for _, _, kernels in variants:
        check_kernels(kernel_choice(kernels)[0], device, "--variants kernels")
    planned = {}
    if plan_batch:
        room = memory_available(device) if device_gb is None else int(device_gb * 1e9)
        planned = plan_batches(variants, config, seq_len, room, device)
    runs = plan_runs(variants, list(compile_modes), batch_size, planned, checkpointing, stats_every, device)
    # Initialised once on the CPU and copied, so every variant starts from the same weights.
    template = GPT(config)
    num_params, flops_per_token = template.num_params(), template.flops_per_token(seq_len)
    device_label = torch.cuda.get_device_name(device) if device.type == "cuda" else machine()["processor"]
    cuda = device.type == "cuda"
    result = {"benchmark": "train", "device": device.type, "device_name": device_label,
              "torch": torch.__version__, "threads": torch.get_num_threads(), "machine": machine(),
              "model": config.to_dict(), "params": num_params, "flops_per_token": flops_per_token,
              "batch_size": batch_size, "seq_len": seq_len, "steps": steps, "warmup": warmup,
              "baseline": None, "complete": False, "results": []}
    rows = result["results"]
    profiled = profile is not None or top_ops
    with Progress("bench train", unit="steps", total=len(runs) * (warmup + steps + PROFILED_STEPS * profiled)) \
            as progress:
        for run in runs:
            progress.advance(0, variant=run.name)
            row = {"variant": run.name, "precision": run.precision, "compile": run.compiled,
                   "compile_mode": run.mode, "kernels": run.kernels, "batch_size": run.batch_size,
                   "activation_checkpointing": run.checkpointing, "stats_every": run.stats_every}
            try:
                row |= time_variant(template, run, device, seq_len, steps, warmup, progress, profiled,
                                    profile / f"{run.name}.json" if profile else None)
            except Exception as e:  # a result too (a compile error, out of memory): the other rows still run
                row["error"] = one_line(e)
            release(device)
            precision = VARIANT_PRECISIONS[run.precision][0]
            estimate = plan(Shape(config, precision, fused_head(run.kernels, device), run.checkpointing,
                                  run.compiled, device.type == "cuda"), run.batch_size, seq_len, None)["total_bytes"]
            row["plan_memory_gb"] = round(estimate / 1e9, 3)
            if "error" not in row:
                peak, _ = peak_flops(device, precision)
                row["peak_flops"] = peak
                row["mfu"] = round(flops_per_token * row["tokens_per_s"] / peak, 6) if peak else None
                timed = [r for r in rows if "error" not in r]
                row["speedup"] = round(row["tokens_per_s"] / (timed[0] if timed else row)["tokens_per_s"], 3)
            rows.append(row)
            result["baseline"] = next((r["variant"] for r in rows if "error" not in r), None)
            write_json(out, result)  # after every row: a crash or a time limit keeps the rows measured
            console.print(_line(row, cuda), highlight=False, soft_wrap=True)
    if device.type == "cpu":
        # a CPU's peak is the best matmul measured so far, which rises as the run goes on: every row's MFU is
        # taken against the final one, so that rows compare
        peak, _ = peak_flops(device, "fp32")
        for row in rows:
            if "error" not in row:
                row["peak_flops"], row["mfu"] = peak, round(flops_per_token * row["tokens_per_s"] / peak, 6)
    result["complete"] = True
    write_json(out, result)
    _print(result, config, num_params, vocab_size, device, device_label, cuda, profiled)
    console.print(f"wrote {out}", highlight=False)
    failed = [r for r in rows if "error" in r]
    if failed:
        raise StageError(f"bench train: {len(failed)} of {len(rows)} rows failed, first {failed[0]['variant']}: "
                         f"{failed[0]['error']} ({out})")
    return result


def _line(row: dict, cuda: bool) -> str:
    """A row as one line, printed as soon as it is measured (the table comes at the end, if the process does)."""
    if "error" in row:
        return f"{row['variant']}: failed: {row['error']}"
    memory = f", peak {row['peak_memory_gb']:.3g} GB" if cuda else ""
    mfu = "" if row["mfu"] is None else f", MFU {row['mfu']:.1%}"
    return (f"{row['variant']}: {row['step_ms']:.1f} ms/step, {row['tokens_per_s']:,.0f} tokens/s{mfu}{memory} "
            f"(plan {row['plan_memory_gb']:.3g} GB), batch {row['batch_size']}, fused AdamW "
            f"{'yes' if row['fused_adamw'] else 'no'}, vocab padded to {row['padded_vocab_size']:,}")


def _print(result: dict, config, num_params: int, vocab_size: int, device: torch.device, device_label: str,
           cuda: bool, profiled: bool) -> None:
    rows = result["results"]
    table = Table(title=f"training step: {config.arch} {config.n_layer}x{config.d_model}, "
                        f"{num_params / 1e6:.2f}M params, vocab {vocab_size} (padded {config.padded_vocab_size}), "
                        f"seq {result['seq_len']}, {result['steps']} timed steps after {result['warmup']}, "
                        f"{device.type} ({device_label})"
                        + (f", {torch.get_num_threads()} threads" if device.type == "cpu" else ""))
    for col in ("variant", "batch", "step ms", "tokens/s", "MFU", "speedup", "compile s",
                *(["peak GB"] if cuda else []), "plan GB"):
        table.add_column(col)
    for row in rows:
        if "error" in row:
            table.add_row(row["variant"], str(row["batch_size"]), f"failed: {row['error']}")
            continue
        table.add_row(row["variant"], str(row["batch_size"]), f"{row['step_ms']:.1f}", f"{row['tokens_per_s']:,.0f}",
                      "-" if row["mfu"] is None else f"{row['mfu']:.2%}", f"{row['speedup']:.2f}x",
                      "-" if row["compile_seconds"] is None else f"{row['compile_seconds']:.1f}",
                      *([f"{row['peak_memory_gb']:.3g}"] if cuda else []), f"{row['plan_memory_gb']:.3g}")
    console.print(table)
    timed = [row for row in rows if "error" not in row]
    fused = sorted({"yes" if row["fused_adamw"] else "no" for row in timed})
    padded = sorted({row["padded_vocab_size"] for row in timed})
    if timed:
        console.print(f"fused AdamW: {'/'.join(fused)}; vocabulary rows allocated: "
                      f"{'/'.join(f'{v:,}' for v in padded)} (of {vocab_size:,})", highlight=False)
    for row in rows if profiled else ():
        if "error" in row:
            continue
        trace = f", trace: {row['trace']}, opens in ui.perfetto.dev" if "trace" in row else ""
        busy = f" (GPU busy {row['device_busy_ms_per_step']:.1f} of {row['step_ms']:.1f} ms a step)" if cuda else ""
        ops = Table(title=f"{row['variant']}: top {'kernels' if cuda else 'operators'} by self "
                          f"{'CUDA' if cuda else 'CPU'} time, {PROFILED_STEPS} steps{busy}{trace}")
        for col in ("operator", "ms/step", "share", "calls/step"):
            ops.add_column(col)
        for op in row["top_ops"]:
            ops.add_row(op["op"], f"{op['self_ms_per_step']:.2f}", f"{op['share']:.1%}", str(op["calls_per_step"]))
        console.print(ops)
