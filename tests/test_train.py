import contextlib
import json
import math
import re
import shutil
import signal
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from kiln.model.config import ModelConfig
from kiln.model.gpt import GPT
from kiln.pipeline.cli import app
from kiln.pipeline.config import build_section
from kiln.pipeline.errors import StageError, UserError
from kiln.pipeline.train import lm
from kiln.pipeline.train.checkpoints import NAME, Checkpoints
from kiln.pipeline.train.curves import metric_files, read_metric
from kiln.pipeline.train.lm import lm_loss
from kiln.pipeline.train.loop import Run, build_optimizer, lr_at, train
from kiln.pipeline.train.params import ModelParams, TrainParams
from kiln.pipeline.train.pretrain import pretrain
from tests.conftest import tree_bytes
from tests.test_code_digest import edit_code

MODEL = {"n_layer": 1, "n_head": 2, "n_kv_head": 1, "d_model": 32, "max_seq_len": 16}
TRAIN = {"batch_size": 4, "batch_tokens": 128, "lr": 1e-2, "min_lr": 1e-3, "warmup_steps": 2, "eval_every": 4,
         "eval_tokens": 256, "checkpoint_every": 4, "log_every": 2, "device": "cpu"}


def checkpoints(root):
    """Every checkpoint under a checkpoint folder (one folder per run inside), oldest first."""
    return sorted((p for p in root.glob("*/step_*") if NAME.fullmatch(p.name)), key=lambda p: p.name)


def run(tiny, root, shards=None, **train):
    root.mkdir(exist_ok=True)
    with contextlib.chdir(root):
        metrics = pretrain(build_section(ModelParams, MODEL), build_section(TrainParams, {**TRAIN, **train}),
                           shards or tiny.shards, tiny.tokenizer, root / "base", root / "ckpt")
    return metrics, load_file(root / "base" / "model.safetensors")


def fewer_shards(shards, out):
    """A copy of a shard folder without its last train shard: other data, from the same tokenizer."""
    shutil.copytree(shards, out)
    manifest = json.loads((out / "manifest.json").read_text())
    train = manifest["splits"]["train"]
    dropped = train["shards"].pop()
    train["tokens"] -= dropped["tokens"]
    (out / dropped["file"]).unlink()
    (out / "manifest.json").write_text(json.dumps(manifest))
    return out


