"""`kiln plan memory` against what a run allocates and what autograd saves."""

import json

import pytest
import torch
from typer.testing import CliRunner

from kiln.model.config import ModelConfig
from kiln.model.gpt import GPT
from kiln.pipeline.cli import app
from kiln.pipeline.tools.plan_memory import Shape, measure_cpu_peak, plan
from kiln.pipeline.train.memory import HEADROOM


def layer_saved_bytes(config: ModelConfig, tokens_rows: int, precision: str, kernels: str) -> int:
    """Bytes autograd saves for one block: a 2-layer model's saved tensors less a 1-layer one's, each storage once,
    parameters left out."""
    def saved(n_layer):
        torch.manual_seed(0)
        model = GPT(ModelConfig(**{**config.to_dict(), "n_layer": n_layer})).set_kernels(kernels)
        params = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
        seen = {}

        def pack(t):
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        x = torch.randint(0, config.vocab_size, (tokens_rows, config.max_seq_len))
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
                torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
            model(x, x)
        return sum(v for k, v in seen.items() if k not in params)

    return saved(2) - saved(1)


SHAPES = [dict(vocab_size=256, n_head=4, n_kv_head=4, d_model=64, max_seq_len=32),
          dict(vocab_size=256, n_head=8, n_kv_head=2, d_model=64, max_seq_len=32),
          dict(vocab_size=256, n_head=2, n_kv_head=2, d_model=96, d_ff=100, max_seq_len=16)]


KNOBS = [{}, {"qk_norm": True}, {"mlp": "relu2"}]  # the model knobs that change what a block saves


@pytest.mark.parametrize("arch,precision,shape,knob", [
    (arch, precision, shape, knob) for arch in ("llama", "gpt2") for precision in ("fp32", "bf16") for shape in SHAPES
    for knob in KNOBS
    if arch == "llama" or shape["n_kv_head"] == shape["n_head"]])  # gpt2 has no grouped-query attention
def test_per_layer_activations_are_what_autograd_saves(arch, precision, shape, knob):
    config = ModelConfig(n_layer=1, arch=arch, **shape, **knob)
    s = Shape(config, precision)
    rows = 2
    want = s.layer_bytes_per_token() * rows * config.max_seq_len + s.layer_constant_bytes()
    assert layer_saved_bytes(config, rows, precision, "torch") == want


