"""`kiln bench train` on a CPU, at a tiny shape and eager only: compiling would take most of a minute."""

from __future__ import annotations

import json
import timeit

import pytest
import torch
from typer.testing import CliRunner

from kiln.model.config import ModelConfig
from kiln.model.gpt import GPT
from kiln.pipeline.cli import app
from kiln.pipeline.errors import UserError

from conftest import imports_without_the_data_stack, write_params

# the library's model (tied, no QK-norm) and AdamW, whatever params.yaml's recipe: the figures below are computed
# from ModelConfig(**TINY) and plan memory's AdamW
TINY = {"n_layer": 1, "n_head": 2, "n_kv_head": 2, "d_model": 32, "max_seq_len": 32, "tie_embeddings": True,
        "qk_norm": False}
ARGS = ["--vocab-size", "300", "--seq-len", "16", "--batch-size", "2", "--steps", "2", "--warmup", "1",
        "--device", "cpu"]


def independent_cpu_flops(n: int = 512) -> float:
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    best = min(timeit.repeat(lambda: a @ b, number=1, repeat=5))
    return 2 * n**3 / best


@pytest.fixture
def params(tmp_path):
    return write_params(tmp_path / "params.yaml", {"model": TINY, "train": {"optimizer": "adamw"}})


def test_cli_writes_variants_ratios_and_mfu(tmp_path, params):
    out = tmp_path / "bench" / "train.json"
    result = CliRunner().invoke(app, ["bench", "train", "--params", str(params), "--set", "model.d_ff=64",
                                      "--variants", "fp32-eager,bf16-eager,fp32-eager-triton", *ARGS, "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert "fp32-eager-torch" in result.output and "speedup" in result.output
    report = json.loads(out.read_text())
    assert report["model"]["d_ff"] == 64 and report["model"]["vocab_size"] == 300
    assert report["machine"]["cpu_count"] >= 1 and report["device"] == "cpu"
    flops = GPT(ModelConfig(vocab_size=300, **TINY, d_ff=64)).flops_per_token(16)
    assert report["flops_per_token"] == flops
    rows = {row["variant"]: row for row in report["results"]}
    assert list(rows) == ["fp32-eager-torch", "bf16-eager-torch", "fp32-eager-triton"]
    assert report["baseline"] == "fp32-eager-torch" and rows["fp32-eager-torch"]["speedup"] == 1.0
    assert [row["kernels"] for row in rows.values()] == ["torch", "torch", "triton"]
    for row in rows.values():
        assert row["tokens_per_s"] > 0 and row["step_ms"] > 0
        assert row["compile"] is False and row["compile_seconds"] is None and row["peak_memory_gb"] is None
        # The peak is a matmul rate this CPU reaches: within 10x of one timed here independently (a unit or
        # formula slip in the bench would be off by 1e3 or more).
        assert 0.1 < row["peak_flops"] / independent_cpu_flops() < 10
        assert row["mfu"] == pytest.approx(flops * row["tokens_per_s"] / row["peak_flops"], abs=1e-6)
    assert rows["bf16-eager-torch"]["speedup"] == pytest.approx(
        rows["bf16-eager-torch"]["tokens_per_s"] / rows["fp32-eager-torch"]["tokens_per_s"], abs=1e-3)


@pytest.mark.parametrize("args, named", [
    (["--variants", "fp4-eager"], "fp4"),
    (["--variants", "fp32-jit"], "fp32-jit"),
    (["--variants", ","], "--variants"),
    (["--variants", "fp32-eager-cuda"], "fp32-eager-cuda"),
    (["--kernels", "cuda"], "--kernels 'cuda'"),
    (["--seq-len", "33"], "--seq-len 33"),
    (["--steps", "0"], "--steps 0"),
    (["--device", "tpu"], "--device 'tpu'"),
    (["--set", "model.n_head=3"], "model.n_head"),
    (["--compile-modes", "default,fast"], "--compile-modes 'fast'"),
    (["--plan-batch", "--device-gb", "0"], "--device-gb 0"),
    (["--plan-batch", "--device-gb", "0.0001"], "--plan-batch: not one sequence of 16 tokens fits"),
])
def test_cli_bad_input_exits_2_with_one_line(tmp_path, params, args, named):
    out = tmp_path / "train.json"
    result = CliRunner().invoke(app, ["bench", "train", "--params", str(params), *ARGS, *args, "--out", str(out)])
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and named in lines[0], result.output
    assert not out.exists()


def test_imports_without_the_data_stack():
    """A GPU machine may have torch and nothing of dvc, datasets or the tokenizers: the modules must load there."""
    imports_without_the_data_stack("kiln.pipeline.tools.bench_train", "kiln.pipeline.tools.bench_kernels",
                                   "kiln.pipeline.tools.bench_generate", "kiln.pipeline.tools.bench_gpu",
                                   "kiln.pipeline.cli")


def test_profile_writes_a_trace_per_variant_and_the_top_operators(tmp_path, params):
    out, traces = tmp_path / "train.json", tmp_path / "traces"
    result = CliRunner().invoke(app, ["bench", "train", "--params", str(params), "--variants", "fp32-eager", *ARGS,
                                      "--checkpointing", "--profile", str(traces), "--out", str(out)])
    assert result.exit_code == 0, result.output
    rows = json.loads(out.read_text())["results"]
    assert [r["variant"] for r in rows] == ["fp32-eager-torch", "fp32-eager-torch+checkpointing"]
    row = rows[1]
    trace = json.loads((traces / "fp32-eager-torch+checkpointing.json").read_text())
    names = {e.get("name") for e in trace["traceEvents"]}
    assert "aten::mm" in names and row["trace"] == str(traces / "fp32-eager-torch+checkpointing.json")
    ops = [op["op"] for op in row["top_ops"]]
    assert "aten::mm" in ops and 0 < sum(op["share"] for op in row["top_ops"]) <= 1
    assert "top operators by self CPU time" in result.output and row["activation_checkpointing"]
    # 1 block: q, k, v, o, gate, up, down (7) + the head, forward 8, backward 2 each (16); recomputed, 7 more
    calls = [next(op for op in r["top_ops"] if op["op"] == "aten::mm")["calls_per_step"] for r in rows]
    assert calls == [8 + 16, 8 + 16 + 7]


def test_statistics_rows_beside_the_plain_ones(tmp_path, params, monkeypatch):
    from kiln.pipeline.train.stats import StepStats

    attached = []
    real = StepStats.attach
    monkeypatch.setattr(StepStats, "attach", lambda self: attached.append(1) or real(self))
    out = tmp_path / "train.json"
    result = CliRunner().invoke(app, ["bench", "train", "--params", str(params), "--variants", "fp32-eager", *ARGS,
                                      "--stats-every", "1", "--out", str(out)])
    assert result.exit_code == 0, result.output
    rows = json.loads(out.read_text())["results"]
    assert [(r["variant"], r["stats_every"]) for r in rows] == [("fp32-eager-torch", 0),
                                                                 ("fp32-eager-torch+stats/1", 1)]
    assert len(attached) == 1 + 2  # the stats row's warmup step and its 2 timed steps, none in the plain row


def test_rows_compose_beside_each_variant():
    """Each lever adds rows beside every variant (compile modes only beside compiled ones) instead of a product."""
    from kiln.pipeline.tools.bench_train import parse_compile_modes, parse_variants, plan_runs

    variants = parse_variants("bf16-eager,bf16-compile,bf16-compile-triton")
    modes = parse_compile_modes("default,reduce-overhead")
    planned = {("bf16", False, False): 77, ("bf16", False, True): 150, ("bf16", True, True): 203}
    runs = plan_runs(variants, modes, 16, planned, True, 0, torch.device("cpu"))
    assert [(r.name, r.mode, r.batch_size) for r in runs] == [
        ("bf16-eager-torch", None, 16), ("bf16-eager-torch+batch77", None, 77),
        ("bf16-eager-torch+checkpointing", None, 16),
        ("bf16-compile-torch", "default", 16), ("bf16-compile-torch+reduce-overhead", "reduce-overhead", 16),
        ("bf16-compile-torch+batch150", "default", 150), ("bf16-compile-torch+checkpointing", "default", 16),
        ("bf16-compile-triton", "default", 16), ("bf16-compile-triton+reduce-overhead", "reduce-overhead", 16),
        ("bf16-compile-triton+batch203", "default", 203), ("bf16-compile-triton+checkpointing", "default", 16)]
    assert [r.checkpointing for r in runs].count(True) == 3


def test_variants_name_the_ops_that_take_the_kernels():
    """KERNELS[:OP+OP] keeps the op list in the variant; the plan counts kiln's head only where "head" is named;
    an unknown or empty op list is refused with one line naming the variant."""
    from kiln.pipeline.tools.bench_train import fused_head, kernel_choice, parse_variants

    variants = parse_variants("bf16-compile-torch,bf16-compile-triton:attention,bf16-compile-triton:head,"
                              "bf16-compile-triton:attention+head")
    assert [v[2] for v in variants] == ["torch", "triton:attention", "triton:head", "triton:attention+head"]
    cpu = torch.device("cpu")
    assert [fused_head(v[2], cpu) for v in variants] == [False, False, True, True]
    assert kernel_choice("triton:attention+head") == ("triton", ("attention", "head"))
    assert kernel_choice("auto") == ("auto", None)
    for bad in ("bf16-compile-triton:softmax", "bf16-compile-triton:"):
        with pytest.raises(UserError, match=f"--variants '{bad}'.*OP some of norm, mlp, attention, head"):
            parse_variants(bad)


def test_plan_batch_row_runs_plan_memorys_largest_fit_and_every_row_has_its_estimate(tmp_path, params):
    from kiln.pipeline.tools.plan_memory import Shape, plan

    out = tmp_path / "train.json"
    result = CliRunner().invoke(app, ["bench", "train", "--params", str(params), "--variants", "fp32-eager", *ARGS,
                                      "--plan-batch", "--device-gb", "0.01", "--out", str(out)])
    assert result.exit_code == 0, result.output
    config = ModelConfig(vocab_size=300, **TINY)
    largest = plan(Shape(config), 1, 16, int(0.01e9))["largest_batch_size"]
    rows = json.loads(out.read_text())["results"]
    assert 2 < largest and [(r["variant"], r["batch_size"]) for r in rows] == [
        ("fp32-eager-torch", 2), (f"fp32-eager-torch+batch{largest}", largest)]
    for row in rows:
        assert row["plan_memory_gb"] == round(plan(Shape(config), row["batch_size"], 16, None)["total_bytes"] / 1e9, 3)
        assert row["fused_adamw"] is False  # AdamW is fused on CUDA only
        assert row["padded_vocab_size"] == 320 and row["compile_mode"] is None
    assert "vocabulary rows allocated: 320 (of 300)" in result.output


def test_plan_batch_plans_a_compiled_variant_with_the_compiled_count():
    """A compiled torch-kernel variant gets the batch the compiled count fits (one logits tensor, not eager's
    three), so it is larger than its eager twin's; the key separates the two."""
    from kiln.pipeline.tools.bench_train import parse_variants, plan_batches
    from kiln.pipeline.tools.plan_memory import Shape, plan

    config = ModelConfig(vocab_size=50_000, **TINY)
    room = int(0.05e9)
    planned = plan_batches(parse_variants("fp32-eager,fp32-compile"), config, 16, room, torch.device("cpu"))
    eager = plan(Shape(config), 1, 16, room)["largest_batch_size"]
    compiled = plan(Shape(config, compiled=True), 1, 16, room)["largest_batch_size"]
    assert planned == {("fp32", False, False): eager, ("fp32", False, True): compiled}
    assert compiled > 1.5 * eager > 0


def test_a_failing_row_is_recorded_the_rest_run_and_the_command_exits_1(tmp_path, params, monkeypatch):
    """A row whose loss goes NaN (here: every bf16 step) fails alone; the row after it is measured and becomes
    the speedup baseline, and the JSON holds both."""
    from kiln.pipeline.tools import bench_train

    def loss(model, batch):
        value = model(*batch)
        return value * float("nan") if torch.is_autocast_enabled("cpu") else value

    monkeypatch.setattr(bench_train, "lm_loss", loss)
    out = tmp_path / "train.json"
    result = CliRunner().invoke(app, ["bench", "train", "--params", str(params), "--variants", "bf16-eager,fp32-eager",
                                      *ARGS, "--out", str(out)])
    assert result.exit_code == 1, result.output
    report = json.loads(out.read_text())
    failed, timed = report["results"]
    assert failed["variant"] == "bf16-eager-torch" and "loss is nan" in failed["error"]
    assert timed["tokens_per_s"] > 0 and timed["speedup"] == 1.0 and report["baseline"] == "fp32-eager-torch"
    assert report["complete"] and "1 of 2 rows failed, first bf16-eager-torch" in result.output


def test_fp8_variants_train_their_blocks_in_fp8(tmp_path, params, monkeypatch):
    """`fp8` (tensorwise) and `fp8rowwise` rows convert the model as a train.precision=fp8 run does, and count
    their MFU against the bf16 peak."""
    from kiln.pipeline.tools import bench_train

    recipes = []
    convert = bench_train.to_float8_training
    monkeypatch.setattr(bench_train, "to_float8_training",
                        lambda model, recipe, *a, **k: recipes.append(recipe) or convert(model, recipe, *a, **k))
    out = tmp_path / "train.json"
    result = CliRunner().invoke(app, ["bench", "train", "--params", str(params), "--variants",
                                      "bf16-eager,fp8-eager,fp8rowwise-eager", *ARGS, "--out", str(out)])
    assert result.exit_code == 0, result.output
    rows = {row["variant"]: row for row in json.loads(out.read_text())["results"]}
    assert list(rows) == ["bf16-eager-torch", "fp8-eager-torch", "fp8rowwise-eager-torch"]
    assert recipes == ["tensorwise", "rowwise"]
    assert {row["peak_flops"] for row in rows.values()} == {rows["bf16-eager-torch"]["peak_flops"]}