def test_a_rerun_after_the_data_or_the_code_changed_trains_afresh(tiny, tmp_path, monkeypatch):
    """A finished run keeps its final checkpoint, and the same run again resumes it with nothing left to train.
    Other shards (the same tokenizer) or a fix to pretrain's code, which make DVC rerun the stage, are another
    run: resumed, they would hand back the old model."""
    _, first = run(tiny, tmp_path, max_steps=2)
    _, other = run(tiny, tmp_path, fewer_shards(tiny.shards, tmp_path / "fewer"), max_steps=2)
    assert len(checkpoints(tmp_path / "ckpt")) == 2 and not all(torch.equal(first[k], other[k]) for k in first)
    edit_code("pretrain", tmp_path / "fixed", monkeypatch)
    _, fixed = run(tiny, tmp_path, max_steps=2)
    assert len(checkpoints(tmp_path / "ckpt")) == 3 and all(torch.equal(first[k], fixed[k]) for k in first)


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_resumed_run_equals_straight_run(tiny, tmp_path, optimizer):
    # muon: its momentum buffers and step counts (the momentum's warmup) are in the checkpoint too
    muon = {"optimizer": optimizer, "muon_momentum_warmup": 6}
    straight, w_straight = run(tiny, tmp_path / "a", max_steps=8, **muon)
    # Stop after 4 steps with the schedule of an 8-step run: a 4-step run has another schedule, so resume
    # is exercised by the checkpoint at step 4 of the same 8-step run, left alone by deleting the later one.
    run(tiny, tmp_path / "b", max_steps=8, **muon)
    ckpts = checkpoints(tmp_path / "b" / "ckpt")
    assert [p.name for p in ckpts] == ["step_00000004", "step_00000008"]
    for f in ckpts[-1].iterdir():
        f.unlink()
    ckpts[-1].rmdir()
    resumed, w_resumed = run(tiny, tmp_path / "b", max_steps=8, **muon)
    assert resumed["train_loss"] == straight["train_loss"] and resumed["val_loss"] == straight["val_loss"]
    for name, tensor in w_straight.items():
        assert (tensor - w_resumed[name]).abs().max() <= 1e-6, name
    assert straight["val_loss"] < math.log(300)  # it learned something beyond uniform
    curves = metric_files(tmp_path / "b" / "metrics/pretrain")
    assert set(curves) == {"loss", "lr", "grad_norm", "val_loss", "val_bpb"}
    # tokens/s measures the machine, not the model: beside the stage's timings, out of the curves DVC hashes
    assert set(metric_files(tmp_path / "b" / "metrics/timings/pretrain")) == {"tokens_per_s"}
    assert [s for s, _ in read_metric(curves["loss"])] == [2, 4, 6, 8]  # no duplicated rows
    assert [s for s, _ in read_metric(curves["val_loss"])] == [4, 8]
    assert read_metric(curves["val_loss"])[-1][1] == pytest.approx(resumed["val_loss"], abs=1e-5)
    assert (tmp_path / "b" / "metrics/pretrain/curves.png").read_bytes().startswith(b"\x89PNG")
    assert json.loads((tmp_path / "b" / "metrics/pretrain.json").read_text())["pretrain"]["steps"] == 8


def test_a_finished_run_whose_curves_are_gone_trains_afresh_with_whole_curves(tiny, tmp_path, capsys):
    """A stage's curves folder deleted (DVC deletes it before rerunning the stage), its final checkpoint kept:
    resuming it would leave no curves at all. The run starts afresh instead, and the model and curves equal the
    first run's."""
    import shutil

    first, weights = run(tiny, tmp_path, max_steps=4)
    curves = tmp_path / "metrics/pretrain"
    before = {name: read_metric(path) for name, path in metric_files(curves).items()}
    shutil.rmtree(curves)
    again, weights_again = run(tiny, tmp_path, max_steps=4)
    assert "starting afresh, so that they are whole" in capsys.readouterr().err
    assert {name: read_metric(path) for name, path in metric_files(curves).items()} == before
    assert again["val_loss"] == first["val_loss"] and all(torch.equal(weights[k], weights_again[k]) for k in weights)


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
        build_section(TrainParams, {"precision": "fp4"})


def test_batch_tokens_must_divide(tiny, tmp_path):
    with pytest.raises(UserError, match=r"train\.batch_tokens"):
        run(tiny, tmp_path, max_steps=2, batch_tokens=100)


class FixedBatches:
    """Yields the given micro-batches in order, cycling; the state is the position."""

    def __init__(self, batches):
        self.batches, self.i = batches, 0

    def __iter__(self):
        return self

    def __next__(self):
        batch = self.batches[self.i % len(self.batches)]
        self.i += 1
        return batch

    def state_dict(self):
        return {"i": self.i}

    def load_state_dict(self, state):
        self.i = state["i"]


def loop_run(tmp_path, batches, loss_fn=lm_loss, **train_params):
    params = build_section(TrainParams, {**TRAIN, "max_steps": 2, **train_params})
    tokens = batches[0][0].numel()
    return Run(params=params, total_steps=params.max_steps, micro_batch_tokens=tokens, loss_fn=loss_fn,
               batches=FixedBatches(batches), evaluate=lambda m: {}, curves_dir=tmp_path / "curves",
               checkpoints=Checkpoints(tmp_path / "ckpt", {"run": 1}, 2), flops_per_token=1.0)


