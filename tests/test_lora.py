"""LoRA and QLoRA: adapters that start as a no-op, merge into exactly the base plus their product, have the
gradients a dense float64 model gives them, compile in one graph, export to PEFT's format with the same logits,
train in the post-training stages (resuming after kill -9), and refuse bad params in one line."""

import copy
import json

import pytest
import torch
from safetensors.torch import load_file

from kiln.model.checkpoint import load_model
from kiln.model.config import ModelConfig
from kiln.model.gpt import GPT
from kiln.model.lora import LoRALinear, NF4Linear, adapter_state_dict, apply_adapter, merged_state_dict, set_adapters
from kiln.pipeline.cli import app
from tests.conftest import fails_in_one_line, write_jsonl, write_params
from tests.test_posttrain import questions, save_base
from tests.test_train import KILL_IN_SECOND_SAVE, kiln

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def tiny_model(arch: str = "llama", seed: int = 0, **shape) -> GPT:
    torch.manual_seed(seed)
    config = ModelConfig(vocab_size=200, n_layer=2, n_head=2, n_kv_head=2 if arch == "gpt2" else 1, d_model=64,
                         max_seq_len=32, arch=arch, **shape)
    return GPT(config).eval()


def randomise_adapters(model: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)


def ids(vocab: int = 200, shape=(3, 17), seed: int = 1) -> torch.Tensor:
    return torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_fresh_lora_leaves_outputs_bit_identical_and_trains_only_adapters(arch):
    model = tiny_model(arch)
    x = ids()
    before = model(x)
    targets = ALL if arch == "llama" else ["q_proj", "v_proj", "up_proj"]
    adapted = apply_adapter(copy.deepcopy(model), "lora", 4, 8.0, 0.0, targets)
    assert torch.equal(adapted(x), before)
    trainable = {n for n, p in adapted.named_parameters() if p.requires_grad}
    per_block = len(targets) * 2
    assert len(trainable) == 2 * per_block and all(".lora_A." in n or ".lora_B." in n for n in trainable)


def test_merged_weights_are_base_plus_scaled_product_and_compute_the_adapted_model():
    model = tiny_model()
    adapted = apply_adapter(copy.deepcopy(model), "lora", 4, 12.0, 0.0, ["q_proj", "down_proj"])
    randomise_adapters(adapted, seed=3)
    merged = merged_state_dict(adapted)
    q = adapted.blocks[1].attn.q_proj
    want = model.blocks[1].attn.q_proj.weight.double() + 3.0 * q.lora_B.weight.double() @ q.lora_A.weight.double()
    torch.testing.assert_close(merged["blocks.1.attn.q_proj.weight"].double(), want, rtol=0, atol=1e-6)
    assert torch.equal(merged["blocks.1.attn.k_proj.weight"], model.blocks[1].attn.k_proj.weight)
    plain = tiny_model(seed=9)
    plain.load_state_dict({**merged, "lm_head.weight": merged["tok_emb.weight"]})
    torch.testing.assert_close(plain(ids()), adapted(ids()), rtol=0, atol=1e-5)
    set_adapters(adapted, False)  # off: the base again, exactly
    assert torch.equal(adapted(ids()), model(ids()))


def test_adapter_gradients_match_a_dense_float64_model():
    """Autograd through the adapted model against the same function written densely in float64: W + s B A in
    every adapted projection, differentiated with respect to A and B."""
    model = tiny_model().double()
    adapted = apply_adapter(copy.deepcopy(model), "lora", 3, 5.0, 0.0, ["v_proj", "gate_proj", "o_proj"])
    randomise_adapters(adapted, seed=4)
    x, y = ids(), ids(seed=2)
    adapted(x, y).backward()
    dense = copy.deepcopy(model)
    leaves = {}
    for name, module in adapted.named_modules():
        if isinstance(module, LoRALinear):
            a = module.lora_A.weight.detach().clone().requires_grad_(True)
            b = module.lora_B.weight.detach().clone().requires_grad_(True)
            leaves[name] = (a, b)
            base = dense.get_submodule(name)
            base_weight = base.weight.detach().clone()
            parent, _, leaf = name.rpartition(".")
            setattr(dense.get_submodule(parent), leaf,
                    _Dense(lambda inp, w=base_weight, a=a, b=b: inp @ (w + (5.0 / 3) * b @ a).T))
    dense(x, y).backward()
    for name, (a, b) in leaves.items():
        module = adapted.get_submodule(name)
        torch.testing.assert_close(module.lora_A.weight.grad, a.grad, rtol=1e-9, atol=1e-12)
        torch.testing.assert_close(module.lora_B.weight.grad, b.grad, rtol=1e-9, atol=1e-12)
        assert a.grad.abs().sum() > 0 and b.grad.abs().sum() > 0


