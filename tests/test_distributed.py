"""Two-process runs on CPU (gloo), started by torchrun exactly as users start them, against one process.

The global micro-batch is the same in every run (8 sequences: 8 on one process, 4 on each of two), so the
windows drawn and the updates made are the same; only float summation order differs.
"""

import json
import re
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file
from test_lora import sft_args
from test_posttrain import questions, save_base
from test_train import cli_project, kiln, run

from kiln.pipeline.train.curves import metric_files, read_metric

from conftest import write_jsonl, write_params

SHAPE = {"batch_tokens": 256, "max_steps": 8, "checkpoint_every": 4, "log_every": 1}  # 2 micro-steps per step


@pytest.fixture(scope="module")
def single(tiny, tmp_path_factory):
    root = tmp_path_factory.mktemp("single")
    metrics, weights = run(tiny, root, batch_size=8, **SHAPE)
    return metrics, weights, losses(root / "metrics")


def losses(metrics):
    return read_metric(metric_files(metrics / "pretrain")["loss"])


def torchrun(root, *args):
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           "-m", "kiln.pipeline.cli", *args], cwd=root, capture_output=True, text=True)
    done.output = done.stdout + done.stderr
    return done


def assert_same_run(root, single, abs=1e-5, steps=8):
    metrics, weights, curve = single
    # the CLI runs are hand runs into base/: the model in base/model, the metrics in base/metrics
    assert [s for s, _ in losses(root / "base/metrics")] == list(range(1, steps + 1))  # one writer: no step twice
    for (_, a), (_, b) in zip(curve, losses(root / "base/metrics")):
        assert b == pytest.approx(a, abs=abs)
    written = json.loads((root / "base/metrics/pretrain.json").read_text())["pretrain"]
    assert written["val_loss"] == pytest.approx(metrics["val_loss"], abs=abs)
    assert written["tokens"] == metrics["tokens"]
    mine = load_file(root / "base/model/model.safetensors")
    assert mine.keys() == weights.keys()
    for name, tensor in weights.items():
        assert (tensor - mine[name]).abs().max() < abs, name


def drop_last_checkpoint(root):
    ckpts = sorted((root / "ckpt").glob("*/step_*"))  # one folder per run inside
    assert [p.name for p in ckpts] == ["step_00000004", "step_00000008"]
    shutil.rmtree(ckpts[-1])


@pytest.mark.slow  # multi-process runs, ~40 s on 2 cores: `make test-slow`
def test_ddp_matches_one_process_and_resumes_with_zero1(tiny, single, tmp_path):
    args = cli_project(tiny, tmp_path, batch_size=4, nproc_per_node=2, **SHAPE)
    done = kiln(tmp_path, *args)  # nproc_per_node=2: kiln starts torchrun on itself
    assert done.returncode == 0, done.output
    assert "nproc_per_node=2: running" in done.output and "x 2 processes (ddp)" in done.output
    assert_same_run(tmp_path, single)
    straight = load_file(tmp_path / "base/model/model.safetensors")

    drop_last_checkpoint(tmp_path)
    resumed = kiln(tmp_path, *args, "--set", "train.zero1=true")
    assert resumed.returncode == 0, resumed.output
    assert "resuming from" in resumed.output and "(step 4)" in resumed.output
    again = load_file(tmp_path / "base/model/model.safetensors")
    for name, tensor in straight.items():
        assert (tensor - again[name]).abs().max() <= 1e-6, name
    assert [s for s, _ in losses(tmp_path / "base/metrics")] == list(range(1, 9))


@pytest.mark.slow  # multi-process runs, ~30 s on 2 cores: `make test-slow`
def test_fsdp_matches_one_process_and_resumes_on_one(tiny, single, tmp_path):
    args = cli_project(tiny, tmp_path, batch_size=4, parallel="fsdp", **SHAPE)
    done = torchrun(tmp_path, *args)
    assert done.returncode == 0, done.output
    assert "x 2 processes (fsdp)" in done.output
    assert_same_run(tmp_path, single)
    # Sharded: each rank wrote its own part of every tensor.
    assert len(list((next((tmp_path / "ckpt").glob("*/step_00000004")) / "dcp").glob("*.safetensors"))) == 2
    straight = load_file(tmp_path / "base/model/model.safetensors")

    drop_last_checkpoint(tmp_path)
    resumed = kiln(tmp_path, *args, "--set", "train.batch_size=8")  # one process, the same global micro-batch
    assert resumed.returncode == 0, resumed.output
    assert "resuming from" in resumed.output and "(step 4)" in resumed.output
    assert "processes" not in resumed.output
    again = load_file(tmp_path / "base/model/model.safetensors")
    for name, tensor in straight.items():
        assert (tensor - again[name]).abs().max() <= 1e-6, name


