"""The IsoFLOP sweep (`kiln scaling sweep`) and the size it gives pretraining (`kiln scaling size`,
`model.size: auto`): the grid's arithmetic, skipping finished runs, resuming an interrupted sweep, and bad input."""

from __future__ import annotations

import contextlib
import csv
import dataclasses
import fcntl
import json
import math
import shutil

import pytest
from typer.testing import CliRunner

import kiln.pipeline.scaling.sweep as scaling_sweep
from kiln.model.gpt import GPT
from kiln.pipeline.cli import app
from kiln.pipeline.config import build_section
from kiln.pipeline.errors import UserError
from kiln.pipeline.train.size_choice import count_params
from kiln.pipeline.scaling.laws import compute_optimal
from kiln.pipeline.scaling.params import ScalingParams
from kiln.pipeline.scaling.size import choose_size
from kiln.pipeline.scaling.sweep import COLUMNS, plan, sweep
from kiln.pipeline.outputs import exclusive, lock_path
from kiln.pipeline.train.lm import LMData
from kiln.pipeline.train.params import ModelParams, TrainParams
from kiln.pipeline.train.pretrain import pretrain
from tests.test_code_digest import edit_code
from tests.test_train import fewer_shards

MODEL = {"max_seq_len": 16}
TRAIN = {"batch_size": 4, "lr": 1e-2, "min_lr": 1e-3, "device": "cpu"}  # the sweep's own copy of train.*
SCALING = {"budgets": [2e7, 4e7], "depths": [1, 2, 3], "aspect": 8, "head_dim": 4, "batch_tokens": 64,
           "warmup_fraction": 0.1, "eval_tokens": 256, **TRAIN}


def sections(scaling=None, model=None):
    return (build_section(ScalingParams, {**SCALING, **(scaling or {})}),
            build_section(ModelParams, {**MODEL, **(model or {})}))


def run_sweep(tiny, root, **kw):
    root.mkdir(exist_ok=True)
    with contextlib.chdir(root):
        metrics = sweep(*sections(**kw), tiny.shards, tiny.tokenizer, root / "scaling", root / "ckpt")
    with open(root / "scaling" / "runs.csv", newline="") as f:
        return metrics, list(csv.DictReader(f))


@pytest.fixture(scope="module")
def data(tiny):
    return LMData.load(tiny.shards, tiny.tokenizer)


def test_plan_spends_each_budget_on_d_equal_c_over_6n(data):
    runs = plan(*sections(scaling={"budgets": [1e9, 3e9], "depths": [4, 1, 2], "batch_tokens": 32}), data)
    assert [(r.budget, r.depth) for r in runs] == [(1e9, 1), (1e9, 2), (1e9, 4), (3e9, 1), (3e9, 2), (3e9, 4)]
    for run in runs:
        model = GPT(run.config)
        assert run.params == model.num_params() and run.non_embedding_params == model.num_params(embeddings=False)
        assert (run.config.n_layer, run.config.d_model, run.config.n_head) == (run.depth, 8 * run.depth, 2 * run.depth)
        # D = C / 6N to within one step of 32 tokens, and C = 6ND reported for the D actually trained.
        assert abs(run.tokens - run.budget / (6 * run.params)) <= 16
        assert run.flops == 6 * run.params * run.tokens
        steps = run.train.max_steps
        assert run.train.warmup_steps == round(0.1 * steps) and run.train.eval_every == steps
        assert run.train.batch_size == 2 and run.train.batch_tokens == 32  # one 32-token step = 2 sequences of 16
    # Bigger models get fewer tokens at one budget.
    assert runs[0].tokens > runs[1].tokens > runs[2].tokens


def test_fingerprint_follows_what_is_trained_not_how(tiny, data, tmp_path, monkeypatch):
    base = plan(*sections(), data)[0].fingerprint
    assert plan(*sections(scaling={"device": "auto", "compile": True}), data)[0].fingerprint == base
    observed = plan(*sections(scaling={"stats_every": 5}), data)[0]  # statistics: the same run, observed
    assert observed.fingerprint == base and observed.train.stats_every == 5
    assert plan(*sections(scaling={"lr": 2e-2}), data)[0].fingerprint != base
    muon = plan(*sections(scaling={"optimizer": "muon", "muon_lr": 0.03, "embed_lr": 0.1}), data)[0]
    # the sweep's own copy of pretraining's optimizer keys reaches every run
    assert (muon.train.optimizer, muon.train.muon_lr, muon.train.embed_lr) == ("muon", 0.03, 0.1)
    assert muon.fingerprint != base
    assert plan(*sections(scaling={"eval_tokens": 512}), data)[0].fingerprint != base
    assert plan(*sections(), dataclasses.replace(data, tokenizer_sha256="0" * 64))[0].fingerprint != base
    # runs.csv persists: after a change to the shards or to the sweep's code, no row of before is this run's
    fewer = LMData.load(fewer_shards(tiny.shards, tmp_path / "fewer"), tiny.tokenizer)
    assert fewer.tokenizer_sha256 == data.tokenizer_sha256 and plan(*sections(), fewer)[0].fingerprint != base
    edit_code("scaling_sweep", tmp_path / "fixed", monkeypatch)
    assert plan(*sections(), data)[0].fingerprint != base


