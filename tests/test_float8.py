"""fp8 training (train.precision: fp8, pipeline/train/float8.py): which layers convert, what is refused, a run
that tracks bf16's loss and resumes bitwise, and under FSDP2 the fp8 gathers' scales computed once after each
optimizer step. On this CPU TorchAO emulates the fp8 matmuls (the same casts and scales, and FSDP2's fp8
all-gather on gloo); a GPU run measures the speed."""

import contextlib
import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file
from test_train import MODEL, checkpoints, run

from kiln.model.config import ModelConfig
from kiln.model.gpt import GPT
from kiln.model.lora import apply_adapter
from kiln.pipeline.config import build_section
from kiln.pipeline.errors import UserError
from kiln.pipeline.runtime import setup_precision
from kiln.pipeline.train import float8
from kiln.pipeline.train.float8 import after_optimizer_step, precompute_fp8_scales, to_float8_training
from kiln.pipeline.train.lm import lm_loss
from kiln.pipeline.train.loop import Step, build_optimizer
from kiln.pipeline.train.params import ModelParams, TrainParams, run_identity
from kiln.pipeline.train.pretrain import pretrain

CPU = torch.device("cpu")


def float8_linear():
    from torchao.float8.float8_linear import Float8Linear
    return Float8Linear


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_the_blocks_linear_layers_convert_and_nothing_else(recipe):
    model = GPT(ModelConfig(vocab_size=300, n_layer=2, n_head=4, n_kv_head=2, d_model=64, max_seq_len=32))
    before = {name: type(m) for name, m in model.named_modules()}
    assert to_float8_training(model, recipe, CPU) == 2 * 7  # q, k, v, o, gate, up, down a block
    for name, module in model.named_modules():
        if name.startswith("blocks.") and before[name] is torch.nn.Linear:
            assert isinstance(module, float8_linear()), name
            assert module.config.emulate  # off CUDA the fp8 matmuls are emulated
        else:  # the embedding, the LM head, the norms and the containers are as they were
            assert type(module) is before[name], name
    assert list(model.state_dict()) == list(GPT(model.config).state_dict())  # checkpoints hold the same tensors


def test_a_layer_fp8_gemms_cannot_take_stays_and_is_said_once(capsys):
    # an MLP 40 wide: gate, up and down are not multiples of 16
    model = GPT(ModelConfig(vocab_size=300, n_layer=2, n_head=2, n_kv_head=2, d_model=32, d_ff=40, max_seq_len=16))
    assert to_float8_training(model, "tensorwise", CPU) == 2 * 4
    assert type(model.blocks[0].mlp.up_proj) is torch.nn.Linear
    said = " ".join(capsys.readouterr().err.split())  # the console's, its wrapping undone
    assert said.count("stay bf16") == 1
    assert ("train.precision=fp8: 6 linear layers stay bf16, their widths not multiples of 16 (first: "
            "blocks.0.mlp.gate_proj)") in said


def test_an_adapter_is_refused_in_one_line():
    model = GPT(ModelConfig(vocab_size=300, n_layer=1, n_head=2, n_kv_head=2, d_model=32, max_seq_len=16))
    apply_adapter(model, "lora", 4, 8.0, 0.0, ["q_proj", "v_proj"])
    with pytest.raises(UserError, match=r"^params: train.precision=fp8 trains every weight \(sft.adapter=full\)"):
        to_float8_training(model, "tensorwise", CPU, section="sft")


def test_a_device_without_fp8_is_refused_naming_what_works(monkeypatch):
    with pytest.raises(UserError, match=r"^params: train.precision=fp8 needs a CUDA GPU of compute capability 8.9 "
                                        r"or more .*; this is mps. bf16 trains here$"):
        setup_precision(torch.device("mps"), "fp8")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    with pytest.raises(UserError, match=r"; this is NVIDIA A100-SXM4-80GB\. bf16 trains here$"):
        setup_precision(torch.device("cuda:0"), "fp8")


def test_the_recipe_is_checked_and_is_a_run_identity_only_in_fp8():
    with pytest.raises(UserError, match=r"train.fp8_recipe.*tensorwise or rowwise"):
        build_section(TrainParams, {"precision": "fp8", "fp8_recipe": "blockwise"})
    # fp32 and bf16 runs compute the same whatever the recipe says: their checkpoints stay theirs
    for precision, counted in (("fp32", False), ("bf16", False), ("fp8", True)):
        ids = [run_identity(build_section(TrainParams, {"precision": precision, "fp8_recipe": r}))
               for r in ("tensorwise", "rowwise")]
        assert (ids[0] != ids[1]) == counted


