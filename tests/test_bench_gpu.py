"""`kiln bench gpu --size smoke`: the GPU session's one command, run end to end at toy shapes on this CPU, so
that the session that has a GPU finds every step working and spends its minutes measuring.

What a CPU checks is the plumbing: every step runs, writes its files, and the summary reads them back with the
right arithmetic. The GPU half (CUDA graphs, the native kernels and their CUDA-only tests) is checked on a GPU
only (`make gpu-check`): here those tests skip, and the summary says so rather than counting them as passed."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from kiln.pipeline.cli import app
from kiln.pipeline.tools.bench_gpu import GRAPHS_NOT_RUN, STEPS, headline, junit_results
from kiln.pipeline.tools.bench_kernels import OPS


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpu-check")
    out, work = root / "out", root / "work"
    result = CliRunner().invoke(app, ["bench", "gpu", "--size", "smoke", "--out", str(out), "--work", str(work)])
    return result, out, work


@pytest.mark.slow  # the smoke run of every step, ~2.5 min on 2 cores: `make test-slow`
def test_every_step_runs_and_the_summary_says_so(smoke):
    result, out, _ = smoke
    assert result.exit_code == 0, result.output
    summary = json.loads((out / "summary.json").read_text())
    assert [s["step"] for s in summary["steps"]] == list(STEPS) and summary["complete"]
    assert all(s["status"] == "ok" for s in summary["steps"]), summary["steps"]
    for step in summary["steps"]:
        assert (out / step["log"]).is_file()
    env = json.loads((out / "env.json").read_text())
    assert env["torch"] == torch.__version__ and env["date"]
    assert summary["checked_on"].startswith("cuda: " if torch.cuda.is_available() else "cpu: the GPU half not")


@pytest.mark.slow  # the smoke run of every step, ~2.5 min on 2 cores: `make test-slow`
def test_native_tests_ran_and_the_summary_counts_passed_apart_from_skipped(smoke):
    """The smoke run's tests are the torch backends' (`-k torch_backend`): they ran and passed, each of them, and
    the summary's counts are the JUnit file's, skipped ones apart."""
    from xml.etree import ElementTree

    _, out, _ = smoke
    cases = list(ElementTree.parse(out / "tests.xml").getroot().iter("testcase"))
    reference = [c for c in cases if c.get("name").startswith("test_torch_backend_is_reference")]
    assert reference and all(len(c) == 0 or all(child.tag in ("system-out", "system-err") for child in c)
                             for c in reference)  # no failure, error or skipped element: passed
    counts = json.loads((out / "summary.json").read_text())["headline"]["tests_results"]
    assert counts == junit_results(out / "tests.xml")
    assert counts["tests"] == len(cases) and counts["passed"] >= len(reference)
    assert counts["failed"] == counts["errors"] == 0


@pytest.mark.slow  # the smoke run of every step, ~2.5 min on 2 cores: `make test-slow`
def test_post_step_times_packed_against_padded_sft(smoke):
    """The packing issue's row: SFT's padded and packed rows on chat examples of mixed lengths the step wrote,
    agreeing on their loss, their ratio of non-pad tokens/s in the headline."""
    _, out, _ = smoke
    post = json.loads((out / "post.json").read_text())
    assert post["rows"]["packed"]["rows"] < post["rows"]["padded"]["rows"] and post["check_relative_difference"] < 1e-5
    headline = json.loads((out / "summary.json").read_text())["headline"]
    assert headline["post_packed_over_padded"] == post["packed_over_padded"] > 0


@pytest.mark.slow  # the smoke run of every step, ~2.5 min on 2 cores: `make test-slow`
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


@pytest.mark.slow  # the smoke run of every step, ~2.5 min on 2 cores: `make test-slow`
def test_train_step_compares_torch_and_triton_kernels_and_comes_first(smoke):
    """The headline (the training step with torch's kernels and kiln's) is the first step run and printed, and
    the first lines after its output say it again, before the kernels step starts."""
    result, out, _ = smoke
    rows = json.loads((out / "train.json").read_text())["results"]
    assert [r["kernels"] for r in rows] == ["torch", "triton", "triton:head"]
    assert all(r["tokens_per_s"] > 0 and r["top_ops"] for r in rows)
    steps = [line for line in result.output.splitlines() if line.startswith("== ")]
    assert steps == [f"== {step}" for step in STEPS if step != "env"]
    headline = result.output.index("headline: fp32-eager-torch: ")
    assert result.output.index("== train") < headline < result.output.index("headline: fp32-eager-triton: ") \
        < result.output.index("== kernels")
    summary = json.loads((out / "summary.json").read_text())
    assert summary["headline"]["train"]["fp32-eager-triton"]["tokens_per_s"] == rows[1]["tokens_per_s"]
    # each row's profile: its top operators, printed under its headline line
    top = rows[1]["top_ops"][0]
    assert summary["headline"]["train"]["fp32-eager-triton"]["top_ops"] == rows[1]["top_ops"]
    after = result.output[result.output.index("headline: fp32-eager-triton: "):]
    assert f"{top['self_ms_per_step']:7.2f} ms/step" in after.splitlines()[1] and top["op"] in after.splitlines()[1]


@pytest.mark.slow  # the smoke run of every step, ~2.5 min on 2 cores: `make test-slow`
def test_real_pretrain_stage_ran_in_the_scratch_folder(smoke):
    _, out, work = smoke
    metrics = json.loads((out / "pretrain.json").read_text())["pretrain"]
    assert metrics["steps"] == 4 and metrics["val_loss"] > 0
    assert (out / "pretrain" / "curves.png").is_file()
    assert (work / "run" / "model" / "model.safetensors").is_file()  # a hand run's folder, not data/
    summary = json.loads((out / "summary.json").read_text())
    assert summary["headline"]["pretrain_val_loss"] == metrics["val_loss"]
    # the Muon run beside it: the same steps from the same seed, and its step time against AdamW's
    muon = json.loads((out / "pretrain_muon.json").read_text())["pretrain"]
    assert muon["steps"] == 4 and muon["tokens"] == metrics["tokens"] and muon["val_loss"] != metrics["val_loss"]
    assert summary["headline"]["pretrain_muon_val_loss"] == muon["val_loss"]
    assert summary["headline"]["muon_step_time_vs_adamw"] > 0


@pytest.mark.slow  # the smoke run of every step, ~2.5 min on 2 cores: `make test-slow`
def test_generate_bench_wrote_rows_and_the_quantized_ones_beside_them(smoke):
    _, out, _ = smoke
    rows = json.loads((out / "generate.json").read_text())["results"]
    assert rows and all(r["decode_tokens_per_s"] > 0 for r in rows)
    kinds = json.loads((out / "generate_quantize.json").read_text())["quantize"]
    assert [k["quantize"] for k in kinds] == [None, "int8"]
    found = json.loads((out / "summary.json").read_text())["headline"]["generate_int8"]
    assert found == {k: kinds[1][k] for k in ("decode_speedup_vs_original", "linear_bytes", "kl_vs_original",
                                              "top1_agreement")}


@pytest.mark.slow  # the smoke run of every step, ~2.5 min on 2 cores: `make test-slow`
def test_grpo_ran_from_the_pretrained_model_graphed_and_eager(smoke):
    """The grpo step: the stage twice from pretrain's model, graphed (CUDA graphs asked for) and with
    grpo.enforce_eager, then the engine's graph tests. On a CPU the graph half is not exercised: the engine
    captures no graphs there, so both runs are eager and their ratio is noise, and the graph tests' CUDA cases
    skip; `make gpu-check` checks that half on a GPU. What this checks: both runs ran as asked and wrote their
    models and timings, the headline's figures are those files' own and its speedup the ratio of the two rates
    written, the graph tests that run on a CPU passed and the CUDA ones are counted as skipped, not passed, and
    the summary says the graph half was not run."""
    result, out, work = smoke
    log = (out / "grpo.log").read_text().splitlines()
    runs = [line for line in log if line.startswith("$ ") and " grpo " in line]
    assert len(runs) == 2 and "enforce_eager=true" not in runs[0] and runs[1].endswith("--set enforce_eager=true")
    timings = {how: json.loads((out / f"grpo_{how}.json").read_text()) for how in ("graphs", "eager")}
    for how, t in timings.items():
        assert t["rollout_tokens_per_s"] > 0 and 0 < t["generate_share"] < 1
        assert (work / "run" / f"grpo-{how}" / "model" / "model.safetensors").is_file()
    found = json.loads((out / "summary.json").read_text())["headline"]
    for how in ("graphs", "eager"):
        assert found[f"grpo_{how}_rollout_tokens_per_s"] == timings[how]["rollout_tokens_per_s"]
        assert found[f"grpo_{how}_seconds"] == timings[how]["seconds"]
    assert found["grpo_graphs_speedup"] == round(timings["graphs"]["rollout_tokens_per_s"]
                                                 / timings["eager"]["rollout_tokens_per_s"], 3)
    tests = found["grpo_tests_results"]
    assert tests == junit_results(out / "grpo_tests.xml")
    assert tests["failed"] == tests["errors"] == 0 and tests["passed"] > 0
    if torch.cuda.is_available():
        assert found["grpo_graphs_checked"] == "cuda"
    else:
        assert tests["skipped"] >= 2  # the CUDA graphs' replay and kept-engine tests
        assert tests["passed"] + tests["skipped"] == tests["tests"]
        assert found["grpo_graphs_checked"] == GRAPHS_NOT_RUN
        assert f"grpo_graphs_checked: {GRAPHS_NOT_RUN}" in " ".join(result.output.split())


def test_junit_counts_keep_skipped_failed_and_errored_tests_apart(tmp_path):
    xml = tmp_path / "t.xml"
    xml.write_text('<testsuites><testsuite name="pytest" tests="5">'
                   '<testcase name="a"/><testcase name="b"><system-out>hi</system-out></testcase>'
                   '<testcase name="c"><skipped message="CUDA graphs need a GPU"/></testcase>'
                   '<testcase name="d"><failure message="assert 1 == 2"/></testcase>'
                   '<testcase name="e"><error message="fixture"/></testcase></testsuite></testsuites>')
    assert junit_results(xml) == {"tests": 5, "passed": 2, "failed": 1, "errors": 1, "skipped": 1}


@pytest.mark.parametrize("cuda", [False, True])
def test_the_graph_verdict_names_where_the_grpo_runs_were(tmp_path, monkeypatch, cuda):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    for how, rate in (("graphs", 300.0), ("eager", 200.0)):
        (tmp_path / f"grpo_{how}.json").write_text(json.dumps({"rollout_tokens_per_s": rate, "generate_share": 0.5,
                                                               "seconds": 10.0}))
    found = headline(tmp_path)
    assert found["grpo_graphs_speedup"] == 1.5
    assert found["grpo_graphs_checked"] == ("cuda" if cuda else GRAPHS_NOT_RUN)


@pytest.mark.parametrize("args, named", [(["--size", "huge"], "--size 'huge'"),
                                         (["--steps", "env,lint"], "--steps lint"),
                                         (["--size", "quick"], "needs a CUDA GPU")])
def test_bad_options_exit_2_naming_them(tmp_path, monkeypatch, args, named):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    result = CliRunner().invoke(app, ["bench", "gpu", *args, "--out", str(tmp_path / "out")])
    assert result.exit_code == 2 and named in result.output, result.output
    assert not (tmp_path / "out").exists()


def test_a_failing_or_hanging_step_is_recorded_and_the_rest_still_run(tmp_path, monkeypatch):
    """...and summary.json and the --pack archive are rewritten after every step: the third step reads the
    first two back from them, as a GPU call cut off at its limit would return them."""
    import sys
    import tarfile

    from kiln.pipeline.tools import bench_gpu

    out, pack = tmp_path / "out", tmp_path / "gpu-check.tgz"
    read_back = ("import json, sys, tarfile; print([s['step'] for s in json.load(open(sys.argv[1]))['steps']], "
                 "sorted(m.name for m in tarfile.open(sys.argv[2]).getmembers()))")
    steps = [bench_gpu.Step("tests", [[sys.executable, "-c", "raise SystemExit(3)"]]),
             bench_gpu.Step("kernels", [[sys.executable, "-c", "import time; time.sleep(60)"]]),
             bench_gpu.Step("train", [[sys.executable, "-c", read_back, str(out / "summary.json"), str(pack)]])]
    monkeypatch.setattr(bench_gpu, "plan", lambda size, out, work: steps)
    monkeypatch.setitem(bench_gpu.LIMITS, "smoke", {"tests": 30, "kernels": 2, "train": 30})
    result = CliRunner().invoke(app, ["bench", "gpu", "--size", "smoke", "--steps", "tests,kernels,train",
                                      "--out", str(out), "--work", str(tmp_path / "work"), "--pack", str(pack)])
    assert result.exit_code == 1, result.output
    status = {s["step"]: s["status"] for s in json.loads((out / "summary.json").read_text())["steps"]}
    assert status == {"tests": "exit 3", "kernels": "timed out after 2s", "train": "ok"}
    root = out.as_posix().lstrip("/")
    during = (out / "train.log").read_text()
    assert f"['tests', 'kernels'] ['{root}', '{root}/kernels.log', '{root}/summary.json', '{root}/tests.log']" in during
    with tarfile.open(pack) as archive:
        assert f"{root}/train.log" in archive.getnames()
        assert json.load(archive.extractfile(f"{root}/summary.json"))["complete"]


def test_headline_gives_every_train_row_and_the_fastest(tmp_path):
    rows = [{"variant": "bf16-compile-torch", "tokens_per_s": 3.0, "mfu": 0.3, "peak_memory_gb": 9.0,
             "plan_memory_gb": 17.8, "batch_size": 16, "step_ms": 40.0, "speedup": 1.0},
            {"variant": "bf16-compile-triton", "error": "RuntimeError: device-side assert triggered"}]
    (tmp_path / "train.json").write_text(json.dumps({"results": rows}))
    found = headline(tmp_path)
    assert found["best_train_variant"] == "bf16-compile-torch" and found["best_train_tokens_per_s"] == 3.0
    assert found["train"]["bf16-compile-triton"] == {"error": rows[1]["error"]}
    assert found["train"]["bf16-compile-torch"]["peak_memory_gb"] == 9.0


def test_a_step_not_run_is_named_and_older_files_never_stand_in_for_it(tmp_path):
    """An older run's train.json and pretrain.json in the same --out: a run of env alone reports neither, and
    names the steps it did not run."""
    import os

    out = tmp_path / "out"
    out.mkdir()
    rows = [{"variant": "bf16-compile-torch", "tokens_per_s": 3.0, "mfu": 0.3, "peak_memory_gb": 9.0,
             "plan_memory_gb": 17.8, "batch_size": 16, "step_ms": 40.0, "speedup": 1.0}]
    (out / "train.json").write_text(json.dumps({"results": rows}))
    (out / "pretrain.json").write_text(json.dumps({"pretrain": {"val_loss": 5.28, "mfu": 0.4}}))
    for name in ("train.json", "pretrain.json"):
        os.utime(out / name, (1e9, 1e9))  # 2001: written long before this run
    assert headline(out)["pretrain_val_loss"] == 5.28  # read when no start time is given
    result = CliRunner().invoke(app, ["bench", "gpu", "--size", "smoke", "--steps", "env", "--out", str(out),
                                      "--work", str(tmp_path / "work")])
    assert result.exit_code == 0, result.output
    summary = json.loads((out / "summary.json").read_text())
    assert summary["headline"] == {} and summary["not_run"] == [s for s in STEPS if s != "env"]
    assert "not run: train, kernels, tests, pretrain, post, generate, serve, grpo" in result.output
    assert "headline:" not in result.output and "pretrain_val_loss" not in result.output


def test_quick_fits_one_device_call_and_splits_the_step_by_op(tmp_path):
    """Quick's step limits sum to 480 s (one 10-minute call with the wheels' install and the machine's start
    to spare); its train rows are torch's kernels, kiln's, kiln's head alone and attention alone, profiled."""
    from kiln.pipeline.tools.bench_gpu import LIMITS, SIZE_STEPS, plan

    steps = {step.name: step for step in plan("quick", tmp_path, tmp_path)}
    quick = [s for s in SIZE_STEPS["quick"] if s != "env"]
    assert sum(LIMITS["quick"][s] for s in quick) <= 480 and "generate" not in quick
    train = steps["train"].commands[0]
    variants = train[train.index("--variants") + 1].split(",")
    assert variants == ["bf16-compile-torch", "bf16-compile-triton", "bf16-compile-triton:head",
                        "bf16-compile-triton:attention"] and "--top-ops" in train
    # grpo is named to run (`--steps pretrain,grpo`): bf16 on CUDA, graphed and then eager
    assert "grpo" not in quick
    graphed, eager, tests = steps["grpo"].commands
    assert tests[3].endswith("test_serve_graphs.py")
    assert "train.device=cuda" in graphed and "train.precision=bf16" in graphed
    assert eager == [*graphed[:-1], "run/grpo-eager", "--set", "enforce_eager=true"]