@pytest.mark.slow  # sweep runs and a resume, ~10 s on 2 cores: `make test-slow`
def test_sweep_skips_finished_runs_and_resumes_an_interrupted_one(tiny, tmp_path, monkeypatch):
    # Another run's checkpoints under a run's folder (other params, another fingerprint) are not the sweep's.
    stranger = tmp_path / "ckpt" / "C2e+07_L1" / "0123456789ab" / "step_00000003" / "state.json"
    stranger.parent.mkdir(parents=True)
    stranger.write_text("{}")
    opened, write_rows = [], scaling_sweep.write_rows

    def opening(path, done):  # another sweep opens the lock file of the run just trained, before it is cleared
        folder = tmp_path / "ckpt" / done[-1]["run"]
        opened.append((folder, open(lock_path(folder), "a+")))
        write_rows(path, done)

    monkeypatch.setattr(scaling_sweep, "write_rows", opening)
    metrics, rows = run_sweep(tiny, tmp_path)
    monkeypatch.setattr(scaling_sweep, "write_rows", write_rows)
    assert metrics["trained"] == 6 and len(rows) == 6 and list(rows[0]) == list(COLUMNS)
    assert "C2e+07_L1" in {r["run"] for r in rows} and stranger.read_text() == "{}"
    shutil.rmtree(tmp_path / "ckpt" / "C2e+07_L1")
    # ... and locks it now: were the file removed, a third sweep would lock a new one, two in one folder
    assert {folder.name for folder, _ in opened} == {r["run"] for r in rows}
    for folder, second in opened:
        with second:
            fcntl.flock(second, fcntl.LOCK_EX | fcntl.LOCK_NB)
            with pytest.raises(UserError, match="in use by another kiln run"), exclusive(folder):
                pass
    for row in rows:
        assert float(row["flops"]) == pytest.approx(6 * int(row["params"]) * int(row["tokens"]), rel=1e-5)
        assert float(row["flops"]) == pytest.approx(float(row["budget"]), rel=0.25)  # whole steps of 64 tokens
        assert 0 < float(row["loss"]) < math.log(300) + 0.5 and float(row["bpb"]) > 0
    # finished runs leave no resume state, only their lock files
    assert {p.name for p in (tmp_path / "ckpt").iterdir()} == {f"{r['run']}.lock" for r in rows}
    assert (tmp_path / "scaling" / "curves" / rows[0]["run"] / "plots" / "metrics" / "val_loss.tsv").is_file()

    # Another budget trains only its three runs; the six earlier rows come back unchanged.
    metrics, more = run_sweep(tiny, tmp_path, scaling={"budgets": [2e7, 4e7, 8e7]})
    assert metrics["trained"] == 3 and metrics["reused"] == 6
    assert [r for r in more if r["budget"] != "8e+07"] == rows

    # An interrupted sweep keeps the runs that finished; the rerun trains the rest only.
    calls = []
    real = scaling_sweep.train_lm

    def stop_at_second_run(*args, **kwargs):
        calls.append(args[0])
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(scaling_sweep, "train_lm", stop_at_second_run)
    with pytest.raises(KeyboardInterrupt):
        run_sweep(tiny, tmp_path, scaling={"lr": 5e-3})  # another lr: every run is stale
    with open(tmp_path / "scaling" / "runs.csv", newline="") as f:
        kept = list(csv.DictReader(f))
    assert len(kept) == 1 and kept[0]["fingerprint"] not in {r["fingerprint"] for r in more}
    monkeypatch.setattr(scaling_sweep, "train_lm", real)
    metrics, rows = run_sweep(tiny, tmp_path, scaling={"lr": 5e-3})
    assert metrics["trained"] == 5 and len(rows) == 6 and rows[0] == kept[0]


