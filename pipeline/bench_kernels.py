"""`kiln bench kernels`: each Triton kernel against torch eager and `torch.compile` of its reference, on a GPU.

For every op and LLM-typical shape it times forward, backward and forward+backward with
`triton.testing.do_bench` (median), and reports achieved GB/s from the bytes the op must move at the least
(read its inputs once, write its outputs once), that as a share of this device's copy bandwidth (measured in
the same run: `dst.copy_(src)` on 1 GiB), the speed-up over eager and over compile, and peak memory. Attention
and the fused linear+cross-entropy are compute-bound, so they report TFLOP/s instead of GB/s; attention is
also compared with `F.scaled_dot_product_attention` on its flash backend.

The interpreter cannot time anything meaningful, so on a machine without CUDA this says so and exits 2.
Only torch, triton, rich and kiln's light modules are imported (the GPU machine has no dvc).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from rich.table import Table

from pipeline.bench import machine
from pipeline.errors import UserError
from pipeline.files import write_json
from pipeline.progress import console

DTYPE = torch.bfloat16
BF16 = 2  # bytes per element


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


def randn(*shape, grad=True):
    return torch.randn(*shape, device="cuda", dtype=DTYPE, requires_grad=grad)


def cases(quick: bool) -> list[Case]:
    from kernels.cross_entropy import cross_entropy
    from kernels.flash_attention import flash_attention
    from kernels.linear_cross_entropy import linear_cross_entropy
    from kernels.rms_norm import rms_norm
    from kernels.rope import rope
    from kernels.swiglu import swiglu

    tokens = [4096, 16384] if quick else [4096, 16384, 32768]
    out = []
    for n in tokens:
        for h in ([768, 4096] if quick else [768, 4096, 8192]):
            out.append(Case("rms_norm", f"{n}x{h}", lambda n=n, h=h: [randn(n, h), randn(h)],
                            lambda x, b: rms_norm(x[0], x[1], 1e-5, backend=b),
                            fwd_bytes=2 * n * h * BF16, bwd_bytes=3 * n * h * BF16))
            f = h * 8 // 3 // 64 * 64
            out.append(Case("swiglu", f"{n}x{f}", lambda n=n, f=f: [randn(n, f), randn(n, f)],
                            lambda x, b: swiglu(x[0], x[1], backend=b),
                            fwd_bytes=3 * n * f * BF16, bwd_bytes=5 * n * f * BF16))
        for heads, kv, d in ([(12, 12, 64), (32, 8, 128)]):
            t = 2048
            b_ = max(1, n // t)
            table = torch.arange(t, device="cuda", dtype=torch.float32)[:, None] * torch.rand(d // 2, device="cuda")
            qk = b_ * t * (heads + kv) * d * BF16
            out.append(Case("rope", f"{b_}x{t}x{heads}/{kv}x{d}",
                            lambda b_=b_, t=t, heads=heads, kv=kv, d=d: [randn(b_, t, heads, d), randn(b_, t, kv, d)],
                            lambda x, b, table=table: rope(x[0], x[1], table.cos(), table.sin(), backend=b),
                            fwd_bytes=2 * qk, bwd_bytes=2 * qk))
        for v in ([32768, 128256] if quick else [32768, 50304, 128256]):
            rows = n // 4 if v > 100_000 else n
            out.append(Case("cross_entropy", f"{rows}x{v}",
                            lambda rows=rows, v=v: [randn(rows, v), torch.randint(v, (rows,), device="cuda")],
                            lambda x, b: cross_entropy(x[0], x[1], backend=b),
                            fwd_bytes=2 * rows * v * BF16, bwd_bytes=2 * rows * v * BF16,
                            extra={"F.cross_entropy": lambda x: F.cross_entropy(x[0].float(), x[1])}))
    for n, v, d in ([(8192, 50304, 768)] if quick else [(8192, 50304, 768), (16384, 128256, 4096)]):
        out.append(Case("linear_cross_entropy", f"{n}x{d}->{v}",
                        lambda n=n, v=v, d=d: [randn(n, d), randn(v, d), torch.randint(v, (n,), device="cuda")],
                        lambda x, b: linear_cross_entropy(x[0], x[1], x[2], backend=b),
                        fwd_flops=2 * n * v * d, bwd_flops=4 * n * v * d))
    for b_, heads, kv, t, d in ([(4, 12, 12, 2048, 64)] if quick else
                                [(4, 12, 12, 2048, 64), (2, 32, 8, 4096, 128), (1, 16, 16, 8192, 128)]):
        flops = 4 * b_ * heads * t * t * d // 2  # causal: half the score matrix
        out.append(Case("flash_attention", f"{b_}x{heads}/{kv}x{t}x{d}",
                        lambda b_=b_, heads=heads, kv=kv, t=t, d=d: [randn(b_, heads, t, d), randn(b_, kv, t, d),
                                                                     randn(b_, kv, t, d)],
                        lambda x, b: flash_attention(x[0], x[1], x[2], causal=True, backend=b),
                        fwd_flops=flops, bwd_flops=int(2.5 * flops),
                        extra={"sdpa flash": _sdpa_flash}))
    return out


def _sdpa_flash(x: list[torch.Tensor]) -> torch.Tensor:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        return F.scaled_dot_product_attention(x[0], x[1], x[2], is_causal=True, enable_gqa=x[0].size(1) != x[1].size(1))


def _first(out) -> torch.Tensor:
    return out[0] if isinstance(out, tuple) else out


def timings(fn: Callable[[list[torch.Tensor]], object], make: Callable[[], list[torch.Tensor]]) -> dict:
    """Median ms of forward and of forward+backward (backward = their difference), and the peak memory above
    the inputs of one forward+backward."""
    from triton.testing import do_bench

    inputs = make()
    leaves = [t for t in inputs if t.requires_grad]

    def fwd_bwd():
        outs = fn(inputs)
        outs = outs if isinstance(outs, tuple) else (outs,)
        torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])

    def clear():
        for t in leaves:
            t.grad = None

    fwd = do_bench(lambda: fn(inputs), return_mode="median")
    both = do_bench(fwd_bwd, grad_to_none=leaves, return_mode="median")
    clear()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fwd_bwd()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    clear()
    return {"fwd_ms": fwd, "bwd_ms": max(both - fwd, 0.0), "fwd_bwd_ms": both, "peak_mb": peak / 2**20}


def copy_bandwidth() -> float:
    """Device-to-device copy GB/s (read + write) on 1 GiB, the practical ceiling of a memory-bound kernel."""
    from triton.testing import do_bench

    src = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), return_mode="median")
    return 2 * src.numel() / (ms * 1e-3) / 1e9


def bench_kernels(ops: list[str] | None, quick: bool, compile_baseline: bool, out: Path) -> dict:
    if not torch.cuda.is_available():
        raise UserError("kiln bench kernels needs a CUDA GPU: kernel timings in Triton's CPU interpreter mean "
                        "nothing (the kernels' correctness tests run on CPU: `make test`)")
    selected = [c for c in cases(quick) if ops is None or c.op in ops]
    if not selected:
        raise UserError(f"--ops {','.join(ops or [])}: no such op (expected some of rms_norm, swiglu, rope, "
                        "cross_entropy, linear_cross_entropy, flash_attention)")
    bandwidth = copy_bandwidth()
    rows = []
    for case in selected:
        started = time.perf_counter()
        variants = {"triton": lambda x, c=case: c.run(x, "triton"), "eager": lambda x, c=case: c.run(x, "torch")}
        if compile_baseline:
            variants["compile"] = torch.compile(lambda x, c=case: c.run(x, "torch"))
        variants.update(case.extra)
        measured = {name: timings(fn, case.make) for name, fn in variants.items()}
        rows.append(_row(case, measured, bandwidth))
        torch._dynamo.reset()
        console.print(f"{case.op} {case.shape}: {time.perf_counter() - started:.1f}s", highlight=False)
    _print(rows, bandwidth)
    result = {"benchmark": "kernels", "device_name": torch.cuda.get_device_name(), "torch": torch.__version__,
              "triton": _triton_version(), "machine": machine(), "dtype": str(DTYPE).removeprefix("torch."),
              "copy_bandwidth_gbs": round(bandwidth, 1), "results": rows}
    write_json(out, result)
    console.print(f"wrote {out}", highlight=False)
    return result


def _row(case: Case, measured: dict[str, dict], bandwidth: float) -> dict:
    triton = measured["triton"]
    row = {"op": case.op, "shape": case.shape, "timings": measured}
    for kind, bytes_, flops in (("fwd", case.fwd_bytes, case.fwd_flops), ("bwd", case.bwd_bytes, case.bwd_flops),
                                ("fwd_bwd", case.fwd_bytes + case.bwd_bytes, case.fwd_flops + case.bwd_flops)):
        ms = triton[f"{kind}_ms"]
        if bytes_ and ms > 0:
            row[f"{kind}_gbs"] = round(bytes_ / (ms * 1e-3) / 1e9, 1)
            row[f"{kind}_copy_pct"] = round(100 * row[f"{kind}_gbs"] / bandwidth, 1)
        if flops and ms > 0:
            row[f"{kind}_tflops"] = round(flops / (ms * 1e-3) / 1e12, 1)
        for base in measured:
            if base != "triton" and ms > 0:
                row[f"{kind}_speedup_vs_{base}"] = round(measured[base][f"{kind}_ms"] / ms, 3)
    row["peak_mb_vs_eager"] = round(triton["peak_mb"] / max(measured["eager"]["peak_mb"], 1e-9), 3)
    return row


def _print(rows: list[dict], bandwidth: float) -> None:
    table = Table(title=f"kernels, bf16, {torch.cuda.get_device_name()}, copy bandwidth {bandwidth:,.0f} GB/s "
                        "(fwd+bwd; speed-up = their time / ours)")
    for col in ("op", "shape", "ms", "GB/s", "% copy", "TFLOP/s", "vs eager", "vs compile", "vs other",
                "peak vs eager"):
        table.add_column(col)
    for r in rows:
        other = [k for k in r if k.startswith("fwd_bwd_speedup_vs_") and not k.endswith(("eager", "compile"))]
        table.add_row(r["op"], r["shape"], f"{r['timings']['triton']['fwd_bwd_ms']:.3f}",
                      _fmt(r.get("fwd_bwd_gbs")), _fmt(r.get("fwd_bwd_copy_pct")), _fmt(r.get("fwd_bwd_tflops")),
                      _fmt(r.get("fwd_bwd_speedup_vs_eager"), "x"), _fmt(r.get("fwd_bwd_speedup_vs_compile"), "x"),
                      ", ".join(f"{k.removeprefix('fwd_bwd_speedup_vs_')} {r[k]:.2f}x" for k in other) or "-",
                      _fmt(r.get("peak_mb_vs_eager"), "x"))
    console.print(table)


def _fmt(value, suffix: str = "") -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:,.2f}{suffix}"


def _triton_version() -> str:
    import triton

    return triton.__version__