def tiny_model(seed=0):
    torch.manual_seed(seed)
    return GPT(ModelConfig(vocab_size=64, **MODEL))


def test_gradient_accumulation_equals_one_big_batch(tmp_path):
    gen = torch.Generator().manual_seed(1)
    x = torch.randint(0, 64, (8, 16), generator=gen)
    y = torch.randint(0, 64, (8, 16), generator=gen)
    one, two = tiny_model(), tiny_model()
    with contextlib.chdir(tmp_path):
        train(one, loop_run(tmp_path / "one", [(x, y)], batch_size=8, batch_tokens=128))
        train(two, loop_run(tmp_path / "two", [(x[:4], y[:4]), (x[4:], y[4:])], batch_size=4, batch_tokens=128))
    for (name, a), b in zip(one.state_dict().items(), two.state_dict().values()):
        assert (a - b).abs().max() < 1e-5, name


def test_nan_guard_stops_and_keeps_last_good_checkpoint(tmp_path):
    gen = torch.Generator().manual_seed(2)
    batch = (torch.randint(0, 64, (4, 16), generator=gen), torch.randint(0, 64, (4, 16), generator=gen))
    calls = []

    def loss_fn(model, b):  # finite for 3 steps (2 micro-steps each), then NaN
        calls.append(1)
        loss = lm_loss(model, b)
        return loss * float("nan") if len(calls) > 6 else loss

    model = tiny_model()
    run = loop_run(tmp_path, [batch], loss_fn, batch_size=2, max_steps=6, checkpoint_every=2)
    run.micro_batch_tokens = 64
    with contextlib.chdir(tmp_path), pytest.raises(StageError, match=r"loss is nan at step 4.*step_00000002"):
        train(model, run)
    kept = [p.name for p in checkpoints(tmp_path / "ckpt")]
    assert kept == ["step_00000002"]
    state = run.checkpoints.load(run.checkpoints.read(run.checkpoints.folder / kept[0]), tiny_model(), build_optimizer(
        model, run.params, torch.device("cpu")), torch.amp.GradScaler("cpu", enabled=False))
    assert state["step"] == 2 and math.isfinite(state["train_loss"])


def cli_project(tiny, root, **train):
    """A folder with params.yaml for `kiln train` on the tiny shards: a hand run into base/ (its model in
    base/model, its metrics in base/metrics), checkpoints in ckpt/."""
    root.mkdir(exist_ok=True)
    (root / "params.yaml").write_text(json.dumps({"model": MODEL, "train": {**TRAIN, **train}}))
    return ["train", "--shards", str(tiny.shards), "--tokenizer", str(tiny.tokenizer), "--out", "base",
            "--checkpoints", "ckpt"]


def kiln(root, *args, prelude=""):
    """Run the CLI in a fresh process (optionally after `prelude` Python code); returns the process."""
    code = f"{prelude}\nfrom kiln.pipeline.cli import main\nimport sys\nsys.argv = ['kiln', *{list(args)!r}]\nmain()"
    done = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True)
    done.output = done.stdout + done.stderr
    return done


# Kill the process (SIGKILL: no cleanup runs) in the middle of writing the second checkpoint.
KILL_IN_SECOND_SAVE = """
import os, signal
import kiln.pipeline.train.checkpoints as c
real, calls = c.save_file, []
def dying(tensors, path, *a, **k):
    calls.append(path)
    if len(calls) == 3:
        open(path, "wb").write(b"partial")
        os.kill(os.getpid(), signal.SIGKILL)
    return real(tensors, path, *a, **k)
c.save_file = dying
"""