@pytest.mark.slow  # multi-process runs, ~50 s on 2 cores: `make test-slow`
def test_fp8_trains_under_fsdp_gathering_fp8_and_resumes_from_its_sharded_checkpoint(tiny, tmp_path):
    """train.precision=fp8 (tensorwise) under FSDP2 on two processes: the converted weights are all-gathered in
    fp8 (TorchAO's subclass around each shard), train, save sharded checkpoints and resume from one to the same
    weights. Each process scales its own half of the micro-batch, so the losses follow one process's closely
    but not to rounding."""
    run(tiny, tmp_path / "one", batch_size=8, precision="fp8", **SHAPE)
    alone = losses(tmp_path / "one" / "metrics")
    args = cli_project(tiny, tmp_path, batch_size=4, parallel="fsdp", precision="fp8", **SHAPE)
    done = torchrun(tmp_path, *args)
    assert done.returncode == 0, done.output
    assert "x 2 processes (fsdp)" in done.output and " in fp8" in done.output
    assert re.search(r"FSDP gathers the \d+ converted weights in fp8", done.output)
    assert len(list((next((tmp_path / "ckpt").glob("*/step_00000004")) / "dcp").glob("*.safetensors"))) == 2
    two = losses(tmp_path / "base/metrics")
    assert [s for s, _ in two] == list(range(1, 9))
    assert max(abs(a - b) for (_, a), (_, b) in zip(alone, two)) < 0.05
    straight = load_file(tmp_path / "base/model/model.safetensors")

    drop_last_checkpoint(tmp_path)
    resumed = torchrun(tmp_path, *args)
    assert resumed.returncode == 0, resumed.output
    assert "resuming from" in resumed.output and "(step 4)" in resumed.output
    again = load_file(tmp_path / "base/model/model.safetensors")
    assert again.keys() == straight.keys()
    for name, tensor in straight.items():
        assert torch.equal(tensor, again[name]), name


def sft_losses(run):
    return read_metric(metric_files(run / "metrics/sft")["loss"])


@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
@pytest.mark.slow  # multi-process runs, ~30 s each on 2 cores: `make test-slow`
def test_qlora_sft_on_two_processes_matches_one_with_the_nf4_codes_sharded(tiny, tmp_path, monkeypatch, parallel):
    """The same optimizer steps (8 examples each: 2 micro-batches of 4, or on each of two ranks 2 of 2); FSDP
    holds half of every frozen NF4 tensor on each rank, which the run reports. The chat tokens' embedding rows
    train too (beside frozen NF4 codes in the root's FSDP group)."""
    monkeypatch.chdir(tmp_path)
    write_jsonl(tmp_path / "sft.jsonl", questions())
    save_base(tiny.tokenizer, tmp_path / "base")
    # alpha pinned at the update scale the tolerances below were measured at (4): a larger scale magnifies the
    # summation order's differences, and this checks the processes agree, not how fast the adapter learns
    setting = {"adapter": "qlora", "lora_rank": 4, "lora_alpha": 16.0, "batch_examples": 8,
               "lora_trainable_tokens": "chat"}
    one = kiln(tmp_path, *sft_args(tiny, tmp_path, "one", batch_size=4, **setting))
    assert one.returncode == 0, one.output
    curve = sft_losses(tmp_path / "one")
    two = kiln(tmp_path, *sft_args(tiny, tmp_path, "two", batch_size=2, **setting), "--set",
               f"train.parallel={parallel}", "--set", "train.nproc_per_node=2")
    assert two.returncode == 0, two.output
    assert f"x 2 processes ({parallel})" in two.output
    assert [s for s, _ in sft_losses(tmp_path / "two")] == [s for s, _ in curve] == list(range(1, 7))
    for (_, a), (_, b) in zip(curve, sft_losses(tmp_path / "two")):
        assert b == pytest.approx(a, abs=1e-5)
    # Weights to 1e-4: Adam divides each gradient by its running scale, so where a gradient is tiny the other
    # summation order moves the update by more than the loss (measured: 3e-5 at most after 6 steps at lr 1e-2).
    for name in ("model.safetensors", "adapter.safetensors"):
        a, b = load_file(tmp_path / "one/model" / name), load_file(tmp_path / "two/model" / name)
        assert a.keys() == b.keys() and all((a[k] - b[k]).abs().max() < 1e-4 for k in a), name
    if parallel == "fsdp":
        held = re.search(r"frozen weights: ([\d,]+) of ([\d,]+) bytes on each rank", two.output)
        assert held, two.output
        mine, whole = (int(g.replace(",", "")) for g in held.groups())
        assert whole > 0 and whole / 2 <= mine < 0.52 * whole, held.group(0)  # rank 0 takes an odd last row


