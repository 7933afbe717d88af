"""Two-process runs on CPU (gloo), started by torchrun exactly as users start them, against one process.

The global micro-batch is the same in every run (8 sequences: 8 on one process, 4 on each of two), so the
windows drawn and the updates made are the same; only float summation order differs.
"""

import json
import shutil
import subprocess
import sys

import pytest
from safetensors.torch import load_file
from test_train import cli_project, kiln, run

from kiln.pipeline.train.curves import metric_files, read_metric

SHAPE = {"batch_tokens": 256, "max_steps": 8, "checkpoint_every": 4, "log_every": 1}  # 2 micro-steps per step


@pytest.fixture(scope="module")
def single(tiny, tmp_path_factory):
    root = tmp_path_factory.mktemp("single")
    metrics, weights = run(tiny, root, batch_size=8, **SHAPE)
    return metrics, weights, losses(root)


def losses(root):
    return read_metric(metric_files(root / "metrics/pretrain")["loss"])


def torchrun(root, *args):
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           "-m", "kiln.pipeline.cli", *args], cwd=root, capture_output=True, text=True)
    done.output = done.stdout + done.stderr
    return done


def assert_same_run(root, single, abs=1e-5):
    metrics, weights, curve = single
    assert [s for s, _ in losses(root)] == list(range(1, 9))  # one writer: no step logged twice
    for (_, a), (_, b) in zip(curve, losses(root)):
        assert b == pytest.approx(a, abs=abs)
    written = json.loads((root / "metrics/pretrain.json").read_text())["pretrain"]
    assert written["val_loss"] == pytest.approx(metrics["val_loss"], abs=abs)
    assert written["tokens"] == metrics["tokens"]
    mine = load_file(root / "base" / "model.safetensors")
    assert mine.keys() == weights.keys()
    for name, tensor in weights.items():
        assert (tensor - mine[name]).abs().max() < abs, name


def drop_last_checkpoint(root):
    ckpts = sorted((root / "ckpt").glob("*/step_*"))  # one folder per run inside
    assert [p.name for p in ckpts] == ["step_00000004", "step_00000008"]
    shutil.rmtree(ckpts[-1])


def test_ddp_matches_one_process_and_resumes_with_zero1(tiny, single, tmp_path):
    args = cli_project(tiny, tmp_path, batch_size=4, nproc_per_node=2, **SHAPE)
    done = kiln(tmp_path, *args)  # nproc_per_node=2: kiln starts torchrun on itself
    assert done.returncode == 0, done.output
    assert "nproc_per_node=2: running" in done.output and "x 2 processes (ddp)" in done.output
    assert_same_run(tmp_path, single)
    straight = load_file(tmp_path / "base" / "model.safetensors")

    drop_last_checkpoint(tmp_path)
    resumed = kiln(tmp_path, *args, "--set", "train.zero1=true")
    assert resumed.returncode == 0, resumed.output
    assert "resuming from" in resumed.output and "(step 4)" in resumed.output
    again = load_file(tmp_path / "base" / "model.safetensors")
    for name, tensor in straight.items():
        assert (tensor - again[name]).abs().max() <= 1e-6, name
    assert [s for s, _ in losses(tmp_path)] == list(range(1, 9))


def test_fsdp_matches_one_process_and_resumes_on_one(tiny, single, tmp_path):
    args = cli_project(tiny, tmp_path, batch_size=4, parallel="fsdp", **SHAPE)
    done = torchrun(tmp_path, *args)
    assert done.returncode == 0, done.output
    assert "x 2 processes (fsdp)" in done.output
    assert_same_run(tmp_path, single)
    # Sharded: each rank wrote its own part of every tensor.
    assert len(list((next((tmp_path / "ckpt").glob("*/step_00000004")) / "dcp").glob("*.safetensors"))) == 2
    straight = load_file(tmp_path / "base" / "model.safetensors")

    drop_last_checkpoint(tmp_path)
    resumed = kiln(tmp_path, *args, "--set", "train.batch_size=8")  # one process, the same global micro-batch
    assert resumed.returncode == 0, resumed.output
    assert "resuming from" in resumed.output and "(step 4)" in resumed.output
    assert "processes" not in resumed.output
    again = load_file(tmp_path / "base" / "model.safetensors")
    for name, tensor in straight.items():
        assert (tensor - again[name]).abs().max() <= 1e-6, name