@pytest.mark.slow  # runs and a kill, ~20 s on 2 cores: `make test-slow`
def test_killed_mid_checkpoint_resumes_from_the_previous_one(tiny, tmp_path):
    args = cli_project(tiny, tmp_path, max_steps=8, checkpoint_every=2)
    killed = kiln(tmp_path, *args, prelude=KILL_IN_SECOND_SAVE)
    assert killed.returncode == -signal.SIGKILL
    assert [p.name for p in checkpoints(tmp_path / "ckpt")] == ["step_00000002"]
    assert not (tmp_path / "base" / "model").exists()
    resumed = kiln(tmp_path, *args)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert "resuming from" in resumed.output and "step 2)" in resumed.output
    assert [p.name for p in checkpoints(tmp_path / "ckpt")] == ["step_00000006", "step_00000008"]
    assert not list((tmp_path / "ckpt").glob("*/*.tmp-*"))  # the killed save's leftovers are gone
    straight, _ = run(tiny, tmp_path / "straight", max_steps=8, checkpoint_every=2)
    assert json.loads((tmp_path / "base/metrics/pretrain.json").read_text())["pretrain"]["val_loss"] == straight["val_loss"]


@pytest.mark.slow  # a dozen resumes, ~15 s on 2 cores: `make test-slow`
def test_corrupt_checkpoint_is_a_clear_error(tiny, tmp_path):
    args = cli_project(tiny, tmp_path, max_steps=4, checkpoint_every=2)
    assert kiln(tmp_path, *args).returncode == 0
    before = (tmp_path / "base" / "model" / "model.safetensors").read_bytes()
    newest = checkpoints(tmp_path / "ckpt")[-1]
    (newest / "optimizer.safetensors").write_bytes(b"\0" * 100)
    failed = kiln(tmp_path, *args)
    assert failed.returncode == 2
    assert "corrupt checkpoint" in failed.output and "step_00000004" in failed.output
    assert "Traceback" not in failed.output
    assert (tmp_path / "base" / "model" / "model.safetensors").read_bytes() == before
    assert (newest / "model.safetensors").is_file()  # left for the user to inspect, not deleted


def test_shards_from_another_tokenizer_are_refused(tiny, shakespeare, tmp_path):
    args = cli_project(tiny, tmp_path, max_steps=2)
    args[args.index("--tokenizer") + 1] = str(shakespeare.tokenizer)
    failed = kiln(tmp_path, *args)
    assert failed.returncode == 2
    assert "tokenizer" in failed.output and str(tiny.shards) in failed.output.replace("\n", "")
    assert not (tmp_path / "base" / "model").exists() and not (tmp_path / "ckpt").exists()


@pytest.mark.parametrize("key, value", [("train.precision", "fp4"), ("model.n_head", "3"),
                                        ("model.n_kv_head", "3")])
def test_bad_train_params_exit_2(tiny, tmp_path, key, value):
    failed = kiln(tmp_path, *cli_project(tiny, tmp_path, max_steps=2), "--set", f"{key}={value}")
    assert failed.returncode == 2 and key in failed.output and "Traceback" not in failed.output


@pytest.mark.slow  # Triton's CPU interpreter, ~15 s on 2 cores: `make test-slow`
def test_training_with_triton_kernels_matches_torch(tiny, tmp_path):
    """A few steps with train.kernels=triton (Triton's interpreter here) follow the same losses as torch."""
    # Two optimizer steps of two micro-steps each, and one small eval: the interpreter is slow.
    torch_run, w_torch = run(tiny, tmp_path / "torch", max_steps=2, eval_tokens=64, log_every=1, kernels="torch")
    triton_run, w_triton = run(tiny, tmp_path / "triton", max_steps=2, eval_tokens=64, log_every=1, kernels="triton")
    torch_curve = read_metric(metric_files(tmp_path / "torch" / "metrics/pretrain")["loss"])
    triton_curve = read_metric(metric_files(tmp_path / "triton" / "metrics/pretrain")["loss"])
    assert [s for s, _ in triton_curve] == [s for s, _ in torch_curve] == [1, 2]
    for (_, a), (_, b) in zip(torch_curve, triton_curve):
        assert b == pytest.approx(a, abs=1e-4)
    assert triton_run["val_loss"] == pytest.approx(torch_run["val_loss"], abs=1e-4)
    for name, tensor in w_torch.items():
        assert (tensor - w_triton[name]).abs().max() < 1e-4, name


