"""`kiln bench kernels` times kernels on a GPU only; without one it says so instead of timing the interpreter.
Its `--size smoke` run on CPU is checked by test_bench_gpu, inside the GPU command's smoke run."""

import pytest
import torch
from typer.testing import CliRunner

from kiln.pipeline.cli import app
from kiln.pipeline.tools.bench_kernels import Case, _row, goal_met


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
