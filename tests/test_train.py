import contextlib
import json
import math

import pytest
from safetensors.torch import load_file

from pipeline.errors import UserError
from pipeline.params import ModelParams, TrainParams, build_section
from pipeline.pretrain import pretrain
from pipeline.train import lr_at

MODEL = {"n_layer": 1, "n_head": 2, "n_kv_head": 1, "d_model": 32, "max_seq_len": 16}
TRAIN = {"batch_size": 4, "batch_tokens": 128, "lr": 1e-2, "min_lr": 1e-3, "warmup_steps": 2, "eval_every": 4,
         "eval_tokens": 256, "checkpoint_every": 4, "log_every": 2, "device": "cpu"}


def run(tiny, root, **train):
    with contextlib.chdir(root):
        metrics = pretrain(build_section(ModelParams, MODEL), build_section(TrainParams, {**TRAIN, **train}),
                           tiny.shards, tiny.tokenizer, root / "base", root / "ckpt")
    return metrics, load_file(root / "base" / "model.safetensors")


def test_resumed_run_equals_straight_run(tiny, tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    straight, w_straight = run(tiny, tmp_path / "a", max_steps=8)
    # Stop after 4 steps with the schedule of an 8-step run: a 4-step run has another schedule, so resume
    # is exercised by the checkpoint at step 4 of the same 8-step run, left alone by deleting the later one.
    run(tiny, tmp_path / "b", max_steps=8)
    ckpts = sorted((tmp_path / "b" / "ckpt").iterdir())
    assert [p.name for p in ckpts] == ["step_00000004", "step_00000008"]
    for f in ckpts[-1].iterdir():
        f.unlink()
    ckpts[-1].rmdir()
    resumed, w_resumed = run(tiny, tmp_path / "b", max_steps=8)
    assert resumed["train_loss"] == straight["train_loss"] and resumed["val_loss"] == straight["val_loss"]
    for name, tensor in w_straight.items():
        assert (tensor - w_resumed[name]).abs().max() <= 1e-6, name
    assert straight["val_loss"] < math.log(300)  # it learned something beyond uniform
    curve = (tmp_path / "b" / "metrics/pretrain/train.csv").read_text().splitlines()
    assert [line.split(",")[0] for line in curve] == ["step", "2", "4", "6", "8"]  # no duplicated rows
    assert json.loads((tmp_path / "b" / "metrics/pretrain.json").read_text())["steps"] == 8


def test_schedule_shapes():
    p = build_section(TrainParams, {"lr": 1.0, "min_lr": 0.1, "warmup_steps": 10})
    assert lr_at(0, 100, p) == pytest.approx(0.1) and lr_at(9, 100, p) == pytest.approx(1.0)
    assert lr_at(10, 100, p) == pytest.approx(1.0) and lr_at(100, 100, p) == pytest.approx(0.1)
    wsd = build_section(TrainParams, {"lr": 1.0, "min_lr": 0.0, "warmup_steps": 0, "schedule": "wsd",
                                      "decay_fraction": 0.2})
    assert lr_at(79, 100, wsd) == 1.0 and lr_at(99, 100, wsd) == pytest.approx(0.0)


def test_bad_model_params_name_the_key():
    with pytest.raises(UserError, match=r"model\.n_head"):
        build_section(ModelParams, {"d_model": 30, "n_head": 4})
    with pytest.raises(UserError, match=r"model\.n_kv_head"):
        build_section(ModelParams, {"n_head": 4, "n_kv_head": 3})
    with pytest.raises(UserError, match=r"train\.precision"):
        build_section(TrainParams, {"precision": "fp8"})


def test_batch_tokens_must_divide(tiny, tmp_path):
    with pytest.raises(UserError, match=r"train\.batch_tokens"):
        run(tiny, tmp_path, max_steps=2, batch_tokens=100)
