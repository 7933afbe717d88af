"""`kiln bench kernels`: each Triton kernel against torch eager, `torch.compile` of its reference and
Liger-Kernel (the field's Triton reference for these ops, when installed), on a GPU.

For every op and LLM-typical shape it times forward and forward+backward (backward = their difference) twice:
replayed from a CUDA graph (`triton.testing.do_bench_cudagraph`, the whole call captured, autograd's backward
included, so the host's Python and launches between kernels are not in the time) and between CUDA events
(`triton.testing.do_bench`, which an op whose capture fails falls back to, the row's `timing` saying why). Both
columns are in the JSON; the derived figures use the graph's, and a speed-up compares two timings of the same
kind. It reports achieved GB/s from the bytes the op must move at the least (read its inputs once, write its
outputs once), that as a share of this device's copy bandwidth (measured in
the same run: `dst.copy_(src)` on 1 GiB), the speed-up over every baseline, peak memory, and whether the op
meets its goal (GOALS). Attention and the fused linear+cross-entropy are compute-bound, so they report
TFLOP/s instead of GB/s; attention is also compared with `F.scaled_dot_product_attention` on its flash and
cuDNN backends (cuDNN's is what torch's own training step runs on Hopper).
NF4 dequantisation (QLoRA's 4-bit weights to bf16, forward only, so its fwd+bwd is its forward) is compared
with bitsandbytes' `dequantize_4bit` and Unsloth's `fast_dequantize` on the same bytes; a baseline that cannot
run (not installed, no CUDA) is named in the row's `missing_baselines` with the reason, and its column is empty.

The interpreter cannot time anything meaningful, so on a machine without CUDA this says so and exits 2, except
for `--size smoke`: tiny shapes that run the whole command (every op, every baseline, the JSON) on CPU tensors
through Triton's interpreter, so CI checks the plumbing a GPU session will only measure with.
The launch settings Triton's autotuner picked for each kiln kernel and key (`kiln.kernels.launch.picked()`) are
saved with the rows ("autotuned") and printed after the table, so a timing can be traced to the config that ran.
The JSON is rewritten after every row: a run cut short keeps what it measured.
Only torch, triton, rich and kiln's light modules are imported (the GPU machine has no dvc).
"""

from __future__ import annotations

import importlib.util
import itertools
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cache, partial
from pathlib import Path

import torch
import torch.nn.functional as F
from rich.table import Table

from kiln.kernels.launch import picked
from kiln.pipeline.errors import UserError
from kiln.pipeline.outputs import write_json
from kiln.pipeline.progress import console
from kiln.pipeline.tools.machine import machine, package_version

DTYPE = torch.bfloat16
BF16 = 2  # bytes per element
SIZES = ("quick", "full", "smoke")
OPS = ("rms_norm", "swiglu", "rope", "cross_entropy", "linear_cross_entropy", "flash_attention", "nf4_dequantize")


@dataclass
class Case:
    """One op at one shape: `make()` returns fresh inputs, `run(inputs, backend)` the op's outputs."""

    op: str
    shape: str
    make: Callable[[], list[torch.Tensor]]
    run: Callable[[list[torch.Tensor], str], torch.Tensor | tuple]
    fwd_bytes: int = 0  # least traffic; 0 for compute-bound ops, which give flops instead
    bwd_bytes: int = 0
    fwd_flops: int = 0
    bwd_flops: int = 0
    extra: dict[str, Callable] = field(default_factory=dict)  # other baselines: name -> run(inputs)
    missing: dict[str, str] = field(default_factory=dict)  # baselines that cannot run here: name -> why


