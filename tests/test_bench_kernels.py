"""`kiln bench kernels` times kernels on a GPU only; without one it says so instead of timing the interpreter.
Its `--size smoke` run on CPU is checked by test_bench_gpu, inside the GPU command's smoke run."""

import json

import pytest
import torch
from typer.testing import CliRunner

from kiln.pipeline.cli import app
from kiln.pipeline.tools.bench_kernels import Case, _row, bench_kernels, cases, goal_met


def test_without_cuda_it_says_it_needs_a_gpu(monkeypatch, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    out = tmp_path / "kernels.json"
    result = CliRunner().invoke(app, ["bench", "kernels", "--size", "quick", "--out", str(out)])
    assert result.exit_code == 2
    assert "needs a CUDA GPU" in result.output and "Traceback" not in result.output
    assert not out.exists()


@pytest.mark.parametrize("args, named", [(["--size", "huge"], "--size 'huge'"),
                                         (["--ops", "rms_norm,layer_norm"], "--ops layer_norm")])
def test_bad_options_exit_2_naming_them(tmp_path, args, named):
    out = tmp_path / "kernels.json"
    result = CliRunner().invoke(app, ["bench", "kernels", *args, "--out", str(out)])
    assert result.exit_code == 2 and named in result.output, result.output
    assert not out.exists()


def t(fwd, both, peak):
    return {"fwd_ms": fwd, "bwd_ms": both - fwd, "fwd_bwd_ms": both, "peak_mb": peak}


def test_row_derives_bandwidth_and_speedups_from_timings():
    case = Case("rms_norm", "4x8", make=list, run=lambda x, b: x, fwd_bytes=2_000_000, bwd_bytes=3_000_000)
    row = _row(case, {"triton": t(0.002, 0.005, 10.0), "eager": t(0.004, 0.015, 40.0),
                      "liger": {"error": "RuntimeError: no"}}, bandwidth=2000.0)
    assert row["fwd_gbs"] == 1000.0 and row["fwd_copy_pct"] == 50.0  # 2 MB in 2 us = 1 TB/s, half of 2 TB/s
    assert row["fwd_bwd_gbs"] == 1000.0 and row["bwd_gbs"] == 1000.0
    assert row["fwd_speedup_vs_eager"] == 2.0 and row["fwd_bwd_speedup_vs_eager"] == 3.0
    assert row["peak_mb_vs_eager"] == 0.25
    assert "fwd_tflops" not in row  # a memory-bound op reports bandwidth, not FLOP/s
    assert "fwd_bwd_speedup_vs_liger" not in row and row["goal_met"] is None  # a failed baseline gives no ratio


def test_row_says_why_a_baseline_is_missing():
    case = Case("nf4_dequantize", "4x8", make=list, run=lambda x, b: x, fwd_bytes=1000,
                missing={"unsloth": "not installed"})
    row = _row(case, {"triton": t(0.001, 0.001, 0.0), "eager": t(0.002, 0.002, 0.0)}, bandwidth=2000.0)
    assert row["missing_baselines"] == {"unsloth": "not installed"}
    assert "missing_baselines" not in _row(Case("swiglu", "4x8", make=list, run=lambda x, b: x, fwd_bytes=1000),
                                           {"triton": t(0.001, 0.001, 0.0), "eager": t(0.002, 0.002, 0.0)}, 2000.0)


def test_nf4_bytes_moved_are_codes_absmaxes_scales_offset_in_and_bf16_out():
    (case,) = [c for c in cases("full", torch.device("cpu")) if c.shape == "4096x11008"]
    n = 4096 * 11008  # 704,512 blocks of 64, 2,752 groups of 256
    assert case.fwd_bytes == n // 2 + 704_512 + 4 * 2_752 + 4 + 2 * n and case.bwd_bytes == 0


def test_nf4_smoke_rows_run_the_kernel_and_account_for_both_baselines(tmp_path):
    """On CPU through the interpreter (or natively on a GPU): the row has its bandwidth, and bitsandbytes and
    Unsloth are each timed or named with the reason they could not be."""
    report = bench_kernels(["nf4_dequantize"], "smoke", False, tmp_path / "kernels.json")
    (row,) = report["results"]
    assert row["op"] == "nf4_dequantize" and row["shape"] == "64x128"
    assert "fwd_gbs" in row and "fwd_bwd_speedup_vs_eager" in row  # ~0 GB/s in the interpreter
    for baseline in ("bitsandbytes", "unsloth"):
        assert (baseline in row["timings"]) != (baseline in row.get("missing_baselines", {}))
    if not torch.cuda.is_available():
        assert row["missing_baselines"] == {"bitsandbytes": "CUDA only", "unsloth": "CUDA only"}
    assert "unsloth" in report and "bitsandbytes" in report


@pytest.mark.parametrize("copy_pct, vs_compile, vs_liger, met", [
    (90.0, 1.1, 1.0, True), (80.0, 1.1, 1.0, False), (90.0, 0.9, 1.2, False), (90.0, 1.2, 0.95, False)])
def test_memory_bound_goal(copy_pct, vs_compile, vs_liger, met):
    row = {"op": "swiglu", "fwd_bwd_copy_pct": copy_pct, "fwd_bwd_speedup_vs_compile": vs_compile,
           "fwd_bwd_speedup_vs_liger": vs_liger, "peak_mb_vs_eager": 1.0}
    assert goal_met(row) is met


@pytest.mark.parametrize("op, row, met", [
    ("linear_cross_entropy", {"peak_mb_vs_eager": 0.15, "fwd_bwd_speedup_vs_eager": 1.0}, True),
    ("linear_cross_entropy", {"peak_mb_vs_eager": 0.25, "fwd_bwd_speedup_vs_eager": 1.5}, False),
    ("linear_cross_entropy", {"peak_mb_vs_eager": 0.15, "fwd_bwd_speedup_vs_eager": 0.9}, False),
    ("flash_attention", {"fwd_bwd_speedup_vs_sdpa flash": 0.7}, True),  # 1.43x SDPA's time
    ("flash_attention", {"fwd_bwd_speedup_vs_sdpa flash": 0.6}, False),  # 1.67x
    ("nf4_dequantize", {"fwd_bwd_speedup_vs_unsloth": 1.2}, True),
    ("nf4_dequantize", {"fwd_bwd_speedup_vs_unsloth": 1.1}, False),
    ("nf4_dequantize", {"fwd_bwd_speedup_vs_bitsandbytes": 3.0}, None),  # no Unsloth, no verdict
])
def test_compute_bound_goals(op, row, met):
    assert goal_met({"op": op, **row}) is met


def timed(graph: tuple[float, float] | None, events: tuple[float, float]) -> dict:
    """A CUDA measurement as timings() returns it: the graph's ms on top where the capture worked."""
    as_ms = lambda pair: None if pair is None else t(*pair, 0.0)
    top = as_ms(graph or events)
    return {**top, "peak_mb": 10.0, "timing": "cudagraph" if graph else "events (capture failed: RuntimeError: x)",
            "cudagraph": as_ms(graph), "events": as_ms(events)}


def test_ratios_compare_graph_with_graph_and_events_with_events():
    """A baseline whose capture failed is compared on events with ours on events: the graph removed host time
    from our number only, and dividing its event time by it would flatter ours."""
    case = Case("swiglu", "4x8", make=list, run=lambda x, b: x, fwd_bytes=2_000_000, bwd_bytes=2_000_000)
    row = _row(case, {"triton": timed((0.002, 0.004), (0.010, 0.040)), "eager": timed((0.004, 0.012), (0.012, 0.060)),
                      "liger": timed(None, (0.010, 0.080))}, bandwidth=2000.0)
    assert row["timing"] == "cudagraph" and row["fwd_bwd_gbs"] == 1000.0  # 4 MB in the graph's 4 us
    assert row["speedup_timing"] == {"eager": "cudagraph", "liger": "events"}
    assert row["fwd_bwd_speedup_vs_eager"] == 3.0 and row["fwd_speedup_vs_eager"] == 2.0
    assert row["fwd_bwd_speedup_vs_liger"] == 2.0  # 0.080 / 0.040 on events, not 0.080 / 0.004


def test_smoke_run_saves_the_autotuned_configs_and_every_row_as_it_goes(tmp_path, monkeypatch):
    from kiln.kernels.launch import picked
    from kiln.pipeline.tools import bench_kernels as bench

    out = tmp_path / "kernels.json"
    report = bench.bench_kernels(["rms_norm"], "smoke", False, out)
    assert report["complete"] and report["results"][0]["timing"] == "cpu timer"
    assert report["autotuned"] == picked() and report["autotuned"]
    assert all(choice["config"] for choices in report["autotuned"].values() for choice in choices)

    def broken(x, backend):
        raise RuntimeError("the second op failed")

    real = bench.cases("smoke", torch.device("cpu"))[0]
    monkeypatch.setattr(bench, "cases", lambda size, device: [real, Case("swiglu", "1x1", make=list, run=broken)])
    with pytest.raises(RuntimeError, match="second op"):
        bench.bench_kernels(None, "smoke", False, out)
    saved = json.loads(out.read_text())
    assert not saved["complete"] and [r["op"] for r in saved["results"]] == [real.op]