@pytest.mark.slow  # multi-process runs, ~50 s on 2 cores: `make test-slow`
def test_lora_dpo_under_fsdp_matches_one_process_and_resumes_on_one(tiny, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write_jsonl(tmp_path / "pairs.jsonl", [{"prompt": f"Name number {i}?", "chosen": q["messages"][1]["content"],
                                             "rejected": "nobody"} for i, q in enumerate(questions())])
    save_base(tiny.tokenizer, tmp_path / "sft")
    dpo = {"data": "pairs.jsonl", "max_steps": 4, "batch_examples": 4, "lr": 1e-2, "min_lr": 1e-3,
           "warmup_steps": 0, "eval_every": 2, "checkpoint_every": 2, "log_every": 1, "val_examples": 2,
           "adapter": "lora", "lora_rank": 4, "sft_weight": 0.0}  # its NLL term is per micro-batch, as TRL's

    def args(out, **more):
        write_params(tmp_path / "params.yaml", {"dpo": {**dpo, **more}, "train": {"device": "cpu"}})
        return ["dpo", "--sft", "sft", "--tokenizer", str(tiny.tokenizer), "--corpus", str(tiny.corpus), "--out",
                out, "--checkpoints", f"ckpt-{out}"]

    def curve(run):
        return read_metric(metric_files(tmp_path / run / "metrics/dpo")["loss"])

    one = kiln(tmp_path, *args("one", batch_size=2))
    assert one.returncode == 0, one.output
    single = curve("one")
    sharded = args("two", batch_size=1)
    two = torchrun(tmp_path, *sharded, "--set", "train.parallel=fsdp")
    assert two.returncode == 0, two.output
    assert "x 2 processes (fsdp)" in two.output
    for (_, a), (_, b) in zip(single, curve("two"), strict=True):
        assert b == pytest.approx(a, abs=1e-5)
    straight = load_file(tmp_path / "two/model/adapter.safetensors")

    shutil.rmtree(sorted((tmp_path / "ckpt-two").glob("*/step_*"))[-1])
    resumed = kiln(tmp_path, *args("two", batch_size=2))  # one process, the same global micro-batch of 2 pairs
    assert resumed.returncode == 0 and "(step 2)" in resumed.output, resumed.output
    again = load_file(tmp_path / "two/model/adapter.safetensors")
    assert all((straight[k] - again[k]).abs().max() < 1e-4 for k in straight)


@pytest.mark.slow  # multi-process runs, ~40 s on 2 cores: `make test-slow`
def test_grpo_under_fsdp_samples_and_trains_as_one_process(tiny, tmp_path, monkeypatch):
    """Every rank samples the whole rollout batch (the same seed and weights: the same completions) and trains
    on its half of the rows: rewards equal, losses to 1e-5, the KL reference a whole copy on each rank. The
    reward is the completion's length, so every group has a spread from the first step: a step whose groups
    all tie trains on the KL term alone, whose gradient is rounding noise (the sharded forward against the
    whole reference's) that AdamW scales up to a full step, and the runs part ways on noise."""
    from test_grpo import REWARDS, grpo_args

    monkeypatch.chdir(tmp_path)
    (tmp_path / "rewards.py").write_text(REWARDS)
    write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": f"Say x, {i} times.", "answer": "x"} for i in range(40)])
    save_base(tiny.tokenizer, tmp_path / "start")
    setting = {"max_steps": 4, "eval_every": 2, "checkpoint_every": 2, "log_every": 1, "beta": 0.04,
               "reward": "rewards.py:length"}

    def curves(run):
        files = metric_files(tmp_path / run / "metrics/grpo")
        return {k: read_metric(files[k]) for k in ("loss", "reward", "kl")}

    one = kiln(tmp_path, *grpo_args(tiny, tmp_path, "one", **setting))
    assert one.returncode == 0, one.output
    single = curves("one")
    # kiln starts torchrun itself: the launcher must not read grpo's --start as its --start-method
    two = kiln(tmp_path, *grpo_args(tiny, tmp_path, "two", batch_size=8, **setting), "--set", "train.parallel=fsdp",
               "--set", "train.nproc_per_node=2")
    assert two.returncode == 0, two.output
    assert "x 2 processes (fsdp)" in two.output
    for key, curve in curves("two").items():
        assert [s for s, _ in curve] == [s for s, _ in single[key]] == [1, 2, 3, 4], key
        for (_, a), (_, b) in zip(single[key], curve):
            # kl is a mean of micro-batch means, and the micro-batches are other rows on two ranks
            assert b == (pytest.approx(a, rel=0.05) if key == "kl" else pytest.approx(a, abs=1e-5)), key


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def two_agents(root, *args):
    """Two torchrun agents of one process each, as on two machines (`--nnodes 2`), meeting at a c10d rendezvous
    on 127.0.0.1: docs/gpu.md's multi-node command with the node's address replaced."""
    endpoint = f"127.0.0.1:{free_port()}"
    agents = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
                                "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint,
                                "--rdzv-id", "kiln-test", "-m", "kiln.pipeline.cli", *args],
                               cwd=root, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
              for _ in range(2)]
    outputs = [agent.communicate(timeout=300)[0] for agent in agents]
    return [agent.returncode for agent in agents], "\n".join(outputs)