def shapes(size: str) -> dict[str, list[tuple]]:
    """The grid per op. quick: about a minute of GPU time; full: the issue's range (tokens 4k-32k, hidden
    768-8192, vocab 32k-128k, T 1k-8k); smoke: shapes the interpreter gets through in seconds."""
    if size == "smoke":
        return {"rms_norm": [(64, 96)], "swiglu": [(64, 96)], "rope": [(1, 16, 4, 2, 16)],
                "cross_entropy": [(32, 160)], "linear_cross_entropy": [(32, 160, 48)],
                "flash_attention": [(1, 2, 1, 32, 16)], "nf4_dequantize": [(64, 128)]}
    tokens = [4096, 16384] if size == "quick" else [4096, 16384, 32768]
    hidden = [768, 4096] if size == "quick" else [768, 4096, 8192]
    vocab = [32768, 128256] if size == "quick" else [32768, 50304, 128256]
    heads = [(12, 12, 64), (32, 8, 128)]
    return {
        "rms_norm": [(n, h) for n in tokens for h in hidden],
        "swiglu": [(n, h * 8 // 3 // 64 * 64) for n in tokens for h in hidden],
        "rope": [(max(1, n // 2048), 2048, h, kv, d) for n in tokens for h, kv, d in heads],
        # 128k-vocab logits for 32k tokens would be 8 GB of bf16 alone: a quarter of the rows there.
        "cross_entropy": [(n // 4 if v > 100_000 else n, v) for n in tokens for v in vocab],
        "linear_cross_entropy": [(8192, 50304, 768)] + ([] if size == "quick" else [(16384, 128256, 4096)]),
        # GPT-2 124M's training step (batch 16 x 1024), then longer sequences
        "flash_attention": [(16, 12, 12, 1024, 64), (4, 12, 12, 2048, 64)] + ([] if size == "quick" else
                                                      [(2, 32, 8, 4096, 128), (1, 16, 16, 8192, 128)]),
        # Llama-2's MLP weights, (out, in): 7B's up and down projections, 70B's down; full adds 13B's and 70B's up
        "nf4_dequantize": [(11008, 4096), (4096, 11008), (8192, 28672)] + ([] if size == "quick" else
                                                                          [(13824, 5120), (28672, 8192)]),
    }


def cases(size: str, device: torch.device) -> list[Case]:
    from kiln.kernels.cross_entropy import cross_entropy
    from kiln.kernels.flash_attention import flash_attention
    from kiln.kernels.linear_cross_entropy import linear_cross_entropy
    from kiln.kernels.nf4 import KEYS, dequantize_nf4, quantize_nf4
    from kiln.kernels.rms_norm import rms_norm
    from kiln.kernels.rope import rope
    from kiln.kernels.swiglu import swiglu

    liger = liger_baselines()

    # Inputs come from a generator of the bench's own: a baseline whose CUDA-graph capture fails (Liger's cross
    # entropy on the H200, 2026-11-26) can leave the default generator marked as capturing, and every later draw
    # from it raised "Offset increment outside graph capture".
    generator = torch.Generator(device=device).manual_seed(0)

    def randn(*shape, grad=True):
        return torch.randn(*shape, device=device, dtype=DTYPE, generator=generator, requires_grad=grad)

    def randint(high, n):
        return torch.randint(high, (n,), device=device, generator=generator)

    grid, out = shapes(size), []
    for n, h in grid["rms_norm"]:
        out.append(Case("rms_norm", f"{n}x{h}", lambda n=n, h=h: [randn(n, h), randn(h)],
                        lambda x, b: rms_norm(x[0], x[1], 1e-5, backend=b),
                        fwd_bytes=2 * n * h * BF16, bwd_bytes=3 * n * h * BF16, extra=liger.get("rms_norm", {})))
    for n, f in grid["swiglu"]:
        out.append(Case("swiglu", f"{n}x{f}", lambda n=n, f=f: [randn(n, f), randn(n, f)],
                        lambda x, b: swiglu(x[0], x[1], backend=b),
                        fwd_bytes=3 * n * f * BF16, bwd_bytes=5 * n * f * BF16, extra=liger.get("swiglu", {})))
    for b_, t, heads, kv, d in grid["rope"]:
        angles = torch.arange(t, device=device, dtype=torch.float32)[:, None] * torch.rand(d // 2, device=device,
                                                                                         generator=generator)
        qk = b_ * t * (heads + kv) * d * BF16
        out.append(Case("rope", f"{b_}x{t}x{heads}/{kv}x{d}",
                        lambda b_=b_, t=t, heads=heads, kv=kv, d=d, angles=angles: [
                            randn(b_, t, heads, d), randn(b_, t, kv, d), angles.cos(), angles.sin()],
                        lambda x, b: rope(x[0], x[1], x[2], x[3], backend=b),
                        fwd_bytes=2 * qk, bwd_bytes=2 * qk, extra=liger.get("rope", {})))
    for rows, v in grid["cross_entropy"]:
        out.append(Case("cross_entropy", f"{rows}x{v}", lambda rows=rows, v=v: [randn(rows, v), randint(v, rows)],
                        lambda x, b: cross_entropy(x[0], x[1], backend=b),
                        fwd_bytes=2 * rows * v * BF16, bwd_bytes=2 * rows * v * BF16,
                        extra={"F.cross_entropy": lambda x: F.cross_entropy(x[0].float(), x[1]),
                               **liger.get("cross_entropy", {})}))
    for n, v, d in grid["linear_cross_entropy"]:
        out.append(Case("linear_cross_entropy", f"{n}x{d}->{v}",
                        lambda n=n, v=v, d=d: [randn(n, d), randn(v, d), randint(v, n)],
                        lambda x, b: linear_cross_entropy(x[0], x[1], x[2], backend=b),
                        fwd_flops=2 * n * v * d, bwd_flops=4 * n * v * d,
                        extra=liger.get("linear_cross_entropy", {})))
    for b_, heads, kv, t, d in grid["flash_attention"]:
        flops = 4 * b_ * heads * t * t * d // 2  # causal: half the score matrix
        out.append(Case("flash_attention", f"{b_}x{heads}/{kv}x{t}x{d}",
                        lambda b_=b_, heads=heads, kv=kv, t=t, d=d: [randn(b_, heads, t, d), randn(b_, kv, t, d),
                                                                     randn(b_, kv, t, d)],
                        lambda x, b: flash_attention(x[0], x[1], x[2], causal=True, backend=b),
                        fwd_flops=flops, bwd_flops=int(2.5 * flops),
                        extra={"sdpa flash": partial(_sdpa, "FLASH_ATTENTION"),
                               "sdpa cudnn": partial(_sdpa, "CUDNN_ATTENTION")} if device.type == "cuda" else {}))
    nf4_extra, nf4_missing = nf4_baselines(device)
    for rows, cols in grid["nf4_dequantize"]:
        n = rows * cols
        blocks = -(-n // 64)
        # In: the 4-bit codes, an 8-bit absmax per 64 weights, a float32 scale per 256 absmaxes, the offset; out: bf16.
        nf4_bytes = n // 2 + blocks + 4 * -(-blocks // 256) + 4 + n * BF16
        out.append(Case("nf4_dequantize", f"{rows}x{cols}",
                        lambda rows=rows, cols=cols: list(map(quantize_nf4(randn(rows, cols, grad=False) * 0.02).get,
                                                              KEYS)),
                        lambda x, b, shape=(rows, cols): dequantize_nf4(*x, shape, DTYPE, backend=b),
                        fwd_bytes=nf4_bytes, extra={name: partial(run, shape=(rows, cols))
                                                    for name, run in nf4_extra.items()},
                        missing=nf4_missing))
    return out


# Why the Unsloth column is empty on the GPU machine unless someone installs it there: docs/gpu.md, "NF4 baselines".
UNSLOTH_NOT_CARRIED = ("not installed: its wheel (28.6 MB, most of it Unsloth Studio) and bitsandbytes' (43 MB) do "
                       "not both fit the 60 MB of wheels the GPU machine gets, and importing unsloth.kernels.utils "
                       "also needs unsloth_zoo, trl and datasets, which the GPU image lacks")


def nf4_baselines(device: torch.device) -> tuple[dict[str, Callable], dict[str, str]]:
    """bitsandbytes' dequantize_4bit and Unsloth's fast_dequantize, each run(inputs, shape) on kiln's bytes (the
    layout is theirs), when it can run here; and for each that cannot, why."""
    if device.type != "cuda":
        return {}, {"bitsandbytes": "CUDA only", "unsloth": "CUDA only"}
    try:
        from bitsandbytes.functional import QuantState, dequantize_4bit
    except Exception as e:  # absent, or present but unable to load here
        return {}, {"bitsandbytes": f"{type(e).__name__}: {e}", "unsloth": "needs bitsandbytes"}
    from kiln.kernels.nf4 import DYNAMIC, NF4

    code, code2 = NF4.to(device), DYNAMIC.to(device)  # once: a copy to the GPU in the timed call would cost more

    def state(x, shape):
        packed, absmax, scale, offset = x
        inner = QuantState(absmax=scale, code=code2, blocksize=256, dtype=torch.float32)
        return QuantState(absmax=absmax, shape=torch.Size(shape), code=code, blocksize=64, quant_type="nf4",
                          dtype=DTYPE, offset=offset, state2=inner)

    runs = {"bitsandbytes": lambda x, shape: dequantize_4bit(x[0].view(-1, 1), state(x, shape))}
    if importlib.util.find_spec("unsloth") is None:
        return runs, {"unsloth": UNSLOTH_NOT_CARRIED}
    # Imported when its rows run, the last ones: importing unsloth patches torch and transformers, which must not
    # touch the other ops' rows. If it fails, its timings hold the error.
    fast_dequantize = cache(lambda: importlib.import_module("unsloth.kernels.utils").fast_dequantize)
    runs["unsloth"] = lambda x, shape: fast_dequantize()(x[0].view(-1, 1), state(x, shape))
    return runs, {}


def liger_baselines() -> dict[str, dict[str, Callable]]:
    """Liger-Kernel's version of each op on kiln's inputs, or nothing when liger-kernel is not installed.

    Liger's RoPE takes HF's layout: q as (B, H, T, D) over (B, T, H, D) storage, which is kiln's tensor
    transposed (no copy), and cos/sin at full head width (both halves equal)."""
    if importlib.util.find_spec("liger_kernel") is None:
        return {}
    from liger_kernel.transformers.functional import (
        liger_cross_entropy,
        liger_fused_linear_cross_entropy,
        liger_rms_norm,
        liger_rope,
        liger_swiglu,
    )

    def rope(x):
        cos, sin = (torch.cat([t, t], dim=-1) for t in (x[2], x[3]))
        q, k = liger_rope(x[0].transpose(1, 2), x[1].transpose(1, 2), cos, sin)
        return q, k

    return {"rms_norm": {"liger": lambda x: liger_rms_norm(x[0], x[1], 1e-5)},
            "swiglu": {"liger": lambda x: liger_swiglu(x[0], x[1])},
            "rope": {"liger": rope},
            "cross_entropy": {"liger": lambda x: liger_cross_entropy(x[0], x[1])},
            "linear_cross_entropy": {"liger": lambda x: liger_fused_linear_cross_entropy(x[0], x[1], x[2])}}


def _sdpa(backend: str, x: list[torch.Tensor]) -> torch.Tensor:
    """SDPA on one backend: FLASH_ATTENTION (FlashAttention-2), or CUDNN_ATTENTION, which torch's own step
    uses on Hopper."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(getattr(SDPBackend, backend)):
        return F.scaled_dot_product_attention(x[0], x[1], x[2], is_causal=True, enable_gqa=x[0].size(1) != x[1].size(1))


def median_ms(fn: Callable[[], object], device: torch.device) -> float:
    """Median milliseconds of `fn`: do_bench on CUDA (L2 flushed, CUDA events); on CPU, for the smoke run, a
    plain timer around a few calls."""
    if device.type == "cuda":
        from triton.testing import do_bench

        return do_bench(fn, return_mode="median")
    times = []
    for _ in range(3):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def _calls(fn: Callable[[list[torch.Tensor]], object], inputs: list[torch.Tensor], seeds: dict):
    """(forward, forward+backward, clear) of `fn` on `inputs`. The backward's seed gradients (ones) are made on
    the first call and kept in `seeds`, so neither timing includes filling them."""
    leaves = [t for t in inputs if t.requires_grad]

    def clear():
        for t in leaves:
            t.grad = None

    def forward_backward():
        clear()  # in a graph too: each captured backward then writes fresh gradients instead of accumulating
        outs = fn(inputs)
        outs = [o for o in (outs if isinstance(outs, tuple) else (outs,)) if o.requires_grad]
        for i, o in enumerate(outs):
            if i not in seeds:
                seeds[i] = torch.ones_like(o)
        if outs:  # a forward-only op (NF4 dequantisation) has nothing to differentiate
            torch.autograd.backward(outs, [seeds[i] for i in range(len(outs))])

    return lambda: fn(inputs), forward_backward, clear


MAX_INPUT_SETS = 16


def input_sets(inputs: list[torch.Tensor], device: torch.device) -> int:
    """How many copies of an op's inputs the graph-timed calls cycle through: enough to hold 3x the L2 cache
    (do_bench flushes L2 before each call; a graph replays back to back, and an H100's 50 MB L2 would otherwise
    serve the smaller shapes' inputs from cache), at most MAX_INPUT_SETS and half the free memory."""
    size = sum(t.numel() * t.element_size() for t in inputs)
    l2 = torch.cuda.get_device_properties(device).L2_cache_size
    by_memory = torch.cuda.mem_get_info(device)[0] // 2 // max(size, 1)
    return max(1, min(MAX_INPUT_SETS, -(-3 * l2 // max(size, 1)), by_memory))


def graph_timings(fn: Callable[[list[torch.Tensor]], object], inputs: list[torch.Tensor],
                  make: Callable[[], list[torch.Tensor]], seeds: dict, device: torch.device) -> dict:
    """Median ms of forward and forward+backward replayed from CUDA graphs (do_bench_cudagraph captures as many
    calls as fill ~20 ms, each on the next input set); raises where the op cannot be captured (a host sync, an
    allocation on the CPU)."""
    from triton.testing import do_bench_cudagraph

    sets = [inputs] + [make() for _ in range(input_sets(inputs, device) - 1)]
    calls = [_calls(fn, s, seeds) for s in sets]

    def cycle(which: int) -> Callable[[], object]:
        turn = itertools.count()
        return lambda: calls[next(turn) % len(calls)][which]()

    torch.cuda.synchronize(device)  # the inputs were made on the default stream; do_bench_cudagraph uses its own
    try:
        fwd = do_bench_cudagraph(cycle(0), return_mode="median")
        both = do_bench_cudagraph(cycle(1), return_mode="median")
    finally:
        for _, _, clear in calls:
            clear()
    return {"fwd_ms": fwd, "bwd_ms": max(both - fwd, 0.0), "fwd_bwd_ms": both}


def one_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0][:200] if text else ''}"


def timings(fn: Callable[[list[torch.Tensor]], object], make: Callable[[], list[torch.Tensor]],
            device: torch.device) -> dict:
    """Median ms of forward and of forward+backward (backward = their difference), and the peak memory above
    the inputs of one forward+backward. On CUDA both timings: `cudagraph` and `events` (None where capture
    failed), the top-level ms being the graph's where there is one and `timing` saying which; on CPU a plain
    timer."""
    inputs, seeds = make(), {}
    forward, forward_backward, clear = _calls(fn, inputs, seeds)
    if device.type != "cuda":
        fwd, both = median_ms(forward, device), median_ms(forward_backward, device)
        clear()
        return {"fwd_ms": fwd, "bwd_ms": max(both - fwd, 0.0), "fwd_bwd_ms": both, "peak_mb": 0.0,
                "timing": "cpu timer"}
    fwd, both = median_ms(forward, device), median_ms(forward_backward, device)
    events = {"fwd_ms": fwd, "bwd_ms": max(both - fwd, 0.0), "fwd_bwd_ms": both}
    clear()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    forward_backward()
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - base) / 2**20
    clear()
    try:
        graph, timing = graph_timings(fn, inputs, make, seeds, device), "cudagraph"
    except Exception as e:  # timed between events instead, and the row says why
        torch.cuda.synchronize()
        graph, timing = None, f"events (capture failed: {one_line(e)})"
    return {**(graph or events), "peak_mb": peak, "timing": timing, "cudagraph": graph, "events": events}


def copy_bandwidth(device: torch.device) -> float:
    """Device-to-device copy GB/s (read + write), the practical ceiling of a memory-bound kernel: 1 GiB on a
    GPU, 64 MiB in a CPU smoke run."""
    src = torch.empty(2**30 if device.type == "cuda" else 2**26, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src), device)
    return 2 * src.numel() / (ms * 1e-3) / 1e9


def bench_kernels(ops: list[str] | None, size: str, compile_baseline: bool, out: Path) -> dict:
    if size not in SIZES:
        raise UserError(f"--size {size!r}: expected one of {', '.join(SIZES)}")
    unknown = sorted(set(ops or []) - set(OPS))
    if unknown:
        raise UserError(f"--ops {','.join(unknown)}: no such op (expected some of {', '.join(OPS)})")
    cuda = torch.cuda.is_available()
    if not cuda and size != "smoke":
        raise UserError("kiln bench kernels needs a CUDA GPU: kernel timings in Triton's CPU interpreter mean "
                        "nothing (the kernels' correctness tests run on CPU: `make test`; `--size smoke` runs the "
                        "command on tiny shapes to check it works)")
    device = torch.device("cuda" if cuda else "cpu")
    selected = [c for c in cases(size, device) if ops is None or c.op in ops]
    bandwidth = copy_bandwidth(device)
    device_name = torch.cuda.get_device_name() if cuda else f"{machine()['processor']} (Triton interpreter)"
    result = {"benchmark": "kernels", "size": size, "device_name": device_name, "torch": torch.__version__,
              "triton": package_version("triton"), "liger_kernel": package_version("liger-kernel"),
              "bitsandbytes": package_version("bitsandbytes"), "unsloth": package_version("unsloth"),
              "machine": machine(),
              "dtype": str(DTYPE).removeprefix("torch."), "copy_bandwidth_gbs": round(bandwidth, 1),
              "goals": GOALS, "complete": False, "results": [], "autotuned": {}}
    rows = []
    for case in selected:
        started = time.perf_counter()
        variants = {"triton": lambda x, c=case: c.run(x, "triton"), "eager": lambda x, c=case: c.run(x, "torch")}
        if compile_baseline:
            variants["compile"] = torch.compile(lambda x, c=case: c.run(x, "torch"))
        variants.update(case.extra)
        measured = {}
        for name, fn in variants.items():
            try:
                measured[name] = timings(fn, case.make, device)
            except Exception as e:  # a baseline that cannot run this shape is a result, not a crash
                if name == "triton":
                    raise
                measured[name] = {"error": one_line(e)}
        rows.append(_row(case, measured, bandwidth))
        torch._dynamo.reset()
        console.print(f"{case.op} {case.shape}: {time.perf_counter() - started:.1f}s", highlight=False)
        result["results"], result["autotuned"] = rows, picked()
        write_json(out, result)  # after every row: a run stopped by a time limit or a crash keeps what it measured
    result["complete"] = True
    write_json(out, result)
    _print(rows, bandwidth, device_name, result["autotuned"])
    console.print(f"wrote {out}", highlight=False)
    return result


# The targets, forward+backward in bf16: memory-bound ops near the copy ceiling and no slower than the
# field's best; the fused loss small in memory at eager's speed; attention close to FlashAttention (SDPA).
GOALS = {
    "rms_norm": "fwd+bwd >= 85% of copy bandwidth, not slower than compile or liger",
    "swiglu": "fwd+bwd >= 85% of copy bandwidth, not slower than compile or liger",
    "rope": "fwd+bwd >= 85% of copy bandwidth, not slower than compile or liger",
    "cross_entropy": "fwd+bwd >= 85% of copy bandwidth, not slower than compile or liger",
    "linear_cross_entropy": "peak memory <= 20% of eager at <= 1.0x eager's time",
    "flash_attention": "fwd+bwd time <= 1.5x SDPA's flash backend",
    "nf4_dequantize": ">= 1.15x faster than Unsloth's fast_dequantize on the same bytes",
}


def goal_met(row: dict) -> bool | None:
    """Whether `row` meets its op's goal; None when a baseline the goal needs was not measured."""
    speedup = lambda base: row.get(f"fwd_bwd_speedup_vs_{base}")
    if row["op"] == "linear_cross_entropy":
        return row["peak_mb_vs_eager"] <= 0.2 and speedup("eager") >= 1.0
    if row["op"] == "nf4_dequantize":
        return None if speedup("unsloth") is None else speedup("unsloth") >= 1.15
    if row["op"] == "flash_attention":
        return None if speedup("sdpa flash") is None else speedup("sdpa flash") >= 1 / 1.5
    if speedup("compile") is None or speedup("liger") is None:
        return None
    return row["fwd_bwd_copy_pct"] >= 85 and speedup("compile") >= 1.0 and speedup("liger") >= 1.0


def common_timing(ours: dict, theirs: dict) -> str | None:
    """The timing two measurements share, for a ratio that compares like with like: cudagraph where both were
    captured, else events; None on a CPU (one plain timer, the top-level ms)."""
    for timing in ("cudagraph", "events"):
        if ours.get(timing) and theirs.get(timing):
            return timing
    return None


def _row(case: Case, measured: dict[str, dict], bandwidth: float) -> dict:
    triton = measured["triton"]
    row = {"op": case.op, "shape": case.shape, "timing": triton.get("timing"), "timings": measured}
    bases = {base: common_timing(triton, times) for base, times in measured.items()
             if base != "triton" and "error" not in times}
    if any(bases.values()):
        row["speedup_timing"] = bases
    for kind, bytes_, flops in (("fwd", case.fwd_bytes, case.fwd_flops), ("bwd", case.bwd_bytes, case.bwd_flops),
                                ("fwd_bwd", case.fwd_bytes + case.bwd_bytes, case.fwd_flops + case.bwd_flops)):
        ms = triton[f"{kind}_ms"]
        if bytes_ and ms > 0:
            row[f"{kind}_gbs"] = round(bytes_ / (ms * 1e-3) / 1e9, 1)
            row[f"{kind}_copy_pct"] = round(100 * row[f"{kind}_gbs"] / bandwidth, 1)
        if flops and ms > 0:
            row[f"{kind}_tflops"] = round(flops / (ms * 1e-3) / 1e12, 1)
        for base, timing in bases.items():
            ours, theirs = (t[timing] if timing else t for t in (triton, measured[base]))
            if ours[f"{kind}_ms"] > 0:
                row[f"{kind}_speedup_vs_{base}"] = round(theirs[f"{kind}_ms"] / ours[f"{kind}_ms"], 3)
    if case.missing:
        row["missing_baselines"] = case.missing
    eager_peak = measured["eager"]["peak_mb"]
    row["peak_mb_vs_eager"] = round(triton["peak_mb"] / eager_peak, 3) if eager_peak > 0 else None
    row["goal_met"] = goal_met(row) if row["peak_mb_vs_eager"] is not None else None
    return row


def _print(rows: list[dict], bandwidth: float, device_name: str, autotuned: dict) -> None:
    table = Table(title=f"kernels, bf16, {device_name}, copy bandwidth {bandwidth:,.0f} GB/s "
                        "(fwd+bwd; speed-up = their time / ours; ev: between CUDA events, where a graph failed)")
    for col in ("op", "shape", "timing", "ms", "GB/s", "% copy", "TFLOP/s", "vs eager", "vs compile", "vs other",
                "peak vs eager", "goal"):
        table.add_column(col)
    for r in rows:
        other = [k.removeprefix("fwd_bwd_speedup_vs_") for k in r if k.startswith("fwd_bwd_speedup_vs_")
                 and not k.endswith(("eager", "compile"))]
        events = {base for base, timing in r.get("speedup_timing", {}).items() if timing == "events"}

        def ratio(base):
            value = r.get(f"fwd_bwd_speedup_vs_{base}")
            return _fmt(value, "x") + (" ev" if value is not None and base in events else "")

        table.add_row(r["op"], r["shape"], (r["timing"] or "-").split(" ")[0],
                      f"{r['timings']['triton']['fwd_bwd_ms']:.3f}",
                      _fmt(r.get("fwd_bwd_gbs")), _fmt(r.get("fwd_bwd_copy_pct")), _fmt(r.get("fwd_bwd_tflops")),
                      ratio("eager"), ratio("compile"), ", ".join(f"{base} {ratio(base)}" for base in other) or "-",
                      _fmt(r.get("peak_mb_vs_eager"), "x"), {True: "met", False: "MISSED", None: "-"}[r["goal_met"]])
    console.print(table)
    for op, name, why in sorted({(r["op"], name, why) for r in rows for name, why in
                                 r.get("missing_baselines", {}).items()}):
        console.print(f"{op}: no {name} column: {why}", highlight=False)
    for r in rows:
        for name, times in r["timings"].items():
            if str(times.get("timing", "")).startswith("events"):
                console.print(f"{r['op']} {r['shape']} {name}: timed with {times['timing']}", highlight=False)
    console.print("autotuned (kernel: key -> config):" if autotuned else "autotuned: no kiln kernel was autotuned",
                  highlight=False)
    for kernel, choices in autotuned.items():
        for choice in choices:
            config = ", ".join(f"{k}={v}" for k, v in choice["config"].items())
            console.print(f"  {kernel}: {choice['key']} -> {config}", highlight=False, soft_wrap=True)


def _fmt(value, suffix: str = "") -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:,.2f}{suffix}"

