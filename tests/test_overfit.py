"""`kiln debug overfit`: a healthy model memorises one batch; one that cannot learn is reported, exit 1."""

import json

from typer.testing import CliRunner

from kiln.pipeline.cli import app

SMALL = ["--set", "model.n_layer=1", "--set", "model.d_model=32", "--set", "model.n_head=2", "--set",
         "model.n_kv_head=2", "--set", "model.max_seq_len=16", "--set", "batch_size=2"]


def overfit(tiny, tmp_path, *args):
    out = tmp_path / "overfit.json"
    result = CliRunner().invoke(app, ["debug", "overfit", "--shards", str(tiny.shards), "--tokenizer",
                                      str(tiny.tokenizer), *SMALL, "--out", str(out), *args])
    return result, json.loads(out.read_text()) if out.exists() else None


def test_a_healthy_model_drives_one_batch_to_zero(tiny, tmp_path):
    result, report = overfit(tiny, tmp_path, "--steps", "400", "--target", "0.05")
    assert result.exit_code == 0, result.output
    assert report["learned"] and report["losses"][-1] < 0.05 < report["losses"][0]
    assert report["steps"] == len(report["losses"]) < 400  # stops once there
    assert "learned: loss" in result.output


def test_a_model_that_cannot_learn_is_reported(tiny, tmp_path):
    result, report = overfit(tiny, tmp_path, "--steps", "15", "--lr", "0")
    assert result.exit_code == 1
    assert not report["learned"] and len(report["losses"]) == 15
    assert max(report["losses"]) - min(report["losses"]) < 1e-6  # lr 0: the weights never move
    assert "did not learn" in result.output and "learning rate 0" in result.output


def test_bad_arguments_are_one_line_errors(tiny, tmp_path):
    for args in (["--steps", "0"], ["--target", "-1"], ["--lr", "-0.1"], ["--lr", "nan"]):
        result, report = overfit(tiny, tmp_path, *args)
        assert result.exit_code == 2 and report is None, (args, result.output)
        assert f"{args[0]} {args[1]}" in result.output or f"{args[0]}={args[1]}" in result.output
        assert len(result.output.strip().splitlines()) == 1