def test_a_step_named_runs_where_its_size_leaves_it_out(tmp_path, monkeypatch):
    """Quick leaves grpo out unless --steps names it; named, it runs at quick's shapes."""
    import sys

    from kiln.pipeline.tools import bench_gpu

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # quick's check; the step itself is a stand-in
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    monkeypatch.setattr(bench_gpu, "plan", lambda size, out, work: [
        bench_gpu.Step(name, [[sys.executable, "-c", f"print('{size} {name}')"]]) for name in ("serve", "grpo")])
    result = CliRunner().invoke(app, ["bench", "gpu", "--steps", "grpo", "--out", str(tmp_path / "out"),
                                      "--work", str(tmp_path / "work")])
    assert result.exit_code == 0, result.output
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["size"] == "quick" and [s["step"] for s in summary["steps"]] == ["grpo"]
    assert "quick grpo" in (tmp_path / "out" / "grpo.log").read_text() and "grpo" not in summary["not_run"]
    assert summary["checked_on"] == "cuda: NVIDIA H200"


def test_a_running_step_is_packed_as_it_goes(tmp_path, monkeypatch):
    """A step's JSON rows reach the --pack archive while the step still runs (every PACK_EVERY seconds): a GPU
    call cut off inside a long step returns what the step had measured."""
    import sys
    import tarfile

    from kiln.pipeline.tools import bench_gpu

    out, pack = tmp_path / "out", tmp_path / "gpu-check.tgz"
    root = out.as_posix().lstrip("/")
    step = ("import sys, tarfile, time; open(sys.argv[1], 'w').write('{\"results\": []}'); time.sleep(3.5); "
            "print('packed while running:', sys.argv[2] in tarfile.open(sys.argv[3]).getnames())")
    steps = [bench_gpu.Step("train", [[sys.executable, "-c", step, str(out / "train.json"), f"{root}/train.json",
                                       str(pack)]])]
    monkeypatch.setattr(bench_gpu, "plan", lambda size, out, work: steps)
    monkeypatch.setattr(bench_gpu, "PACK_EVERY", 1)
    result = CliRunner().invoke(app, ["bench", "gpu", "--size", "smoke", "--steps", "train", "--out", str(out),
                                      "--work", str(tmp_path / "work"), "--pack", str(pack)])
    assert result.exit_code == 0, result.output
    assert "packed while running: True" in (out / "train.log").read_text()
