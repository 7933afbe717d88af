"""`kiln bench generate` on a CPU at a tiny shape: the table's rows, the JSON and the input checks."""

from __future__ import annotations

import json
import time

import pytest
import torch
from typer.testing import CliRunner

from kiln.model.checkpoint import save_model
from kiln.model.config import ModelConfig
from kiln.model.gpt import GPT
from kiln.pipeline.cli import app

from conftest import imports_without_the_data_stack, write_params

TINY = {"n_layer": 1, "n_head": 2, "n_kv_head": 1, "d_model": 32, "max_seq_len": 24}
ARGS = ["--vocab-size", "300", "--batch-sizes", "1,3", "--prompt-len", "5", "--new-tokens", "6", "--repeats", "1",
        "--device", "cpu"]


@pytest.fixture
def params(tmp_path):
    return write_params(tmp_path / "params.yaml", {"model": TINY})


def test_cli_times_every_batch_with_and_without_cache(tmp_path, params):
    out = tmp_path / "bench" / "generate.json"
    start = time.perf_counter()
    result = CliRunner().invoke(app, ["bench", "generate", "--params", str(params), *ARGS, "--out", str(out)])
    wall = time.perf_counter() - start
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    assert report["model"]["n_kv_head"] == 1 and report["model_dir"] is None
    assert (report["prompt_len"], report["new_tokens"], report["dtype"]) == (5, 6, "fp32")
    rows = {(row["batch_size"], row["cache"]): row for row in report["results"]}
    assert list(rows) == [(1, True), (1, False), (3, True), (3, False)]
    for (batch, cache), row in rows.items():
        # the rates in the units they claim, held against this process's own clock: a prefill of batch x 5
        # tokens and 6 decode steps each took place inside the command's wall time
        assert 0 < batch * 5 / row["prefill_tokens_per_s"] <= wall and 0 < row["prefill_ms"] / 1e3 <= wall
        assert 0 < 6 * batch / row["decode_tokens_per_s"] <= wall and 0 < 6 * row["decode_ms_per_token"] / 1e3 <= wall
    assert all(rows[b, False]["decode_speedup_vs_no_cache"] == 1.0 for b in (1, 3))
    assert "batch 3, no cache" in result.output


def test_cli_loads_a_trained_model(tmp_path, params):
    m = GPT(ModelConfig(vocab_size=50, **TINY))
    save_model(m, m.config, tmp_path / "m", {})
    out = tmp_path / "g.json"
    result = CliRunner().invoke(app, ["bench", "generate", "--model", str(tmp_path / "m"), *ARGS, "--out", str(out)])
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    assert report["model"]["vocab_size"] == 50 and report["model_dir"] == str(tmp_path / "m")


def test_quantized_rows_beside_the_originals_and_what_each_kind_costs(tmp_path, params):
    out = tmp_path / "g.json"
    result = CliRunner().invoke(app, ["bench", "generate", "--params", str(params), *ARGS, "--repeats", "3",
                                      "--quantize", "int8", "--out", str(out)])
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    rows = {(row["batch_size"], row["cache"], row["quantize"]): row for row in report["results"]}
    assert list(rows) == [(1, True, None), (1, False, None), (3, True, None), (3, False, None), (1, True, "int8"),
                          (3, True, "int8")]
    for row in rows.values():  # the median call lies within the slowest and fastest of the three
        low, high = row["decode_tokens_per_s_spread"]
        assert 0 < low <= row["decode_tokens_per_s"] <= high
    for b in (1, 3):
        row = rows[b, True, "int8"]
        assert row["decode_speedup_vs_original"] == round(
            row["decode_tokens_per_s"] / rows[b, True, None]["decode_tokens_per_s"], 3)
        low, high = row["decode_speedup_vs_original_spread"]  # call by call: each the ratio of two timed calls
        assert 0 < low <= high
    assert "batch 3, cache, int8" in result.output
    # what each kind costs and buys, at the first batch size: a quarter of the linear weights' bytes (with the
    # scales), the decode rate of its row, and a small, non-zero change in the predictions
    original, int8 = report["quantize"]
    assert original["quantize"] is None and int8["quantize"] == "int8"
    assert int8["linear_bytes"] < original["linear_bytes"] / 3
    assert original["model_bytes"] - int8["model_bytes"] == original["linear_bytes"] - int8["linear_bytes"]
    assert int8["decode_tokens_per_s"] == rows[1, True, "int8"]["decode_tokens_per_s"]
    assert int8["decode_speedup_vs_original"] == rows[1, True, "int8"]["decode_speedup_vs_original"]
    assert 0 < int8["kl_vs_original"] < 1e-3 and 0 < int8["max_logit_diff"] < 0.1
    assert abs(int8["nll_delta"]) < 1e-2 and 0.9 <= int8["top1_agreement"] <= 1
    assert "what each kind costs and buys" in result.output


