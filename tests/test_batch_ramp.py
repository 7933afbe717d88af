import contextlib
import math

import pytest
from safetensors.torch import load_file

from kiln.pipeline.config import build_section
from kiln.pipeline.errors import UserError
from kiln.pipeline.train.curves import metric_files, read_metric
from kiln.pipeline.train.loop import lr_at
from kiln.pipeline.train.params import ModelParams, TrainParams
from kiln.pipeline.train.pretrain import pretrain
from kiln.pipeline.train.ramp import BatchRamp
from tests.test_train import MODEL, TRAIN, checkpoints

# full batch 128 tokens, passes of 32, ramp over 256 tokens: by hand, step i has seen s tokens and takes
# 32 + 96 s / 256 tokens rounded down to whole passes: s = 0, 32, 64 -> 32; 96 -> 68 -> 64; 160 -> 92 -> 64;
# 224 -> 116 -> 96; from 320 (>= 256) the full 128.
SCHEDULE = [32, 32, 32, 64, 64, 96, 128, 128]


def test_ramp_arithmetic():
    ramp = BatchRamp(full=128, per_pass=32, ramp=256)
    assert [ramp.tokens(i) for i in range(8)] == SCHEDULE
    assert [ramp.accumulation(i) for i in range(8)] == [1, 1, 1, 2, 2, 3, 4, 4]
    assert ramp.seen(8) == sum(SCHEDULE) == 576
    assert ramp.lr_scale(0) == pytest.approx(0.5) and ramp.lr_scale(5) == pytest.approx(math.sqrt(0.75))
    assert ramp.lr_scale(7) == 1.0
    # run length in tokens: the most steps whose tokens fit
    assert ramp.steps_for(576) == 8 and ramp.steps_for(600) == 8 and ramp.steps_for(576 + 2 * 128) == 10
    assert ramp.steps_for(1) == 1
    off = BatchRamp(full=128, per_pass=32, ramp=0)
    assert [off.tokens(i) for i in range(3)] == [128] * 3 and off.steps_for(1000) == 7 and off.lr_scale(0) == 1.0
    # a pass larger than the ramp's start still grows in whole passes and never passes the full batch
    big = BatchRamp(full=120, per_pass=40, ramp=1000)
    assert all(big.tokens(i) in (40, 80, 120) for i in range(50)) and big.tokens(49) == 120


def ramp_run(tiny, root, **train):
    root.mkdir(exist_ok=True)
    params = {**TRAIN, "batch_size": 2, "batch_tokens": 128, "batch_ramp_tokens": 256, "max_steps": 8, **train}
    with contextlib.chdir(root):
        metrics = pretrain(build_section(ModelParams, MODEL), build_section(TrainParams, params),
                           tiny.shards, tiny.tokenizer, root / "base", root / "ckpt")
    return metrics, load_file(root / "base" / "model.safetensors")


def test_ramp_runs_the_schedule_and_resumes_mid_ramp_exactly(tiny, tmp_path):
    straight, w_straight = ramp_run(tiny, tmp_path / "a")
    assert straight["tokens"] == 576
    curves = metric_files(tmp_path / "a" / "metrics/pretrain")
    assert [v for _, v in read_metric(curves["batch_tokens"])] == SCHEDULE[1::2]  # logged every 2 steps
    p = build_section(TrainParams, {**TRAIN, "max_steps": 8})
    lrs = dict(read_metric(curves["lr"]))
    assert lrs[2] == pytest.approx(lr_at(1, 8, p) * 0.5) and lrs[8] == pytest.approx(lr_at(7, 8, p))

    ramp_run(tiny, tmp_path / "b")  # then stop it at step 4, mid-ramp, by removing the step-8 checkpoint
    last = checkpoints(tmp_path / "b" / "ckpt")[-1]
    assert last.name == "step_00000008"
    for f in last.iterdir():
        f.unlink()
    last.rmdir()
    resumed, w_resumed = ramp_run(tiny, tmp_path / "b")
    assert resumed["train_loss"] == straight["train_loss"] and resumed["tokens"] == 576
    for name, tensor in w_straight.items():
        assert (tensor - w_resumed[name]).abs().max() <= 1e-6, name


def test_a_ramp_without_one_is_the_plain_run(tiny, tmp_path):
    ramped, _ = ramp_run(tiny, tmp_path / "a", batch_ramp_tokens=0)
    assert ramped["tokens"] == 8 * 128


def test_a_negative_ramp_is_refused():
    with pytest.raises(UserError, match=r"train\.batch_ramp_tokens"):
        build_section(TrainParams, {"batch_ramp_tokens": -1})