TOKENS = [3, 5, 197]  # rows trained beside the adapters; every input below uses them


def with_tokens(vocab: int = 200, shape=(3, 17), seed: int = 1) -> torch.Tensor:
    x = ids(vocab, shape, seed)
    x[:, 1], x[:, 4], x[0, 9] = TOKENS[0], TOKENS[1], TOKENS[2]
    return x


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("adapter", ["lora", "qlora"])
def test_trainable_token_rows_start_as_a_no_op_and_merge_into_the_table(adapter, tied):
    """Rows trained beside the adapters (PEFT's trainable_token_indices): before training the model computes
    what it did; only the adapters and the rows train; the merged state dict is the table with the trained rows in
    place, in the embedding and (tied) the LM head, and computes what the adapted model computes."""
    model = tiny_model(tie_embeddings=tied)
    x = with_tokens()
    start = apply_adapter(copy.deepcopy(model), adapter, 4, 8.0, 0.0, ["q_proj"])  # QLoRA's rounding, no rows
    adapted = apply_adapter(copy.deepcopy(model), adapter, 4, 8.0, 0.0, ["q_proj"], TOKENS)
    assert torch.equal(adapted(x), start(x))
    trainable = {n for n, p in adapted.named_parameters() if p.requires_grad}
    assert trainable == {"tok_emb.trainable_tokens_delta"} | {f"blocks.{i}.attn.q_proj.lora_{ab}.weight"
                                                               for i in range(2) for ab in "AB"}
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        adapted.tok_emb.trainable_tokens_delta.copy_(torch.randn(3, 64, generator=gen))
    merged = merged_state_dict(adapted)
    table = merged_state_dict(start)["tok_emb.weight"]
    changed = (merged["tok_emb.weight"] != table).any(dim=1).nonzero().flatten().tolist()
    assert changed == TOKENS and torch.equal(merged["tok_emb.weight"][TOKENS],
                                             adapted.tok_emb.trainable_tokens_delta.detach())
    if tied:
        assert torch.equal(merged["lm_head.weight"], merged["tok_emb.weight"])
    else:
        assert torch.equal(merged["lm_head.weight"], merged_state_dict(start)["lm_head.weight"])
    plain = tiny_model(seed=9, tie_embeddings=tied)
    plain.load_state_dict(merged)
    torch.testing.assert_close(plain(x), adapted(x), rtol=0, atol=1e-5)
    assert (adapted(x) - start(x)).abs().max() > 1e-2
    saved = adapter_state_dict(adapted.state_dict())
    assert torch.equal(saved["tok_emb.trainable_tokens_original"], table[TOKENS])
    set_adapters(adapted, False)  # off (GRPO's reference): the start again, rows included
    assert torch.equal(adapted(x), start(x))