@pytest.mark.parametrize("knob", KNOBS)
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_per_layer_activations_with_the_fused_kernels(precision, knob, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    config = ModelConfig(n_layer=1, **SHAPES[1], **knob)
    s = Shape(config, precision, fused=True)
    want = s.layer_bytes_per_token() * 2 * config.max_seq_len + s.layer_constant_bytes()
    assert layer_saved_bytes(config, 2, precision, "triton") == want


@pytest.mark.parametrize("kw,batch,precision,checkpointing", [
    (dict(vocab_size=1024, n_layer=4, n_head=4, n_kv_head=4, d_model=128, max_seq_len=128), 16, "fp32", False),
    (dict(vocab_size=1024, n_layer=4, n_head=4, n_kv_head=4, d_model=128, max_seq_len=128), 16, "fp32", True),
    (dict(vocab_size=4096, n_layer=3, n_head=6, n_kv_head=2, d_model=192, max_seq_len=128), 8, "bf16", False),
    (dict(vocab_size=2048, n_layer=4, n_head=4, n_kv_head=4, d_model=128, max_seq_len=128, arch="gpt2"), 8, "fp32",
     True),
    # every knob on: a softcapped head's logits dominate (tanh's output is kept)
    (dict(vocab_size=8192, n_layer=2, n_head=4, n_kv_head=2, d_model=128, max_seq_len=64, qk_norm=True, mlp="relu2",
          logit_softcap=15.0, zero_init=True), 32, "bf16", False),
])
def test_the_plan_is_within_a_tenth_of_the_measured_peak(kw, batch, precision, checkpointing):
    shape = Shape(ModelConfig(**kw), precision, checkpointing=checkpointing)
    estimate = plan(shape, batch, kw["max_seq_len"], None)["total_bytes"]
    measured = measure_cpu_peak(shape, batch, kw["max_seq_len"])
    assert abs(estimate / measured - 1) < 0.10, (estimate, measured)


# From a batch whose peak is AdamW's step (the weights, gradients, moments and the step's temporaries) to one whose
# logits (32 x 64 tokens x 8,192) outweigh the blocks. "Never under" is held to 1 %: the count leaves out a few
# tens of kilobytes of small tensors (the batch, the norms of clipping), which --plan-batch's headroom covers.
SCALING = dict(vocab_size=8192, n_layer=2, n_head=4, d_model=128, max_seq_len=64)


@pytest.mark.parametrize("batch", [2, 8, 32])
@pytest.mark.parametrize("arch,n_kv_head,precision,compiled,high", [
    ("gpt2", 4, "fp32", False, 1.10),
    ("llama", 2, "bf16", False, 1.10),
    ("gpt2", 4, "fp32", True, 1.10),
    # inductor recomputes llama's norm, RoPE and SwiGLU outputs in the backward rather than saving them, which the
    # count (eager's) does not know: measured 1.12-1.16x at batches 8 and 32
    ("llama", 2, "bf16", True, 1.20),
])
@pytest.mark.slow  # measured peaks of large batches, ~40 s in all on 2 cores: `make test-slow`
def test_the_plan_holds_from_small_batches_to_logits_dominated_ones(arch, n_kv_head, precision, compiled, high,
                                                                     batch):
    shape = Shape(ModelConfig(arch=arch, n_kv_head=n_kv_head, **SCALING), precision, compiled=compiled)
    estimate = plan(shape, batch, SCALING["max_seq_len"], None)["total_bytes"]
    measured = measure_cpu_peak(shape, batch, SCALING["max_seq_len"])
    assert 0.99 <= estimate / measured < high, (estimate, measured)


def test_the_step_temporaries_are_counted_only_for_unfused_adamw():
    """A small batch's peak is AdamW's step; unfused (off CUDA) it holds two fp32 copies of the largest
    parameter beside every gradient and moment, fused none."""
    config = ModelConfig(arch="gpt2", n_kv_head=4, **SCALING)
    unfused, fused = plan(Shape(config), 1, 8, None), plan(Shape(config, fused_adamw=True), 1, 8, None)
    assert unfused["step_temporary_bytes"] == 2 * 4 * 8192 * 128 and fused["step_temporary_bytes"] == 0
    assert unfused["total_bytes"] - fused["total_bytes"] == 2 * 4 * 8192 * 128


@pytest.mark.parametrize("kw,precision,checkpointing", [
    (dict(vocab_size=4096, n_layer=1, n_head=4, n_kv_head=2, d_model=64, max_seq_len=128), "fp32", False),
    (dict(vocab_size=2048, n_layer=1, n_head=4, n_kv_head=4, d_model=128, max_seq_len=128, arch="gpt2"), "fp32",
     True),
])
def test_a_compiled_step_is_planned_at_or_a_little_above_its_measured_peak(kw, precision, checkpointing):
    """Under torch.compile inductor fuses the loss and holds one logits tensor, not eager's three: the plan must
    neither refuse a run that fits by planning eager's logits (2x high on the H200) nor plan below the peak."""
    shape = Shape(ModelConfig(**kw), precision, checkpointing=checkpointing, compiled=True)
    estimate = plan(shape, 8, kw["max_seq_len"], None)["total_bytes"]
    measured = measure_cpu_peak(shape, 8, kw["max_seq_len"])
    assert 1.0 <= estimate / measured < 1.2, (estimate, measured)
    if not checkpointing:
        eager = Shape(ModelConfig(**kw), precision)
        assert estimate < 0.6 * plan(eager, 8, kw["max_seq_len"], None)["total_bytes"]


@pytest.mark.parametrize("kw", [dict(vocab_size=256, n_layer=4, n_head=4, n_kv_head=2, d_model=256),
                                dict(vocab_size=256, n_layer=6, n_head=4, n_kv_head=4, d_model=256, mlp="relu2"),
                                dict(vocab_size=512, n_layer=2, n_head=4, n_kv_head=4, d_model=128, d_ff=1000)])
def test_muon_is_planned_with_one_momentum_and_its_steps_stacks(kw):
    """train.optimizer=muon: the blocks' matrices keep one fp32 momentum (4 B/param, AdamW's 8 for the rest), and at
    a batch of one the peak is Muon's step, whose stacked Newton-Schulz copies the plan counts (square, wide and
    tall stacks, gated and ungated MLPs)."""
    config = ModelConfig(max_seq_len=32, **kw)
    shape = Shape(config, optimizer="muon")
    result = plan(shape, 1, 32, None)
    blocks = sum(p.numel() for name, p in GPT(config).blocks.named_parameters() if p.dim() == 2)
    assert result["optimizer_bytes"] == 8 * (config.num_params() - blocks) + 4 * blocks
    measured = measure_cpu_peak(shape, 1, 32)
    assert 0.99 <= result["total_bytes"] / measured < 1.10, (result["total_bytes"], measured)


def test_checkpointing_plans_less_and_the_largest_batch_is_the_largest_that_fits(tmp_path):
    config = ModelConfig(vocab_size=50257, n_layer=12, n_head=12, n_kv_head=12, d_model=768, max_seq_len=1024)
    plain, recompute = Shape(config, "bf16", fused=True), Shape(config, "bf16", fused=True, checkpointing=True)
    assert plan(recompute, 8, 1024, None)["activation_bytes"] < plan(plain, 8, 1024, None)["activation_bytes"] / 3
    result = plan(plain, 1, 1024, 80 * 10**9)
    fits = result["largest_batch_size"]
    assert fits > 1
    room = 80e9 * (1 - HEADROOM)  # the allocator's and the libraries' share is left free
    assert plan(plain, fits, 1024, None)["total_bytes"] <= room < plan(plain, fits + 1, 1024, None)["total_bytes"]
    assert plan(plain, 1, 1024, 10**8)["largest_batch_size"] == 0  # not even one sequence in 0.1 GB


def test_the_command_prints_and_writes_the_plan(tmp_path):
    out = tmp_path / "plan.json"
    result = CliRunner().invoke(app, ["plan", "memory", "--device-gb", "1", "--out", str(out),
                                      "--set", "model.n_layer=2", "--set", "precision=bf16", "--set",
                                      "optimizer=adamw"])
    assert result.exit_code == 0, result.output
    assert "AdamW state" in result.output and "largest micro-batch in 1 GB" in result.output
    plan_json = json.loads(out.read_text())
    assert plan_json["model"]["n_layer"] == 2 and plan_json["precision"] == "bf16"
    assert plan_json["optimizer_bytes"] == 2 * plan_json["weights_bytes"] == 8 * plan_json["params"]
    assert plan_json["kernels"] == "torch" and not plan_json["compile"]  # auto: what a run on this CPU uses

    compiled = CliRunner().invoke(app, ["plan", "memory", "--device-gb", "1", "--out", str(out), "--set",
                                        "model.n_layer=2", "--set", "precision=bf16", "--set", "compile=true",
                                        "--set", "optimizer=adamw"])
    assert compiled.exit_code == 0 and "torch.compile" in compiled.output, compiled.output
    compiled_json = json.loads(out.read_text())
    assert compiled_json["compile"] and compiled_json["activation_bytes"] < plan_json["activation_bytes"]


@pytest.mark.parametrize("args,message", [(["--batch-size", "0"], "--batch-size 0"),
                                          (["--device-gb", "-1"], "--device-gb -1"),
                                          (["--seq-len", "100000"], "--seq-len 100000"),
                                          (["--measure", "--set", "kernels=triton"], "--measure with --kernels")])
def test_bad_options_are_one_line_errors(args, message):
    result = CliRunner().invoke(app, ["plan", "memory", *args])
    assert result.exit_code == 2 and message in result.output and "Traceback" not in result.output


def test_an_out_that_is_a_folder_is_one_line(tmp_path):
    """`--out <folder>` was an IsADirectoryError traceback; the folder is left as it was."""
    (tmp_path / "mine.txt").write_text("kept")
    result = CliRunner().invoke(app, ["plan", "memory", "--out", str(tmp_path)])
    assert result.exit_code == 2 and f"{tmp_path}: a folder" in result.output, result.output
    assert "Traceback" not in result.output and [p.name for p in tmp_path.iterdir()] == ["mine.txt"]