# 20 Muon steps: its orthogonalised updates are where a sharded run could drift from one process
MUON_SHAPE = {**SHAPE, "max_steps": 20, "checkpoint_every": 10, "optimizer": "muon"}


@pytest.fixture(scope="module")
def single_muon(tiny, tmp_path_factory):
    root = tmp_path_factory.mktemp("single-muon")
    metrics, weights = run(tiny, root, batch_size=8, **MUON_SHAPE)
    return metrics, weights, losses(root / "metrics")


@pytest.mark.slow  # two agents and a one-process run, ~40 s on 2 cores: `make test-slow`
@pytest.mark.parametrize("optimizer,parallel", [("adamw", "ddp"), ("adamw", "fsdp"), ("muon", "ddp"),
                                                ("muon", "fsdp")])
def test_two_nodes_by_rendezvous_train_as_one_process(tiny, tmp_path, single, single_muon, optimizer, parallel):
    shape = MUON_SHAPE if optimizer == "muon" else SHAPE
    args = cli_project(tiny, tmp_path / "nodes", batch_size=4, parallel=parallel, **shape)
    codes, output = two_agents(tmp_path / "nodes", *args)
    assert codes == [0, 0], output
    assert f"x 2 processes ({parallel})" in output
    assert_same_run(tmp_path / "nodes", single_muon if optimizer == "muon" else single, steps=shape["max_steps"])


def resumes_bitwise_from_step_10(root, launch):
    """Drop the run's step-20 checkpoint, `launch` it again: it resumes at step 10 and ends bitwise where it did."""
    straight = load_file(root / "base/model/model.safetensors")
    ckpts = sorted((root / "ckpt").glob("*/step_*"))
    assert [p.name for p in ckpts] == ["step_00000010", "step_00000020"]
    shutil.rmtree(ckpts[-1])
    resumed = launch()
    assert resumed.returncode == 0, resumed.output
    assert "resuming from" in resumed.output and "(step 10)" in resumed.output
    again = load_file(root / "base/model/model.safetensors")
    for name, tensor in straight.items():
        assert torch.equal(tensor, again[name]), name


@pytest.mark.slow  # multi-process runs, ~60 s on 2 cores: `make test-slow`
def test_muon_under_fsdp_matches_one_process_and_resumes_bitwise(tiny, single_muon, tmp_path):
    """FSDP2 on two ranks: each matrix's Nesterov momentum gathered, orthogonalised whole, each rank's rows kept;
    the weights after 20 steps are one process's, and a run resumed from its sharded step-10 checkpoint (the
    momentum buffers sharded in it) ends bitwise where the straight run did."""
    args = cli_project(tiny, tmp_path, batch_size=4, parallel="fsdp", **MUON_SHAPE)
    done = torchrun(tmp_path, *args)
    assert done.returncode == 0, done.output
    assert "x 2 processes (fsdp)" in done.output
    assert_same_run(tmp_path, single_muon, steps=20)
    resumes_bitwise_from_step_10(tmp_path, lambda: torchrun(tmp_path, *args))


@pytest.mark.slow  # multi-process runs, ~60 s on 2 cores: `make test-slow`
def test_muon_with_zero1_matches_one_process_and_resumes_bitwise(tiny, single_muon, tmp_path):
    """ZeRO-1 with Muon: each rank keeps the state of, and updates, whole matrices of its share (and AdamW's
    tensors), then broadcasts them; 20 steps equal one process's, and a resume from the step-10 checkpoint (its
    state gathered on rank 0) ends bitwise where the straight run did."""
    args = cli_project(tiny, tmp_path, batch_size=4, nproc_per_node=2, zero1=True, **MUON_SHAPE)
    done = kiln(tmp_path, *args)
    assert done.returncode == 0, done.output
    assert "x 2 processes (ddp)" in done.output
    assert_same_run(tmp_path, single_muon, steps=20)
    resumes_bitwise_from_step_10(tmp_path, lambda: kiln(tmp_path, *args))