@pytest.mark.parametrize("tied", [True, False])
def test_trainable_token_gradients_match_a_dense_float64_model(tied):
    """The rows' gradients are the dense model's gradients of those rows of its table (float64), the tied LM
    head's share included; the other rows get none (they are not parameters)."""
    model = tiny_model(tie_embeddings=tied).double()
    adapted = apply_adapter(copy.deepcopy(model), "lora", 3, 5.0, 0.0, ["v_proj"], TOKENS)
    x, y = with_tokens(), with_tokens(seed=2)
    adapted(x, y).backward()
    dense = copy.deepcopy(model).requires_grad_(False)
    dense.tok_emb.weight.requires_grad_(True)
    for name, module in adapted.named_modules():  # the same adapters, fixed
        if isinstance(module, LoRALinear):
            dense.get_submodule(name).weight.add_(module.delta().double())
    dense(x, y).backward()
    grad = dense.tok_emb.weight.grad
    torch.testing.assert_close(adapted.tok_emb.trainable_tokens_delta.grad, grad[TOKENS], rtol=1e-9, atol=1e-12)
    assert adapted.tok_emb.trainable_tokens_delta.grad.abs().min() > 0


class _Dense(torch.nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, x):
        return self.fn(x)


@pytest.mark.parametrize("adapter", ["lora", "qlora"])
def test_adapted_model_compiles_in_one_graph(adapter):
    model = apply_adapter(tiny_model(), adapter, 4, 8.0, 0.0, ALL, TOKENS).train()  # trained token rows too
    x, y = ids(), ids(seed=2)
    explained = torch._dynamo.explain(model)(x, y)
    assert explained.graph_break_count == 0, explained.break_reasons


def test_qlora_linear_recomputes_its_weight_and_sends_gradients_to_the_input_only():
    """Forward and backward equal a linear layer with the dequantised weight (float64 reference), and nothing
    the size of the weight is saved for backward: only the 4-bit codes and the input."""
    torch.manual_seed(0)
    linear = torch.nn.Linear(128, 96, bias=True)
    q = NF4Linear.__new__(NF4Linear)
    from kiln.model.lora import NF4Weight

    NF4Linear.__init__(q, NF4Weight(linear.weight, "torch"), linear.bias)
    x = torch.randn(5, 7, 128, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = q(x)
    assert not [t for t in saved if t.is_floating_point() and t.numel() >= 128 * 96], [t.shape for t in saved]
    weight = q.weight.double()
    assert weight.shape == (96, 128) and not q.weight.requires_grad
    x64 = x.detach().double().requires_grad_(True)
    want = x64 @ weight.T + linear.bias.double()
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)
    grad = torch.randn_like(out)
    out.backward(grad)
    want.backward(grad.double())
    torch.testing.assert_close(x.grad.double(), x64.grad, rtol=1e-5, atol=1e-5)
    assert all(not p.requires_grad for p in q.parameters())


def test_qlora_stores_the_base_in_nf4_and_merges_to_its_dequantised_weights():
    model = tiny_model()
    adapted = apply_adapter(copy.deepcopy(model), "qlora", 4, 8.0, 0.0, ["q_proj", "up_proj"])
    floats = [n for n, t in adapted.state_dict().items() if t.is_floating_point() and t.numel() >= 64 * 64
              and "lora_" not in n]
    assert not floats, floats  # every big frozen matrix is in 4-bit codes
    randomise_adapters(adapted, seed=5)
    merged = merged_state_dict(adapted)
    plain = tiny_model(seed=9)
    plain.load_state_dict({**merged, "lm_head.weight": merged["tok_emb.weight"]})
    torch.testing.assert_close(plain(ids()), adapted(ids()), rtol=0, atol=1e-5)
    err = (merged["blocks.0.attn.k_proj.weight"] - model.blocks[0].attn.k_proj.weight).abs()
    assert 0 < err.max() < 0.05  # NF4's rounding: close to the original, not equal


@pytest.mark.parametrize(("arch", "tokens", "tied"), [("llama", [], True), ("gpt2", [], True),
                                                      ("llama", TOKENS, True), ("llama", TOKENS, False),
                                                      ("gpt2", TOKENS, True)])
