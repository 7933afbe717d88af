"""`kiln bench gpu --size smoke`: the GPU session's one command, run end to end at toy shapes on this CPU, so
that the session that has a GPU finds every step working and spends its minutes measuring."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from kiln.pipeline.cli import app
from kiln.pipeline.tools.bench_gpu import STEPS, headline
from kiln.pipeline.tools.bench_kernels import OPS


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpu-check")
    out, work = root / "out", root / "work"
    result = CliRunner().invoke(app, ["bench", "gpu", "--size", "smoke", "--out", str(out), "--work", str(work)])
    return result, out, work


def test_every_step_runs_and_the_summary_says_so(smoke):
    result, out, _ = smoke
    assert result.exit_code == 0, result.output
    summary = json.loads((out / "summary.json").read_text())
    assert [s["step"] for s in summary["steps"]] == list(STEPS)
    assert all(s["status"] == "ok" for s in summary["steps"]), summary["steps"]
    for step in summary["steps"]:
        assert (out / step["log"]).is_file()
    env = json.loads((out / "env.json").read_text())
    assert env["torch"] == torch.__version__ and env["date"]


def test_native_tests_ran_and_passed(smoke):
    _, out, _ = smoke
    junit = (out / "tests.xml").read_text()
    assert 'failures="0"' in junit and 'errors="0"' in junit and "test_torch_backend_is_reference" in junit


def test_kernel_table_has_every_op_and_baseline(smoke):
    _, out, _ = smoke
    report = json.loads((out / "kernels.json").read_text())
    assert report["size"] == "smoke" and "interpreter" in report["device_name"]
    assert [row["op"] for row in report["results"]] == list(OPS) and set(report["goals"]) == set(OPS)
    for row in report["results"]:
        assert row["timings"]["triton"]["fwd_bwd_ms"] > 0 and row["timings"]["eager"]["fwd_bwd_ms"] > 0
        assert "fwd_bwd_speedup_vs_eager" in row  # ~0 here: the interpreter against compiled torch
        assert "fwd_bwd_gbs" in row or "fwd_bwd_tflops" in row
        assert row["goal_met"] is None  # no peak memory on a CPU, so no verdict either way


def test_train_step_compares_torch_and_triton_kernels(smoke):
    _, out, _ = smoke
    rows = json.loads((out / "train.json").read_text())["results"]
    assert [r["kernels"] for r in rows] == ["torch", "triton"] and all(r["tokens_per_s"] > 0 for r in rows)


def test_real_pretrain_stage_ran_in_the_scratch_folder(smoke):
    _, out, work = smoke
    metrics = json.loads((out / "pretrain.json").read_text())["pretrain"]
    assert metrics["steps"] == 4 and metrics["val_loss"] > 0
    assert (out / "pretrain" / "curves.png").is_file()
    assert (work / "data" / "models" / "base" / "model.safetensors").is_file()
    summary = json.loads((out / "summary.json").read_text())
    assert summary["headline"]["pretrain_val_loss"] == metrics["val_loss"]


def test_generate_bench_wrote_rows(smoke):
    _, out, _ = smoke
    rows = json.loads((out / "generate.json").read_text())["results"]
    assert rows and all(r["decode_tokens_per_s"] > 0 for r in rows)


@pytest.mark.parametrize("args, named", [(["--size", "huge"], "--size 'huge'"),
                                         (["--steps", "env,lint"], "--steps lint"),
                                         (["--size", "quick"], "needs a CUDA GPU")])
def test_bad_options_exit_2_naming_them(tmp_path, monkeypatch, args, named):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    result = CliRunner().invoke(app, ["bench", "gpu", *args, "--out", str(tmp_path / "out")])
    assert result.exit_code == 2 and named in result.output, result.output
    assert not (tmp_path / "out").exists()


def test_a_failing_or_hanging_step_is_recorded_and_the_rest_still_run(tmp_path, monkeypatch):
    import sys

    from kiln.pipeline.tools import bench_gpu

    steps = [bench_gpu.Step("tests", [[sys.executable, "-c", "raise SystemExit(3)"]]),
             bench_gpu.Step("kernels", [[sys.executable, "-c", "import time; time.sleep(60)"]]),
             bench_gpu.Step("train", [[sys.executable, "-c", "print('ran')"]])]
    monkeypatch.setattr(bench_gpu, "plan", lambda size, out, work: steps)
    monkeypatch.setitem(bench_gpu.LIMITS, "smoke", {"tests": 30, "kernels": 2, "train": 30})
    out = tmp_path / "out"
    result = CliRunner().invoke(app, ["bench", "gpu", "--size", "smoke", "--steps", "tests,kernels,train",
                                      "--out", str(out), "--work", str(tmp_path / "work")])
    assert result.exit_code == 1, result.output
    status = {s["step"]: s["status"] for s in json.loads((out / "summary.json").read_text())["steps"]}
    assert status == {"tests": "exit 3", "kernels": "timed out after 2s", "train": "ok"}
    assert "ran" in (out / "train.log").read_text()


def test_headline_picks_the_fastest_variant_of_both_train_files(tmp_path):
    """compile + Triton is timed in a process of its own (train_compile_triton.json); it can be the best."""
    rows = {"train.json": [("bf16-eager-torch", 1.0), ("bf16-compile-torch", 3.0)],
            "train_compile_triton.json": [("bf16-compile-triton", 4.0)]}
    for name, variants in rows.items():
        results = [{"variant": v, "tokens_per_s": t, "mfu": t / 10} for v, t in variants]
        (tmp_path / name).write_text(json.dumps({"results": results}))
    assert headline(tmp_path) == {"best_train_variant": "bf16-compile-triton", "best_train_mfu": 0.4,
                                  "best_train_tokens_per_s": 4.0}
    (tmp_path / "train_compile_triton.json").unlink()  # it failed: the others still give the headline
    assert headline(tmp_path)["best_train_variant"] == "bf16-compile-torch"
