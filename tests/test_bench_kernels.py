"""`kiln bench kernels` times kernels on a GPU only; without one it says so instead of timing the interpreter."""

import torch
from typer.testing import CliRunner

from pipeline.cli import app


def test_without_cuda_it_says_it_needs_a_gpu(monkeypatch, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    out = tmp_path / "kernels.json"
    result = CliRunner().invoke(app, ["bench", "kernels", "--quick", "--out", str(out)])
    assert result.exit_code == 2
    assert "needs a CUDA GPU" in result.output and "Traceback" not in result.output
    assert not out.exists()


def test_row_derives_bandwidth_and_speedups_from_timings():
    from pipeline.bench_kernels import Case, _row

    case = Case("rms_norm", "4x8", make=list, run=lambda x, b: x, fwd_bytes=2_000_000, bwd_bytes=3_000_000)
    t = lambda fwd, both, peak: {"fwd_ms": fwd, "bwd_ms": both - fwd, "fwd_bwd_ms": both, "peak_mb": peak}
    row = _row(case, {"triton": t(0.002, 0.005, 10.0), "eager": t(0.004, 0.015, 40.0)}, bandwidth=2000.0)
    assert row["fwd_gbs"] == 1000.0 and row["fwd_copy_pct"] == 50.0  # 2 MB in 2 us = 1 TB/s, half of 2 TB/s
    assert row["fwd_bwd_gbs"] == 1000.0 and row["bwd_gbs"] == 1000.0
    assert row["fwd_speedup_vs_eager"] == 2.0 and row["fwd_bwd_speedup_vs_eager"] == 3.0
    assert row["peak_mb_vs_eager"] == 0.25
    assert "fwd_tflops" not in row  # a memory-bound op reports bandwidth, not FLOP/s
