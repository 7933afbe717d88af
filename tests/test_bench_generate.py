"""`kiln bench generate` on a CPU at a tiny shape: the table's rows, the JSON and the input checks."""

from __future__ import annotations

import json
import time

import pytest
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


def test_quantized_rows_beside_the_originals(tmp_path, params):
    out = tmp_path / "g.json"
    result = CliRunner().invoke(app, ["bench", "generate", "--params", str(params), *ARGS, "--quantize", "int8",
                                      "--out", str(out)])
    assert result.exit_code == 0, result.output
    rows = {(row["batch_size"], row["cache"], row["quantize"]): row for row in json.loads(out.read_text())["results"]}
    assert list(rows) == [(1, True, None), (1, False, None), (3, True, None), (3, False, None), (1, True, "int8"),
                          (3, True, "int8")]
    for b in (1, 3):
        assert rows[b, True, "int8"]["decode_speedup_vs_original"] == round(
            rows[b, True, "int8"]["decode_tokens_per_s"] / rows[b, True, None]["decode_tokens_per_s"], 3)
    assert "batch 3, cache, int8" in result.output


@pytest.mark.parametrize("args, named", [
    (["--quantize", "int3"], "'int3'"),
    (["--quantize", "int4"], "--quantize int4"),  # TorchAO's int4 kernels need CUDA
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