def test_peft_loads_the_exported_adapter_to_the_same_logits(tiny, tmp_path, arch, tokens, tied):
    """kiln convert to-hf --adapter: transformers loads the base, PeftModel adds the adapter, and the logits
    are the merged kiln model's (GPT-2 with q and v adapted: its fused c_attn gets one block-diagonal adapter).
    Trained token rows go as PEFT's trainable_token_indices: the base gets the start's rows back, PEFT puts the
    trained ones over them (in a tied head too)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from kiln.model.checkpoint import save_model
    from kiln.pipeline.outputs import sha256_file
    from kiln.pipeline.text.bpe import load_tokenizer

    vocab = load_tokenizer(tiny.tokenizer).get_vocab_size()
    torch.manual_seed(0)
    config = ModelConfig(vocab_size=vocab, n_layer=2, n_head=2, n_kv_head=2, d_model=64, max_seq_len=32, arch=arch,
                         tie_embeddings=tied)
    base = GPT(config).eval()
    targets = ["q_proj", "v_proj", "o_proj", "down_proj"]
    adapted = apply_adapter(copy.deepcopy(base), "lora", 4, 8.0, 0.0, targets, tokens)
    randomise_adapters(adapted, seed=6)
    spec = {"adapter": "lora", "rank": 4, "alpha": 8.0, "dropout": 0.0, "targets": targets}
    if tokens:
        spec["trainable_tokens"] = tokens
        with torch.no_grad():
            adapted.tok_emb.trainable_tokens_delta.copy_(torch.randn(len(tokens), 64))
    save_model(merged_state_dict(adapted), config, tmp_path / "kiln",
               {"tokenizer_sha256": sha256_file(tiny.tokenizer), "adapter": spec},
               adapter=adapter_state_dict(adapted.state_dict()))
    from typer.testing import CliRunner

    done = CliRunner().invoke(app, ["convert", "to-hf", str(tmp_path / "kiln"), str(tmp_path / "hf"),
                                    "--tokenizer", str(tiny.tokenizer), "--adapter"])
    assert done.exit_code == 0, done.output
    hf_base = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    x = with_tokens(vocab, (2, 20))
    with torch.no_grad():
        torch.testing.assert_close(hf_base(x).logits, base(x), rtol=0, atol=2e-5)  # the base is the start
        peft = PeftModel.from_pretrained(hf_base, tmp_path / "hf" / "adapter").eval()
        merged, _ = load_model(tmp_path / "kiln")
        torch.testing.assert_close(peft(x).logits, merged(x), rtol=0, atol=2e-5)
        assert (merged(x) - base(x)).abs().max() > 1e-2  # the adapter does change the logits
    saved = json.loads((tmp_path / "hf/adapter/adapter_config.json").read_text())
    assert saved["peft_type"] == "LORA" and saved["r"] == 4 and saved["lora_alpha"] == 8.0
    assert saved.get("trainable_token_indices") == (tokens or None)


SFT = {"data": "sft.jsonl", "text_share": 0.0, "max_steps": 6, "batch_size": 4, "batch_examples": 4, "lr": 1e-2,
       "min_lr": 1e-3, "warmup_steps": 0, "eval_every": 2, "checkpoint_every": 2, "log_every": 1, "val_examples": 2}


@pytest.fixture
def project(tiny, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write_jsonl(tmp_path / "sft.jsonl", questions())
    save_base(tiny.tokenizer, tmp_path / "base")
    return tmp_path


def sft_args(tiny, root, out: str, **sft) -> list[str]:
    write_params(root / "params.yaml", {"sft": {**SFT, **sft}, "train": {"device": "cpu", "keep_checkpoints": 1}})
    return ["sft", "--base", "base", "--tokenizer", str(tiny.tokenizer), "--corpus", str(tiny.corpus), "--out", out,
            "--checkpoints", f"ckpt-{out}"]


@pytest.mark.parametrize("adapter", ["qlora"])  # LoRA's path plus the NF4 buffers; lora alone adds nothing here
@pytest.mark.slow  # runs and a kill, ~30 s on 2 cores: `make test-slow`
def test_adapter_sft_resumes_after_kill_9_to_the_same_model(tiny, project, adapter):
    setting = {"adapter": adapter, "lora_rank": 4, "lora_targets": ["q_proj", "v_proj", "up_proj"]}
    straight = kiln(project, *sft_args(tiny, project, "straight", **setting))
    assert straight.returncode == 0, straight.output
    args = sft_args(tiny, project, "resumed", **setting)
    killed = kiln(project, *args, prelude=KILL_IN_SECOND_SAVE)
    assert killed.returncode == -9, killed.output
    resumed = kiln(project, *args)
    assert resumed.returncode == 0 and "resuming from" in resumed.output, resumed.output
    for name in ("model.safetensors", "adapter.safetensors"):
        a, b = load_file(project / "straight/model" / name), load_file(project / "resumed/model" / name)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    adapter_tensors = load_file(project / "straight/model/adapter.safetensors")
    assert sorted(adapter_tensors) == sorted(f"blocks.{i}.{m}.lora_{ab}.weight" for i in range(2)
                                            for m in ("attn.q_proj", "attn.v_proj", "mlp.up_proj") for ab in "AB")
    model, meta = load_model(project / "straight/model")  # a plain kiln model: evaluate, chat, convert take it
    assert meta["adapter"]["adapter"] == adapter and meta["adapter"]["rank"] == 4
    start, _ = load_model(project / "base")
    k = "blocks.0.attn.k_proj.weight"  # not adapted: the base's (QLoRA: dequantised) weight
    same = torch.equal(model.state_dict()[k], start.state_dict()[k])
    assert same if adapter == "lora" else not same


@pytest.mark.slow  # a run and an export, ~20 s on 2 cores: `make test-slow`
def test_lora_sft_with_the_chat_token_rows_saves_them_and_converts(tiny, project):
    """lora_trainable_tokens: chat trains <|im_start|> and <|im_end|> beside the adapters: the adapter file holds
    those rows, config.json names their ids, the merged model differs from the start in exactly those rows of
    the (tied) table, and `kiln convert to-hf --adapter` exports them for PEFT."""
    from kiln.pipeline.tasks.chat_format import ChatFormat
    from kiln.pipeline.text.bpe import load_tokenizer

    chat = ChatFormat(load_tokenizer(tiny.tokenizer, ordinary=True))
    done = kiln(project, *sft_args(tiny, project, "out", adapter="lora", lora_rank=4, lora_targets=["q_proj"],
                                   lora_trainable_tokens="chat"))
    assert done.returncode == 0, done.output
    model, meta = load_model(project / "out/model")
    assert meta["adapter"]["trainable_tokens"] == sorted([chat.im_start, chat.im_end])
    saved = load_file(project / "out/model/adapter.safetensors")
    assert saved["tok_emb.trainable_tokens_delta"].shape == (2, model.config.d_model)
    start, _ = load_model(project / "base")
    moved = (model.tok_emb.weight != start.tok_emb.weight).any(dim=1).nonzero().flatten().tolist()
    assert moved == sorted([chat.im_start, chat.im_end])
    converted = kiln(project, "convert", "to-hf", "out/model", "hf", "--tokenizer", str(tiny.tokenizer), "--adapter")
    assert converted.returncode == 0, converted.output
    config = json.loads((project / "hf/adapter/adapter_config.json").read_text())
    assert config["trainable_token_indices"] == sorted([chat.im_start, chat.im_end])


@pytest.mark.parametrize(("setting", "names"), [
    ({"lora_trainable_tokens": "special"}, ("sft.lora_trainable_tokens='special'", "none | chat | all")),
    ({"lora_trainable_tokens": [4, 4]}, ("sft.lora_trainable_tokens", "distinct")),
    ({"adapter": "lora", "lora_trainable_tokens": [1_000_000]}, ("lora_trainable_tokens", "1000000", "vocabulary")),
    ({"lora_rank": 0}, ("sft.lora_rank",)),
    ({"lora_targets": ["q_proj", "wq"]}, ("sft.lora_targets", "'wq'")),
    ({"adapter": "dora"}, ("sft.adapter", "full | lora | qlora")),
    ({"adapter": "lora", "lora_targets": ["gate_proj"], "arch": "gpt2"}, ("lora_targets", "'gate_proj'", "gpt2")),
    # past the smaller side of an adapted matrix: refused before a byte is allocated (1e6 grew to 12.7 GB, 1e9
    # ended in a RuntimeError traceback)
    ({"adapter": "lora", "lora_rank": 1_000_000}, ("sft.lora_rank=1000000", "expected at most")),
    ({"adapter": "lora", "lora_rank": 1_000_000_000}, ("sft.lora_rank=1000000000", "expected at most")),
])
def test_bad_adapter_params_fail_in_one_line(tiny, project, setting, names):
    setting = dict(setting)
    if setting.pop("arch", None) == "gpt2":
        from kiln.model.checkpoint import save_model
        from kiln.pipeline.outputs import sha256_file
        from kiln.pipeline.text.bpe import load_tokenizer

        vocab = load_tokenizer(tiny.tokenizer).get_vocab_size()
        config = ModelConfig(vocab_size=vocab, n_layer=1, n_head=2, n_kv_head=2, d_model=64, max_seq_len=64,
                             arch="gpt2")
        save_model(GPT(config), config, project / "base", {"tokenizer_sha256": sha256_file(tiny.tokenizer)})
    fails_in_one_line(sft_args(tiny, project, "out", **setting), 2, *names)
    assert not (project / "out").exists()


def test_qlora_refuses_a_width_that_is_not_whole_nf4_blocks(tiny, project):
    from kiln.model.checkpoint import save_model
    from kiln.pipeline.outputs import sha256_file
    from kiln.pipeline.text.bpe import load_tokenizer

    vocab = load_tokenizer(tiny.tokenizer).get_vocab_size()
    config = ModelConfig(vocab_size=vocab, n_layer=1, n_head=2, n_kv_head=2, d_model=96, max_seq_len=64)
    save_model(GPT(config), config, project / "base", {"tokenizer_sha256": sha256_file(tiny.tokenizer)})
    fails_in_one_line(sft_args(tiny, project, "out", adapter="qlora"), 2, "sft.adapter", "d_model=96", "64")
    assert not (project / "out").exists()


@pytest.mark.slow  # a GRPO run, ~25 s on 2 cores: `make test-slow`
def test_grpo_trains_a_qlora_adapter_against_the_base_as_reference(tiny, tmp_path, monkeypatch):
    """With beta > 0 the reference is the policy with its adapters off (no second model): at the first rollout
    it equals the policy, so the first logged KL is 0, and the run saves a merged model and its adapter."""
    from tests.test_grpo import REWARDS, grpo_args

    monkeypatch.chdir(tmp_path)
    (tmp_path / "rewards.py").write_text(REWARDS)
    write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": f"Say x, {i} times.", "answer": "x"} for i in range(40)])
    save_base(tiny.tokenizer, tmp_path / "start")
    args = grpo_args(tiny, tmp_path, max_steps=4, eval_every=4, checkpoint_every=4, log_every=1, beta=0.04,
                     adapter="qlora", lora_rank=4)
    done = kiln(tmp_path, *args)
    assert done.returncode == 0, done.output
    kl = [float(line.split("\t")[1]) for line in (tmp_path / "grpo/metrics/grpo/plots/metrics/kl.tsv").read_text()
          .splitlines()[1:]]
    assert len(kl) == 4 and kl[0] == 0 and kl[-1] > 0
    assert (tmp_path / "grpo/model/adapter.safetensors").is_file()
    assert load_model(tmp_path / "grpo/model")[1]["adapter"]["adapter"] == "qlora"


@pytest.mark.parametrize(("edit", "said"), [
    (lambda spec, folder: spec.update(alpha=-16), "config.json: adapter: alpha=-16: expected a positive number"),
    (lambda spec, folder: spec.update(rank=True), "config.json: adapter: rank=True: expected a positive integer"),
    (lambda spec, folder: spec.update(targets=["wq"]), "config.json: adapter: targets=['wq']: expected a list"),
    (lambda spec, folder: (folder / "adapter.safetensors").unlink(),
     "adapter.safetensors: not found, though"),
])
def test_convert_refuses_an_edited_adapter_naming_the_file(tiny, tmp_path, edit, said):
    """An adapter config edited by hand (alpha -16 converted with exit 0 into another model) or an adapter file
    gone (it said "trained with adapter: full") is refused in one line naming the file; nothing is written."""
    from conftest import fails_in_one_line

    from kiln.model.checkpoint import save_model
    from kiln.pipeline.outputs import sha256_file
    from kiln.pipeline.text.bpe import load_tokenizer

    vocab = load_tokenizer(tiny.tokenizer).get_vocab_size()
    config = ModelConfig(vocab_size=vocab, n_layer=1, n_head=2, n_kv_head=2, d_model=32, max_seq_len=16)
    adapted = apply_adapter(GPT(config), "lora", 2, 4.0, 0.0, ["q_proj"])
    spec = {"adapter": "lora", "rank": 2, "alpha": 4.0, "dropout": 0.0, "targets": ["q_proj"]}
    folder = tmp_path / "kiln"
    save_model(merged_state_dict(adapted), config, folder, {"tokenizer_sha256": sha256_file(tiny.tokenizer),
                                                          "adapter": spec},
               adapter=adapter_state_dict(adapted.state_dict()))
    meta = json.loads((folder / "config.json").read_text())
    edit(meta["adapter"], folder)
    (folder / "config.json").write_text(json.dumps(meta))
    fails_in_one_line(["convert", "to-hf", str(folder), str(tmp_path / "hf"), "--tokenizer", str(tiny.tokenizer),
                       "--adapter"], 2, said)
    assert not (tmp_path / "hf").exists()


@pytest.mark.parametrize(("edit", "said"), [
    (lambda spec, tensors: tensors.pop("tok_emb.trainable_tokens_original"),
     "tok_emb.trainable_tokens_original: expected finite rows of shape (3, 32)"),
    (lambda spec, tensors: spec.update(trainable_tokens=[3, 5]), "tok_emb.trainable_tokens_delta: expected"),
    (lambda spec, tensors: spec.update(trainable_tokens=[3, 3, 5]), "trainable_tokens=[3, 3, 5]: expected a list"),
    (lambda spec, tensors: spec.pop("trainable_tokens"), "trained token rows, though"),
])
def test_convert_refuses_edited_token_rows_naming_the_file(tiny, tmp_path, edit, said):
    """Trained token rows that do not match config.json's ids (a row file gone, ids edited or repeated, rows
    without ids) are refused in one line naming the file; nothing is written."""
    from conftest import fails_in_one_line
    from safetensors.torch import save_file

    from kiln.model.checkpoint import save_model
    from kiln.pipeline.outputs import sha256_file
    from kiln.pipeline.text.bpe import load_tokenizer

    vocab = load_tokenizer(tiny.tokenizer).get_vocab_size()
    config = ModelConfig(vocab_size=vocab, n_layer=1, n_head=2, n_kv_head=2, d_model=32, max_seq_len=16)
    adapted = apply_adapter(GPT(config), "lora", 2, 4.0, 0.0, ["q_proj"], TOKENS)
    spec = {"adapter": "lora", "rank": 2, "alpha": 4.0, "dropout": 0.0, "targets": ["q_proj"],
            "trainable_tokens": TOKENS}
    folder = tmp_path / "kiln"
    tensors = adapter_state_dict(adapted.state_dict())
    edit(spec, tensors)
    save_model(merged_state_dict(adapted), config, folder, {"tokenizer_sha256": sha256_file(tiny.tokenizer),
                                                          "adapter": spec})
    save_file(tensors, folder / "adapter.safetensors")
    fails_in_one_line(["convert", "to-hf", str(folder), str(tmp_path / "hf"), "--tokenizer", str(tiny.tokenizer),
                       "--adapter"], 2, said)
    assert not (tmp_path / "hf").exists()