def test_an_fp8_run_resumes_bitwise(tiny, tmp_path):
    """Dynamic scales leave no state beside the weights and AdamW's: a run resumed from its step-4 checkpoint
    ends on exactly the weights of the run that went straight through."""
    _, straight = run(tiny, tmp_path / "a", max_steps=8, precision="fp8")
    run(tiny, tmp_path / "b", max_steps=8, precision="fp8")
    ckpts = checkpoints(tmp_path / "b" / "ckpt")
    for f in ckpts[-1].iterdir():
        f.unlink()
    ckpts[-1].rmdir()
    _, resumed = run(tiny, tmp_path / "b", max_steps=8, precision="fp8")
    assert straight.keys() == resumed.keys()
    assert all(torch.equal(straight[name], resumed[name]) for name in straight)
    _, bf16 = run(tiny, tmp_path / "c", max_steps=8, precision="bf16")
    assert not all(torch.equal(straight[name], bf16[name]) for name in straight)  # fp8 did compute in fp8


@pytest.mark.slow  # 400 emulated training steps, ~1.5 min on 2 cores: `make test-slow`
def test_fp8_tracks_bf16_over_200_steps_of_the_default_model(shakespeare, tmp_path):
    """The default model on the default corpus, 200 steps of one 128-token sequence, bf16 and fp8 (tensorwise)
    from the same seed. Measured: fp8's validation loss -0.041, +0.045 and +0.045 nats from bf16's at seeds
    1337, 1 and 2, while bf16's own seed-to-seed spread was 0.19 (at 256 tokens a step, both recipes, seeds 1337
    and 1: at most 0.135, spread 0.106); the tolerance is 0.15."""
    losses = {}
    for precision in ("bf16", "fp8"):
        out = tmp_path / precision
        out.mkdir()
        train = {"batch_size": 1, "batch_tokens": 128, "max_steps": 200, "eval_every": 200, "eval_tokens": 4096,
                 "checkpoint_every": 200, "log_every": 50, "device": "cpu", "precision": precision}
        with contextlib.chdir(out):
            metrics = pretrain(build_section(ModelParams, {}), build_section(TrainParams, train), shakespeare.shards,
                               shakespeare.tokenizer, out / "base", out / "ckpt")
        losses[precision] = metrics["val_loss"]
        assert metrics["val_loss"] < 6.2  # both learned: the untrained model starts near ln(vocab), ~6.9
    assert abs(losses["fp8"] - losses["bf16"]) < 0.15, losses
    assert load_file(tmp_path / "fp8/base/model.safetensors").keys() == \
        load_file(tmp_path / "bf16/base/model.safetensors").keys()


@pytest.mark.slow  # torch.compile and Triton's CPU interpreter: ~1 min on 2 cores, `make test-slow`
@pytest.mark.parametrize("setting", [{"compile": True}, {"kernels": "triton"}], ids=["compile", "kernels"])
def test_fp8_trains_under_compile_and_with_kilns_kernels_as_eagerly(tiny, tmp_path, setting):
    """fp8 with torch.compile, and with kiln's Triton kernels around the fp8 layers (norms, RoPE, SwiGLU,
    attention, the fused head): the same 4 steps end on eager fp8's losses, to rounding."""
    eager, _ = run(tiny, tmp_path / "eager", max_steps=4, precision="fp8")
    other, _ = run(tiny, tmp_path / "other", max_steps=4, precision="fp8", **setting)
    assert other["train_loss"] == pytest.approx(eager["train_loss"], abs=3e-3)  # measured: 0.9e-3, 1.2e-3
    assert other["val_loss"] == pytest.approx(eager["val_loss"], abs=3e-3)  # measured: 0.6e-3, 0.2e-3


@pytest.mark.parametrize("precision", ["fp8", "bf16"])
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
@pytest.mark.parametrize("sharded", [True, False])
def test_the_scales_are_precomputed_exactly_where_fsdp_gathers_in_fp8(precision, recipe, sharded):
    hook = after_optimizer_step(precision, recipe, sharded)
    assert (hook is precompute_fp8_scales) == (precision == "fp8" and recipe == "tensorwise" and sharded)
    assert hook is precompute_fp8_scales or hook is None


def test_the_step_runs_its_hook_once_after_each_update():
    """The hook sees the weights the optimizer step just wrote (what the next gathers will cast)."""
    torch.manual_seed(0)
    model = GPT(ModelConfig(vocab_size=64, n_layer=1, n_head=2, n_kv_head=2, d_model=32, max_seq_len=16))
    params = build_section(TrainParams, {"device": "cpu"})
    seen = []
    step = Step(model, model, build_optimizer(model, params, CPU), torch.amp.GradScaler("cpu", enabled=False),
                lm_loss, 1, params, CPU, after_update=lambda m: seen.append(m.lm_head.weight.detach().clone()))
    x = torch.randint(0, 64, (2, 17))
    before = model.lm_head.weight.detach().clone()
    for n in (1, 2):
        step(iter([(x[:, :-1], x[:, 1:])]), 1e-2, pytest.fail)
        assert len(seen) == n and torch.equal(seen[-1], model.lm_head.weight)
    assert not torch.equal(seen[0], before) and not torch.equal(seen[1], seen[0])


