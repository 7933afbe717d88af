"""`kiln seeds` (pipeline/tools/seeds.py): one stage per seed as hand runs, and the spread across them."""

import json
import statistics

import pytest
from typer.testing import CliRunner

from conftest import write_params
from kiln.pipeline.cli import app
from kiln.pipeline.tools.seeds import T95, summarise

MODEL = {"n_layer": 1, "n_head": 2, "n_kv_head": 1, "d_model": 32, "max_seq_len": 16}
TRAIN = {"batch_size": 4, "batch_tokens": 64, "max_steps": 3, "lr": 1e-2, "min_lr": 1e-3, "warmup_steps": 1,
         "eval_every": 3, "eval_tokens": 128, "checkpoint_every": 3, "log_every": 1, "device": "cpu"}


def test_summary_statistics_are_the_textbook_ones():
    runs = [{"loss": 4.0, "acc": 0.5}, {"loss": 4.5, "acc": 0.25}, {"loss": 4.1, "acc": 0.75, "only_here": 1.0}]
    got = summarise(runs)
    assert list(got) == ["loss", "acc"]  # a metric some run lacks is left out
    losses = [4.0, 4.5, 4.1]
    assert got["loss"]["mean"] == pytest.approx(statistics.mean(losses), abs=1e-12)
    assert got["loss"]["std"] == pytest.approx(statistics.stdev(losses), abs=1e-12)
    assert got["loss"]["spread"] == pytest.approx(0.5) and got["loss"]["min"] == 4.0 and got["loss"]["max"] == 4.5
    half = 4.303 * statistics.stdev(losses) / 3 ** 0.5  # Student's t, 2 degrees of freedom
    assert (got["loss"]["ci95_low"], got["loss"]["ci95_high"]) == pytest.approx((4.2 - half, 4.2 + half))
    assert T95[1] == 12.706 and T95[30] == 2.042  # tables: t(0.975; 1) and t(0.975; 30)


@pytest.mark.slow  # three training runs, ~20 s on 2 cores: `make test-slow`
def test_seeds_runs_each_seed_apart_and_reports_the_spread(tiny, tmp_path, monkeypatch):
    monkeypatch.chdir(tiny.root)  # the stage's default inputs: data/shards, data/tokenizer
    params = write_params(tmp_path / "params.yaml", {"model": MODEL, "train": TRAIN})
    out = tmp_path / "s"
    args = ["seeds", "pretrain", "--seeds", "5,6", "--params", str(params), "--set", "lr=0.02", "--out", str(out)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    runs = {s: json.loads((out / f"seed-{s}/metrics/pretrain.json").read_text())["pretrain"] for s in (5, 6)}
    assert runs[5]["val_loss"] != runs[6]["val_loss"]  # the seed reached the run: another init, another loss
    summary = json.loads((out / "seeds.json").read_text())
    assert summary["seeds"] == [5, 6] and summary["seed_key"] == "train.seed" and summary["set"] == ["lr=0.02"]
    loss = summary["metrics"]["val_loss"]
    assert loss["mean"] == pytest.approx((runs[5]["val_loss"] + runs[6]["val_loss"]) / 2)
    assert loss["spread"] == pytest.approx(abs(runs[5]["val_loss"] - runs[6]["val_loss"]))
    printed = result.output.splitlines()
    assert "seeds: pretrain over train.seed = 5, 6" in printed
    assert any(line.split()[:1] == ["val_loss"] and len(line.split()) >= 8 for line in printed)
    assert (tiny.root / "data").is_dir() and not (tiny.root / "runs").exists()  # nothing of the DAG's, no runs/
    # Given the same --out again, the finished seeds are read back, not rerun.
    again = CliRunner().invoke(app, args)
    assert again.exit_code == 0 and "-> " not in again.output
    assert json.loads((out / "seeds.json").read_text()) == summary
    # Another lr into the same --out exited 0 at once with the old runs' numbers, recorded beside the new lr.
    other = CliRunner().invoke(app, [*args[:6], "--set", "lr=0.0001", "--out", str(out)])
    assert other.exit_code == 2 and other.output.strip() == f"error: --out {out}: holds seed runs of another " \
        "command (set ['lr=0.02'] there, ['lr=0.0001'] now); their metrics are not this one's: choose another --out"
    assert json.loads((out / "seeds.json").read_text()) == summary


@pytest.mark.parametrize("args, expected", [
    (["pretrain", "--seeds", "1"], "--seeds '1': expected at least two different seeds"),
    (["pretrain", "--seeds", "1,x"], "--seeds '1,x': expected whole numbers separated by commas, e.g. 1,2,3"),
    (["evaluate"], "stage 'evaluate': expected one of pretrain, sft, dpo, grpo"),
    (["sft", "--set", "seed=4"], "--set sft.seed: the seed is what --seeds varies; expected it left out"),
])
def test_bad_seeds_arguments_fail_in_one_line(args, expected, tmp_path):
    result = CliRunner().invoke(app, ["seeds", *args, "--out", str(tmp_path / "s")])
    assert result.exit_code == 2 and result.output.strip() == f"error: kiln seeds: {expected}", result.output
    assert not (tmp_path / "s").exists()


def test_a_folder_of_other_files_is_refused_before_any_run(tmp_path):
    out = tmp_path / "s"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    (out / "plan.md").write_text("mine too")
    result = CliRunner().invoke(app, ["seeds", "pretrain", "--seeds", "1,2", "--out", str(out)])
    assert result.exit_code == 2 and result.output.strip() == \
        f"error: --out {out}: holds 'notes.txt' and 1 more, which kiln seeds does not write; choose another --out"
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt", "plan.md"]