def test_triton_kernels_on_cpu_need_the_interpreter(tiny, tmp_path, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(UserError, match=r"train\.kernels=triton.*TRITON_INTERPRET"):
        run(tiny, tmp_path, max_steps=2, kernels="triton")
    assert not (tmp_path / "base").exists()


def test_a_second_run_on_the_same_checkpoints_refuses(tiny, tmp_path):
    """Two runs writing one checkpoint folder would interleave their steps; the second stops at once."""
    held = tmp_path / "ckpt"
    script = ("import time, pathlib\nfrom kiln.pipeline.outputs import exclusive\n"
              f"with exclusive(pathlib.Path({str(held)!r})):\n    print('holding', flush=True)\n    time.sleep(60)\n")
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "holding"
        with pytest.raises(UserError, match=rf"{held}: in use by another kiln run \(pid {proc.pid}\)"):
            run(tiny, tmp_path, max_steps=4)
    finally:
        proc.kill()
        proc.wait()
    assert not (tmp_path / "base").exists()


def test_the_nan_stops_advice_followed_literally_deletes_nothing(tiny, tmp_path, monkeypatch):
    """Issue 18, class 9: the stop names the last good checkpoint and two ways on. Going on from it with a lower
    lr (the command it names) and starting afresh with a lower lr both work, and neither deletes a checkpoint of
    the run that stopped (keep_checkpoints=1 prunes each run's own only)."""
    monkeypatch.chdir(tmp_path)
    args = cli_project(tiny, tmp_path, max_steps=6, checkpoint_every=2, keep_checkpoints=1)
    calls = []

    def diverging(model, batch):  # two micro-batches a step: NaN from step 3 on
        calls.append(1)
        return lm_loss(model, batch) * (float("nan") if len(calls) > 4 else 1.0)

    with monkeypatch.context() as patched:
        patched.setattr(lm, "lm_loss", diverging)
        stopped = CliRunner().invoke(app, args)
    assert stopped.exit_code == 1 and "Traceback" not in stopped.output
    message = " ".join(stopped.output.split())  # rich wraps long lines on the terminal
    kept = re.search(r"Last good checkpoint: (\S+)\.", message).group(1)
    assert "loss is nan at step 3" in message and kept.endswith("step_00000002")
    command = re.search(r"go on from it: kiln pretrain (.+?); no checkpoint is deleted", message).group(1)
    assert not (tmp_path / "base" / "model").exists()
    stopped_run = tree_bytes(tmp_path / "ckpt")

    go_on = CliRunner().invoke(app, [*args, *command.replace("<lower>", "0.005").split()])
    assert go_on.exit_code == 0, go_on.output
    assert f"resuming from {kept} (step 2)" in " ".join(go_on.output.split())
    assert json.loads((tmp_path / "base/metrics/pretrain.json").read_text())["pretrain"]["steps"] == 6

    afresh = CliRunner().invoke(app, [*args, "--set", "lr=0.002"])
    assert afresh.exit_code == 0, afresh.output
    assert "starting afresh beside them" in " ".join(afresh.output.split())
    after = tree_bytes(tmp_path / "ckpt")
    assert {k: after.get(k) for k in stopped_run} == stopped_run  # the stopped run's checkpoints, byte for byte
    assert [p.name for p in checkpoints(tmp_path / "ckpt")] == ["step_00000002", "step_00000006", "step_00000006"]


def test_non_finite_weights_are_never_checkpointed(tmp_path):
    model = tiny_model()
    optimizer = build_optimizer(model, build_section(TrainParams, TRAIN), torch.device("cpu"))
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    ckpts = Checkpoints(tmp_path / "ckpt", {"run": 1}, keep=2, command="kiln pretrain")
    good = ckpts.save(2, model, optimizer, scaler, {"i": 2}, {})
    before = tree_bytes(tmp_path)
    with torch.no_grad():
        model.blocks[0].attn_norm.weight[3] = float("inf")
    with pytest.raises(StageError, match=r"step_00000004: not saved: blocks\.0\.attn_norm\.weight holds NaN or "
                                         rf"infinite values\. Last good checkpoint: {good}\."):
        ckpts.save(4, model, optimizer, scaler, {"i": 4}, {})
    assert tree_bytes(tmp_path) == before


def test_a_nan_validation_loss_stops_the_run(tmp_path):
    gen = torch.Generator().manual_seed(3)
    batch = (torch.randint(0, 64, (4, 16), generator=gen), torch.randint(0, 64, (4, 16), generator=gen))
    run = loop_run(tmp_path, [batch], batch_size=4, batch_tokens=64, max_steps=4, eval_every=2, checkpoint_every=2)
    run.evaluate = lambda m: {"val_loss": float("nan") if run.batches.i > 2 else 1.0}
    with contextlib.chdir(tmp_path), pytest.raises(StageError, match=r"val_loss is nan at step 4; stopped\. Last "
                                                                     r"good checkpoint: \S+step_00000002\."):
        train(tiny_model(), run)
    assert [p.name for p in checkpoints(tmp_path / "ckpt")] == ["step_00000002"]


def test_resume_from_another_stages_checkpoint_is_refused(tiny, tmp_path):
    """`kiln sft --resume-from <a pretrain checkpoint>`: the tensors may well fit, but the run is another stage's."""
    run(tiny, tmp_path, max_steps=4)
    pretrain_checkpoint = checkpoints(tmp_path / "ckpt")[-1]
    post = {"start": "0" * 64, "data": "1" * 64, "train": {"seed": 1}}
    with pytest.raises(UserError, match="a checkpoint of another stage .*kiln sft's by start, train"):
        Checkpoints(tmp_path / "sft-ckpt", post, keep=1, resume_from=pretrain_checkpoint, command="kiln sft")
    assert not (tmp_path / "sft-ckpt").exists()
    # A pretrain checkpoint from before its data and code were fingerprinted is still pretrain's.
    state = json.loads((pretrain_checkpoint / "state.json").read_text())
    ours = dict(state["fingerprint"])
    del state["fingerprint"]["data"], state["fingerprint"]["code"]
    (pretrain_checkpoint / "state.json").write_text(json.dumps(state))
    resumed = Checkpoints(tmp_path / "again", ours, keep=1, resume_from=pretrain_checkpoint, command="kiln pretrain")
    assert resumed.newest().path == pretrain_checkpoint and resumed.fingerprint["resumed_from"]["step"] == 4


def test_a_run_that_cannot_fit_its_device_is_refused_before_it_allocates(tiny, tmp_path, monkeypatch):
    """Gradients, AdamW state and one micro-batch's activations (kiln plan memory's model) against what the device
    has free, checked before the optimizer or a batch exists: one line naming the key that dominates."""
    from kiln.pipeline.train import memory

    monkeypatch.setattr(memory, "memory_available", lambda device: 1_000_000)  # 1 MB free
    with pytest.raises(UserError, match=r"^train\.batch_size: this run needs ~[0-9.]+ GB beyond its weights .* "
                                        r"cpu has 0\.001 GB free"):
        run(tiny, tmp_path, batch_size=64, batch_tokens=64 * 16, max_steps=2)
    assert not (tmp_path / "ckpt").exists() or not any((tmp_path / "ckpt").rglob("step_*"))
    monkeypatch.setattr(memory, "memory_available", lambda device: 10**12)
    run(tiny, tmp_path, max_steps=2)  # the same run fits a larger device