def test_sweep_bad_input(tiny, tmp_path):
    with pytest.raises(UserError, match="scaling.batch_tokens=40: expected a multiple of model.max_seq_len=16"):
        run_sweep(tiny, tmp_path, scaling={"batch_tokens": 40})
    (tmp_path / "scaling").mkdir(parents=True)
    (tmp_path / "scaling" / "runs.csv").write_text("params,tokens,loss\n1,2,3\n")
    with pytest.raises(UserError, match="runs.csv: not a sweep's runs.csv"):
        run_sweep(tiny, tmp_path)
    for values, key in (({"budgets": [1e9]}, "scaling.budgets"), ({"depths": [1, 2]}, "scaling.depths"),
                        ({"aspect": 12, "head_dim": 8}, "scaling.aspect"),
                        ({"approach": "kaplan"}, "scaling.approach"), ({"precision": "fp4"}, "scaling.precision"),
                        ({"min_lr": 1.0}, "scaling.min_lr")):
        with pytest.raises(UserError, match=key):
            build_section(ScalingParams, values)


def test_yaml_exponent_numbers_are_floats():
    # PyYAML (YAML 1.1) reads `1e12` as a string; a budget written that way is still a number.
    assert build_section(ScalingParams, {"budgets": ["1e12", "3E12"], "target_flops": "2e13"}).budgets == [1e12, 3e12]
    with pytest.raises(UserError, match="scaling.budgets\\[0\\]='lots': expected a number"):
        build_section(ScalingParams, {"budgets": ["lots", 1e12]})


FIT = {"E": 1.69, "A": 406.4, "B": 410.7, "alpha": 0.34, "beta": 0.28, "a": 0.5, "k_n": 0.1}


def test_choose_size_takes_the_dial_model_nearest_to_n_opt():
    scaling, model = sections(scaling={"target_flops": 1e15, "approach": "parametric", "aspect": 16,
                                          "head_dim": 8})
    choice = choose_size(FIT, "fit.json", scaling, model, 1000)
    n_opt = compute_optimal(FIT, 1e15)[0]
    assert choice["n_opt"] == pytest.approx(n_opt)
    sizes = {depth: count_params(model.config(1000, **scaling.shape(depth)))[0] for depth in range(1, 40)}
    nearest = min(sizes, key=lambda depth: abs(math.log(sizes[depth] / n_opt)))
    assert choice["n_layer"] == nearest and choice["params"] == sizes[nearest]
    assert choice["tokens"] == round(1e15 / (6 * sizes[nearest]))
    iso = choose_size(FIT, "fit.json", build_section(ScalingParams, {"target_flops": 1e15, "aspect": 16,
                                                                     "head_dim": 8}), model, 1000)
    assert iso["n_opt"] == pytest.approx(0.1 * 1e15 ** 0.5)
    with pytest.raises(UserError, match="fit.json: lacks k_n"):
        choose_size({k: v for k, v in FIT.items() if k != "k_n"}, "fit.json", scaling, model, 1000)


def test_model_size_auto_trains_the_chosen_model(tiny, tmp_path):
    runner = CliRunner()
    fit = tmp_path / "fit.json"
    fit.write_text(json.dumps(FIT))
    params = tmp_path / "params.yaml"
    params.write_text(json.dumps({"model": {**MODEL, "size": "auto"}, "scaling": {**SCALING, "target_flops": 3e7}}))
    size = tmp_path / "size.json"
    result = runner.invoke(app, ["scaling", "size", "--params", str(params), "--fit", str(fit), "--tokenizer",
                                 str(tiny.tokenizer), "--out", str(size)])
    assert result.exit_code == 0, result.output
    choice = json.loads(size.read_text())
    assert "model.size auto" in result.output and choice["size"] == "auto"

    with contextlib.chdir(tmp_path):
        metrics = pretrain(build_section(ModelParams, {**MODEL, "size": "auto"}),
                           build_section(TrainParams, {**TRAIN, "batch_tokens": 64, "eval_tokens": 64}),
                           tiny.shards, tiny.tokenizer, tmp_path / "base", tmp_path / "ckpt", size)
    config = json.loads((tmp_path / "base" / "config.json").read_text())["model"]
    assert (config["n_layer"], config["d_model"]) == (choice["n_layer"], choice["d_model"])
    assert metrics["params"] == choice["params"] and metrics["tokens"] == choice["tokens"] // 64 * 64
    assert metrics["size_auto"]["n_layer"] == choice["n_layer"]

    # model.size fixed writes only that; pretrain with auto then refuses it, naming the command to run.
    params.write_text(json.dumps({"model": MODEL, "scaling": SCALING}))
    assert runner.invoke(app, ["scaling", "size", "--params", str(params), "--fit", str(fit), "--tokenizer",
                               str(tiny.tokenizer), "--out", str(size)]).exit_code == 0
    assert json.loads(size.read_text()) == {"size": "fixed"}
    result = runner.invoke(app, ["train", "--params", str(params), "--set", "model.size=auto", "--shards",
                                 str(tiny.shards), "--tokenizer", str(tiny.tokenizer), "--size", str(size)])
    assert result.exit_code == 2 and "written with model.size=fixed" in result.output