def test_a_one_process_fp8_run_precomputes_nothing(tiny, tmp_path, monkeypatch):
    monkeypatch.setattr(float8, "precompute_fp8_scales", lambda model: pytest.fail("precomputed without FSDP"))
    metrics, _ = run(tiny, tmp_path, max_steps=2, precision="fp8")
    assert metrics["steps"] == 2


FSDP_RUN = """
import json, sys
import torch, torch.distributed as dist
from torchao.float8.float8_linear import Float8Linear
from kiln.model.config import ModelConfig
from kiln.model.gpt import GPT
from kiln.pipeline.config import build_section
from kiln.pipeline.train import distributed
from kiln.pipeline.train.float8 import after_optimizer_step, to_float8_training
from kiln.pipeline.train.lm import lm_loss
from kiln.pipeline.train.loop import Step, build_optimizer
from kiln.pipeline.train.params import TrainParams

dist.init_process_group("gloo")
cpu = torch.device("cpu")
params = build_section(TrainParams, {"device": "cpu", "precision": "fp8", "parallel": "fsdp"})
e4m3 = torch.finfo(torch.float8_e4m3fn).max


def train(hook):
    torch.manual_seed(0)
    model = GPT(ModelConfig(vocab_size=64, n_layer=2, n_head=2, n_kv_head=2, d_model=32, max_seq_len=16))
    to_float8_training(model, params.fp8_recipe, cpu, sharded=distributed.shards(params.parallel))
    model = distributed.wrap(model, params.parallel, torch.bfloat16, cpu)
    step = Step(model, model, build_optimizer(model, params, cpu), torch.amp.GradScaler("cpu", enabled=False),
                lm_loss, 1, params, cpu, hook)
    data = torch.Generator().manual_seed(dist.get_rank())
    losses, scales = [], []
    for _ in range(3):
        x = torch.randint(0, 64, (2, 17), generator=data)
        losses.append(step(iter([(x[:, :-1], x[:, 1:])]), 1e-2, sys.exit)[0])
        # each fp8-gathered weight's scale as the step left it, beside the one its whole weight's amax gives
        scales.append([(None if (got := m.weight._local_tensor._precomputed_scale) is None else got.item(),
                        (e4m3 / m.weight.full_tensor().abs().max().double()).float().item())
                       for m in model.modules() if isinstance(m, Float8Linear)])
    weights = {k: v.full_tensor() for k, v in model.state_dict().items()}
    return losses, scales, weights


hook = after_optimizer_step(params.precision, params.fp8_recipe, distributed.shards(params.parallel))
with_hook, without = train(hook), train(None)
same = all(torch.equal(a, without[2][k]) for k, a in with_hook[2].items())
if dist.get_rank() == 0:
    json.dump({"hook": getattr(hook, "__name__", None), "losses": [with_hook[0], without[0]],
               "scales": [with_hook[1], without[1]], "same_weights": same}, open(sys.argv[1], "w"))
dist.destroy_process_group()
"""


@pytest.mark.slow  # multi-process runs, ~20 s on 2 cores: `make test-slow`
def test_under_fsdp_the_fp8_gathers_scales_come_from_one_precompute_and_train_the_same(tmp_path):
    """Two gloo processes, FSDP2 with the fp8 all-gather (TorchAO's, emulated): the hook the loop picks is the
    precompute; after each step every gathered weight holds the scale its whole weight's amax gives (the run
    without the hook holds none, and its gathers all-reduce each weight's amax instead), and both runs take the
    same losses and end on the same weights, bit for bit. How much a GPU's interconnect saves is not measured
    here (kiln bench gpu's fp8 rows)."""
    script, out = tmp_path / "fsdp_fp8.py", tmp_path / "out.json"
    script.write_text(FSDP_RUN)
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           str(script), str(out)], capture_output=True, text=True, cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(out.read_text())
    assert report["hook"] == "precompute_fp8_scales"
    hooked, plain = report["scales"]
    assert all(len(step) == 2 * 7 for step in hooked)  # every converted weight, after every step
    assert all(got == pytest.approx(want, rel=1e-6) for step in hooked for got, want in step)
    assert all(got is None for step in plain for got, _ in step)
    assert report["losses"][0] == report["losses"][1] and report["same_weights"]