def test_timed_calls_are_interleaved(tmp_path, params, monkeypatch):
    """Every variant's warm-up, then every variant's first call, then every variant's second: a machine that slows
    down for a while slows every variant alike."""
    from kiln.pipeline.tools import bench_generate

    calls = []

    def timed(model, batch_size, prompt_len, new_tokens, cache, seed):
        calls.append((batch_size, cache, new_tokens, seed))
        return {"prefill_s": 0.01, "decode_s": 0.02 + seed / 100}

    monkeypatch.setattr(bench_generate, "time_generation", timed)
    result = CliRunner().invoke(app, ["bench", "generate", "--params", str(params), *ARGS, "--repeats", "2",
                                      "--out", str(tmp_path / "g.json")])
    assert result.exit_code == 0, result.output
    variants = [(1, True), (1, False), (3, True), (3, False)]
    assert calls == [(*v, 4, 0) for v in variants] + [(*v, 6, r) for r in range(2) for v in variants]
    row = json.loads((tmp_path / "g.json").read_text())["results"][0]
    assert row["decode_tokens_per_s_spread"] == [round(5 / 0.03, 1), round(5 / 0.02, 1)]


def test_quality_is_zero_against_itself_and_kl_against_another():
    from kiln.pipeline.tools.bench_generate import quality

    torch.manual_seed(0)
    a, b = GPT(ModelConfig(vocab_size=50, **TINY)).eval(), GPT(ModelConfig(vocab_size=50, **TINY)).eval()
    text = torch.randint(0, 50, (2, 12))
    assert quality(a, a, text) == {"kl_vs_original": 0.0, "nll_delta": 0.0, "max_logit_diff": 0.0,
                                   "top1_agreement": 1.0}
    other = quality(a, b, text)
    with torch.no_grad():
        p, q = a(text[:, :-1]).double().log_softmax(-1), b(text[:, :-1]).double().log_softmax(-1)
    assert other["kl_vs_original"] == pytest.approx(torch.nn.functional.kl_div(
        q, p, log_target=True, reduction="none").sum(-1).mean().item())
    assert other["kl_vs_original"] > 0 and other["max_logit_diff"] > 0


@pytest.mark.parametrize("args, named", [
    (["--quantize", "int3"], "'int3'"),
    (["--quantize", "int4"], "--quantize int4"),  # TorchAO's int4 kernels need a CUDA GPU
    (["--batch-sizes", "1,x"], "--batch-sizes"),
    (["--batch-sizes", "0"], "--batch-sizes 0"),
    (["--new-tokens", "30"], "--new-tokens 30"),
    (["--dtype", "fp8"], "--dtype 'fp8'"),
    (["--model", "nowhere"], "nowhere"),
])
def test_cli_bad_input_exits_2(tmp_path, params, args, named):
    out = tmp_path / "g.json"
    result = CliRunner().invoke(app, ["bench", "generate", "--params", str(params), *ARGS, *args, "--out", str(out)])
    assert result.exit_code == 2, result.output
    assert named in result.output and not out.exists()


def test_imports_without_the_data_stack():
    imports_without_the_data_stack("kiln.pipeline.tools.bench_generate")
