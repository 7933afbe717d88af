"""`kiln convert from-hf | to-hf`, with transformers as the independent reference for every number."""

import json
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from typer.testing import CliRunner

from kiln.model.checkpoint import load_model, save_model
from kiln.model.config import ModelConfig
from kiln.model.gpt import GPT
from kiln.model.generate import generate as kiln_generate
from kiln.pipeline.cli import app
from kiln.pipeline.outputs import sha256_file
from kiln.pipeline.tasks.chat_format import IM_END, ChatFormat
from kiln.pipeline.text.bpe import EOT, load_tokenizer

from conftest import make_documents

transformers = pytest.importorskip("transformers")

# fp32 logits of magnitude ~1: the two implementations differ by float rounding (measured ~1e-6), while any
# mapping mistake (a transposed or mis-split matrix, a shifted rotary pair, a wrong GQA group) is O(1).
TOL = 1e-4
SEQ = 16


def convert(*args: str):
    return CliRunner().invoke(app, ["convert", *map(str, args)])


@torch.no_grad()
def add_noise(module: torch.nn.Module, seed: int) -> None:
    """Move every weight off its init (norm gains off 1, biases off 0, each matrix its own scale), so that
    swapping any two tensors, or a tensor and its transpose, changes the output."""
    g = torch.Generator().manual_seed(seed)
    for p in module.parameters():
        p.add_(torch.randn(p.shape, generator=g) * 0.2)


def random_ids(vocab: int, seed: int) -> torch.Tensor:
    return torch.randint(vocab, (2, SEQ - 3), generator=torch.Generator().manual_seed(seed))


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape
    return (a - b).abs().max().item()


def hf_gpt2(**overrides):
    config = transformers.GPT2Config(vocab_size=101, n_positions=SEQ, n_embd=32, n_layer=2, n_head=4,
                                     bos_token_id=0, eos_token_id=0, attn_implementation="eager", **overrides)
    model = transformers.GPT2LMHeadModel(config)
    add_noise(model, seed=1)
    return model.eval()


def hf_llama(tie: bool):
    config = transformers.LlamaConfig(vocab_size=99, hidden_size=32, intermediate_size=72, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
                                      rope_theta=500.0, rms_norm_eps=1e-5, tie_word_embeddings=tie,
                                      bos_token_id=0, eos_token_id=1, attn_implementation="eager")
    model = transformers.LlamaForCausalLM(config)
    add_noise(model, seed=2)
    return model.eval()


def kiln_logits(model_dir, ids):
    model, _ = load_model(model_dir)
    with torch.no_grad():
        return model(ids)


def hf_logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


def save_hf(model, path, layout: str = "safetensors"):
    """The layouts found on the hub: one safetensors file, shards with an index, and GPT-2's original
    pytorch_model.bin (names without `transformer.`, plus the causal-mask buffers)."""
    if layout == "sharded":
        model.save_pretrained(path, max_shard_size="40KB")
        assert (path / "model.safetensors.index.json").is_file() and not (path / "model.safetensors").exists()
        return path
    model.save_pretrained(path)
    if layout == "legacy-bin":
        state = {k.removeprefix("transformer."): v for k, v in model.state_dict().items() if k != "lm_head.weight"}
        for i in range(model.config.n_layer):
            state[f"h.{i}.attn.bias"] = torch.tril(torch.ones(SEQ, SEQ)).view(1, 1, SEQ, SEQ)
        (path / "model.safetensors").unlink()
        torch.save(state, path / "pytorch_model.bin")
    return path


# --- from-hf: transformers checkpoints in ---------------------------------------------------------------------

@pytest.mark.parametrize("layout", ["safetensors", "sharded", "legacy-bin"])
def test_from_hf_gpt2_computes_what_transformers_does(tmp_path, layout):
    hf = hf_gpt2(n_inner=48)
    src = save_hf(hf, tmp_path / "hf", layout)
    result = convert("from-hf", src, tmp_path / "kiln")
    assert result.exit_code == 0, result.output
    model, meta = load_model(tmp_path / "kiln")
    c = model.config
    assert (c.arch, c.vocab_size, c.n_layer, c.n_head, c.n_kv_head, c.d_model, c.d_ff, c.max_seq_len, c.dropout,
            c.tie_embeddings) == ("gpt2", 101, 2, 4, 4, 32, 48, SEQ, 0.1, True)
    assert meta == {"converted_from": str(src)}  # no tokenizer.json in the source, so none recorded
    # The padding rows (101 -> 128) are zeros, never random: they would otherwise be read by nothing, but a
    # later export must not depend on them.
    assert model.tok_emb.weight.shape[0] == 128 and not model.tok_emb.weight[101:].any()
    ids = random_ids(101, seed=3)
    diff = max_diff(kiln_logits(tmp_path / "kiln", ids), hf_logits(hf, ids))
    print(f"gpt2 ({layout}) from-hf max |logit diff| = {diff:.2e}")
    assert diff <= TOL


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_from_hf_llama_with_gqa_computes_what_transformers_does(tmp_path, tie):
    hf = hf_llama(tie)
    hf.save_pretrained(tmp_path / "hf")
    result = convert("from-hf", tmp_path / "hf", tmp_path / "kiln")
    assert result.exit_code == 0, result.output
    c = load_model(tmp_path / "kiln")[0].config
    assert (c.arch, c.vocab_size, c.n_head, c.n_kv_head, c.d_ff, c.rope_theta, c.norm_eps, c.tie_embeddings) == \
        ("llama", 99, 4, 2, 72, 500.0, 1e-5, tie)
    ids = random_ids(99, seed=4)
    diff = max_diff(kiln_logits(tmp_path / "kiln", ids), hf_logits(hf, ids))
    print(f"llama ({'tied' if tie else 'untied'}, GQA 4/2) from-hf max |logit diff| = {diff:.2e}")
    assert diff <= TOL


# --- to-hf: kiln models out, and back -----------------------------------------------------------------------

@pytest.fixture(scope="module", params=["llama", "llama-tied", "gpt2", "llama-qk_norm"])
def exported(request, tiny, tmp_path_factory):
    """A chat model of each architecture (llama with GQA; llama with QK-norm, which is Qwen3), exported with the
    tiny tokenizer: (kiln folder, HF folder). Vocabulary ~300, not a multiple of 64, so the padding rows are
    exercised."""
    arch = request.param.removesuffix("-tied").removesuffix("-qk_norm")
    root = tmp_path_factory.mktemp(f"export-{request.param}")
    vocab = load_tokenizer(tiny.tokenizer).get_vocab_size()
    assert vocab % 64
    llama = arch == "llama"
    # rope_theta only where it is used: gpt2 has no rotary embedding, and HF's GPT-2 config no such field.
    config = ModelConfig(vocab_size=vocab, arch=arch, n_layer=2, n_head=4, n_kv_head=2 if llama else 4, d_model=32,
                         max_seq_len=48, tie_embeddings=request.param != "llama",
                         rope_theta=1000.0 if llama else 10000.0, qk_norm=request.param.endswith("qk_norm"))
    torch.manual_seed(5)
    model = GPT(config)
    add_noise(model, seed=6)
    save_model(model, config, root / "kiln", {"tokenizer_sha256": sha256_file(tiny.tokenizer), "chat_format": "chatml"})
    result = convert("to-hf", root / "kiln", root / "hf", "--tokenizer", tiny.tokenizer)
    assert result.exit_code == 0, result.output
    return root / "kiln", root / "hf"


def test_to_hf_loads_in_transformers_and_computes_the_same(exported, tiny):
    kiln_dir, hf_dir = exported
    kiln, _ = load_model(kiln_dir)
    tok = load_tokenizer(tiny.tokenizer)
    assert sorted(p.name for p in hf_dir.iterdir()) == ["config.json", "generation_config.json", "model.safetensors",
                                                         "tokenizer.json", "tokenizer_config.json"]
    with safe_open(hf_dir / "model.safetensors", "pt") as f:
        assert f.metadata() == {"format": "pt"}
    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, attn_implementation="eager").eval()
    assert hf.dtype == torch.float32 and hf.config.vocab_size == kiln.config.vocab_size
    assert type(hf).__name__ == ("Qwen3ForCausalLM" if kiln.config.qk_norm else
                                 {"llama": "LlamaForCausalLM", "gpt2": "GPT2LMHeadModel"}[kiln.config.arch])
    # generate() stops at any eos id and pads with pad: these chat models at <|im_end|> or <|endoftext|> (what
    # `kiln chat` stops at), and <|pad|>.
    eot, pad, im_end = tok.token_to_id(EOT), tok.token_to_id("<|pad|>"), tok.token_to_id(IM_END)
    assert (hf.config.bos_token_id, hf.config.eos_token_id, hf.config.pad_token_id) == (eot, eot, pad)
    assert (hf.generation_config.bos_token_id, hf.generation_config.eos_token_id,
            hf.generation_config.pad_token_id) == (eot, [im_end, eot], pad)
    ids = random_ids(kiln.config.vocab_size, seed=7)
    with torch.no_grad():
        diff = max_diff(kiln(ids), hf(ids).logits)
    print(f"{kiln.config.arch} ({'tied' if kiln.config.tie_embeddings else 'untied'}) to-hf max |logit diff| = "
          f"{diff:.2e}")
    assert diff <= TOL


def test_kiln_to_hf_to_kiln_is_bit_exact(exported, tmp_path):
    kiln_dir, hf_dir = exported
    result = convert("from-hf", hf_dir, tmp_path / "back")
    assert result.exit_code == 0, result.output
    assert "kiln generate, chat, sft and dpo can use it" in result.output
    before, meta_before = load_model(kiln_dir)
    after, meta_after = load_model(tmp_path / "back")
    assert after.config == before.config
    # The copied tokenizer is the same file, and the chat template marks the model as ChatML again.
    assert meta_after["tokenizer_sha256"] == meta_before["tokenizer_sha256"]
    assert meta_after["chat_format"] == "chatml"
    assert sha256_file(tmp_path / "back" / "tokenizer.json") == meta_before["tokenizer_sha256"]
    vocab = before.config.vocab_size
    a, b = load_file(kiln_dir / "model.safetensors"), load_file(tmp_path / "back" / "model.safetensors")
    assert a.keys() == b.keys()
    for name in a:
        if name in ("tok_emb.weight", "lm_head.weight"):
            # Rows past the vocabulary are padding: HF has none, so they come back as zeros.
            assert torch.equal(a[name][:vocab], b[name][:vocab]) and not b[name][vocab:].any(), name
        else:
            assert torch.equal(a[name], b[name]), name
    # Exported again (the tokenizer now found beside the model), every HF file is the same, byte for byte.
    result = convert("to-hf", tmp_path / "back", tmp_path / "hf2")
    assert result.exit_code == 0, result.output
    for path in hf_dir.iterdir():
        assert (tmp_path / "hf2" / path.name).read_bytes() == path.read_bytes(), path.name


def test_tokenizer_encodes_like_kiln_and_chat_template_renders_kilns_chatml(exported, tiny):
    _, hf_dir = exported
    hf_tok = transformers.AutoTokenizer.from_pretrained(hf_dir)
    kiln_tok = load_tokenizer(tiny.tokenizer)
    assert hf_tok.bos_token_id == hf_tok.eos_token_id == kiln_tok.token_to_id(EOT)
    assert hf_tok.pad_token_id == kiln_tok.token_to_id("<|pad|>")
    texts = make_documents(20, seed=9) + ["", "  two  spaces\tand\r\nlines\n\n", "emoji 🙂 family 👨‍👩‍👧 東京",
                                          "<|endoftext|> special <|im_start|>user"]
    for text in texts:
        ids = kiln_tok.encode(text).ids
        assert hf_tok(text, add_special_tokens=False)["input_ids"] == ids, repr(text)
        assert hf_tok(text)["input_ids"] == ids, "adds no token by itself, as kiln's tokenizer"
        assert hf_tok.decode(ids) == kiln_tok.decode(ids, skip_special_tokens=False) == text

    chat = ChatFormat(load_tokenizer(tiny.tokenizer, ordinary=True))
    conversations = [
        [{"role": "user", "content": "doc 7: the king"}],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "naïve café?"},
         {"role": "assistant", "content": " well, said 🙂 "}, {"role": "user", "content": "x=y+1;\tO\nday"}],
        [{"role": "system", "content": "You are kiln."}],
        [{"role": "user", "content": ""}, {"role": "assistant", "content": "speak\n\n"},
         {"role": "user", "content": "東京 1234 hear me"}, {"role": "assistant", "content": "O night"}],
    ]
    for messages in conversations:
        want = chat.prompt(messages)
        assert hf_tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                          return_dict=False) == want
        assert hf_tok.apply_chat_template(messages, tokenize=True, return_dict=False) == chat.render(messages).ids


def test_transformers_greedy_generation_matches_kiln_generate_and_chat(exported, tiny):
    kiln_dir, hf_dir = exported
    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    hf_tok = transformers.AutoTokenizer.from_pretrained(hf_dir)
    prompt, new = "doc 12: the queen", 12

    # `kiln generate`: the prompt follows <|endoftext|>, as every document in the shards does, and the text
    # ends at <|endoftext|> alone (generation_config's eos ids are the chat ones).
    ids = [hf_tok.bos_token_id, *hf_tok(prompt)["input_ids"]]
    out = hf.generate(torch.tensor([ids]), max_new_tokens=new, do_sample=False,
                      eos_token_id=hf_tok.eos_token_id)[0, len(ids):].tolist()
    kiln, _ = load_model(kiln_dir)
    assert out == kiln_generate(kiln, [ids], new, temperature=0, stop_ids=[hf_tok.eos_token_id])[0]
    assert len(out) == new, "no early <|endoftext|>: every step is compared"
    result = CliRunner().invoke(app, ["generate", "--model", str(kiln_dir), "--tokenizer", str(tiny.tokenizer),
                                      "--prompt", prompt, "--temperature", "0", "--max-new-tokens", str(new),
                                      "--device", "cpu"])
    assert result.exit_code == 0, result.output
    assert result.output == prompt + hf_tok.decode(out, skip_special_tokens=True) + "\n"

    # `kiln chat`: the ChatML prompt from the chat template, stopping at the end of the turn.
    messages = [{"role": "user", "content": "Who said day?"}]
    ids = hf_tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert len(ids) + 8 - 1 <= kiln.config.max_seq_len, "kiln chat would shorten the answer to fit its context"
    stops = [hf_tok.convert_tokens_to_ids(IM_END), hf_tok.eos_token_id]
    out = hf.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False)[0, len(ids):]  # generation_config's eos
    answer = out.tolist()
    answer = answer[:next((i for i, t in enumerate(answer) if t in stops), len(answer))]
    result = CliRunner().invoke(app, ["chat", "--model", str(kiln_dir), "--tokenizer", str(tiny.tokenizer),
                                      "--temperature", "0", "--max-new-tokens", "8", "--device", "cpu"],
                                input=messages[0]["content"] + "\n")
    assert result.exit_code == 0, result.output
    assert result.output == "kiln> " + hf_tok.decode(answer) + "\n"


def test_exported_chat_model_stops_at_im_end_in_transformers_as_kiln_chat_does(tiny, tmp_path):
    """The bug this guards: with `<|endoftext|>` as its only eos id, transformers ran a chat model's answer on
    past `<|im_end|>` into a made-up next turn. The model is made to end its answer: greedy kiln output is
    taken without stops, and the head rows of its k-th new token and `<|im_end|>` are swapped (untied, so the
    input embeddings, and the k tokens before, are unchanged): step k now emits `<|im_end|>`."""
    tok = load_tokenizer(tiny.tokenizer)
    chat = ChatFormat(load_tokenizer(tiny.tokenizer, ordinary=True))
    config = ModelConfig(vocab_size=tok.get_vocab_size(), arch="llama", n_layer=1, n_head=2, n_kv_head=1,
                         d_model=32, max_seq_len=64, tie_embeddings=False)
    torch.manual_seed(8)
    model = GPT(config)
    add_noise(model, seed=9)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Who said day?"}]
    prompt = chat.prompt(messages)
    free = kiln_generate(model, [prompt], 12, temperature=0)[0]
    k = next(k for k in range(2, 12) if free[k] not in free[:k])
    assert chat.im_end not in free[:k + 1] and chat.eot not in free[:k]
    with torch.no_grad():
        model.lm_head.weight[[free[k], chat.im_end]] = model.lm_head.weight[[chat.im_end, free[k]]].clone()
    want = kiln_generate(model, [prompt], 12, temperature=0, stop_ids=[chat.im_end, chat.eot])[0]
    assert want == [*free[:k], chat.im_end]

    sha = sha256_file(tiny.tokenizer)
    for kind, extra in (("chat", {"chat_format": "chatml"}), ("base", {})):
        save_model(model, config, tmp_path / kind, {"tokenizer_sha256": sha, **extra})
        result = convert("to-hf", tmp_path / kind, tmp_path / f"hf-{kind}", "--tokenizer", tiny.tokenizer)
        assert result.exit_code == 0, result.output
    hf_tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf-chat")
    ids = hf_tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert ids == prompt
    for kind, stops in (("chat", [chat.im_end, chat.eot]), ("base", chat.eot)):
        hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / f"hf-{kind}").eval()
        assert hf.generation_config.eos_token_id == stops, kind
        out = hf.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False)[0, len(ids):].tolist()
        # The chat model ends its turn where kiln chat does; the base model knows no turns and runs on.
        assert out == (want if kind == "chat" else kiln_generate(model, [prompt], 12, temperature=0,
                                                                 stop_ids=[chat.eot])[0]), kind
    assert len(out) == 12 and chat.im_end in out
    base_tok = json.loads((tmp_path / "hf-base" / "tokenizer_config.json").read_text())
    assert "chat_template" not in base_tok and base_tok["eos_token"] == EOT


# --- refusals -------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    hf_gpt2().save_pretrained(root / "gpt2")
    hf_llama(tie=False).save_pretrained(root / "llama")
    return root


def edit_config(path, **changes):
    config = json.loads((path / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key)
        else:
            config[key] = value
    (path / "config.json").write_text(json.dumps(config))


def assert_refused(result, message: str, out) -> None:
    """Exit 2, one line naming the problem, and nothing written beside `out` either."""
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], result.output
    assert "Traceback" not in result.output
    assert not out.exists() and not list(out.parent.glob(f"{out.name}.*")), list(out.parent.iterdir())


@pytest.mark.parametrize("arch, change, message", [
    ("llama", {"architectures": ["MistralForCausalLM"]},
     "config.json: architectures=['MistralForCausalLM'] is not supported (kiln converts GPT2LMHeadModel, "
     "LlamaForCausalLM or Qwen3ForCausalLM)"),
    ("llama", {"architectures": ["Qwen3ForCausalLM"], "use_sliding_window": True},
     "config.json: use_sliding_window=True is not supported (kiln's llama model computes False)"),
    ("llama", {"architectures": None}, "architectures=None is not supported"),
    ("llama", {"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0}},
     "config.json: rope_parameters.rope_type='llama3' is not supported"),
    ("llama", {"rope_parameters": None, "rope_scaling": {"type": "linear", "factor": 2.0}},
     "rope_scaling.rope_type='linear' is not supported"),
    ("llama", {"rope_parameters": {"rope_type": "default", "rope_theta": 5e5, "partial_rotary_factor": 0.5}},
     "rope_parameters.partial_rotary_factor=0.5 is not supported"),
    ("llama", {"attention_bias": True}, "config.json: attention_bias=True is not supported"),
    ("llama", {"mlp_bias": True}, "mlp_bias=True is not supported"),
    ("llama", {"hidden_act": "gelu"}, "hidden_act='gelu' is not supported"),
    ("llama", {"head_dim": 16}, "head_dim=16 is not supported (kiln's head_dim is hidden_size/num_attention_heads"),
    ("llama", {"num_key_value_heads": 3}, "n_kv_head: 3 does not divide n_head=4"),
    ("llama", {"hidden_size": None}, "config.json: hidden_size: missing"),
    ("llama", {"num_hidden_layers": "2"}, "config.json: num_hidden_layers: expected a positive integer, got '2'"),
    ("llama", {"vocab_size": 100}, "tensor shapes do not match config.json (model.embed_tokens.weight (99, 32) != "
                                   "(100, 32)"),
    ("llama", {"tie_word_embeddings": True}, "model.safetensors: lm_head.weight differs from "
                                             "model.embed_tokens.weight, but config.json ties them"),
    ("gpt2", {"activation_function": "relu"}, "activation_function='relu' is not supported"),
    ("gpt2", {"tie_word_embeddings": False}, "tie_word_embeddings=False is not supported"),
    ("gpt2", {"scale_attn_by_inverse_layer_idx": True}, "scale_attn_by_inverse_layer_idx=True is not supported"),
    ("gpt2", {"attn_pdrop": 0.0}, "embd_pdrop=0.1, attn_pdrop=0.0, resid_pdrop=0.1 is not supported (kiln's "
                                  "model has one dropout rate)"),
])
def test_from_hf_refuses_what_kiln_cannot_compute_exactly(hf_dirs, tmp_path, arch, change, message):
    src = tmp_path / "src"
    shutil.copytree(hf_dirs / arch, src)
    edit_config(src, **change)
    out = tmp_path / "out" / "model"
    assert_refused(convert("from-hf", src, out), message, out)


def test_from_hf_refuses_a_missing_config_or_weights_or_folder(hf_dirs, tmp_path):
    out = tmp_path / "out" / "model"
    src = tmp_path / "src"
    shutil.copytree(hf_dirs / "gpt2", src)
    (src / "model.safetensors").unlink()
    assert_refused(convert("from-hf", src, out), "src: no weights (model.safetensors", out)
    (src / "config.json").unlink()
    assert_refused(convert("from-hf", src, out), "src/config.json: not found", out)
    assert_refused(convert("from-hf", tmp_path / "nothing", out), "nothing: not found", out)
    # a config.json that never ends (/dev/zero: a MemoryError traceback) or is far too large for one
    (src / "config.json").symlink_to("/dev/zero")
    assert_refused(convert("from-hf", src, out), "src/config.json: a device; expected a JSON file", out)
    (src / "config.json").unlink()
    with open(src / "config.json", "wb") as f:
        f.truncate((64 << 20) + 1)  # sparse: no disk spent
    assert_refused(convert("from-hf", src, out), "src/config.json: 67,108,865 bytes; expected a JSON file of at "
                   "most 67,108,864", out)


def test_to_hf_refuses_the_wrong_tokenizer_a_missing_model_and_gpt2_with_gqa(tiny, tmp_path):
    out = tmp_path / "out" / "hf"
    config = ModelConfig(vocab_size=300, arch="gpt2", n_layer=1, n_head=4, d_model=32, max_seq_len=8)
    save_model(GPT(config), config, tmp_path / "kiln", {"tokenizer_sha256": sha256_file(tiny.tokenizer)})
    other = tmp_path / "other.json"
    other.write_text(tiny.tokenizer.read_text() + "\n")  # loads the same, but is not the file trained with
    assert_refused(convert("to-hf", tmp_path / "kiln", out, "--tokenizer", other),
                   "other.json: not the tokenizer", out)
    assert_refused(convert("to-hf", tmp_path / "nothing", out, "--tokenizer", tiny.tokenizer),
                   "nothing/config.json: not found", out)
    config = ModelConfig(vocab_size=300, arch="gpt2", n_layer=1, n_head=4, n_kv_head=2, d_model=32, max_seq_len=8)
    save_model(GPT(config), config, tmp_path / "gqa")
    assert_refused(convert("to-hf", tmp_path / "gqa", out, "--tokenizer", tiny.tokenizer),
                   "model.n_kv_head=2: HF GPT-2 has no grouped-query attention", out)
    # the record runs' knobs that no transformers Llama, Qwen3 or GPT-2 model computes
    for arch, knob, message in [("llama", {"mlp": "relu2"}, "model.mlp=relu2: HF's Llama, Qwen3 and GPT-2 models "
                                 "have no ungated ReLU² MLP"),
                                ("llama", {"logit_softcap": 15.0}, "model.logit_softcap=15.0: HF's Llama, Qwen3 and "
                                 "GPT-2 models do not cap their logits"),
                                ("gpt2", {"qk_norm": True}, "model.qk_norm=true: HF's GPT-2 model has no QK-norm")]:
        config = ModelConfig(vocab_size=300, arch=arch, n_layer=1, n_head=4, d_model=32, max_seq_len=8, **knob)
        save_model(GPT(config), config, tmp_path / "knob", {"tokenizer_sha256": sha256_file(tiny.tokenizer)})
        assert_refused(convert("to-hf", tmp_path / "knob", out, "--tokenizer", tiny.tokenizer), message, out)


def test_a_folder_kiln_did_not_write_is_refused_unless_forced(exported, tiny, tmp_path):
    """`kiln convert to-hf MODEL p` replaced a folder p holding a user's notes.txt (exit 0). It is refused now,
    naming the file, and kept byte for byte; --force replaces it; a folder of an earlier export is replaced, and so
    is an empty one. The same for a kiln model folder (from-hf) and a file in the way."""
    kiln_dir, hf_dir = exported
    mine = tmp_path / "p"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    (mine / "config.json").write_text("{}")
    result = convert("to-hf", kiln_dir, mine, "--tokenizer", tiny.tokenizer)
    assert result.exit_code == 2 and "holds 'notes.txt', which no transformers model folder kiln writes holds" in \
        result.output and "--force" in result.output, result.output
    assert sorted(p.name for p in mine.iterdir()) == ["config.json", "notes.txt"] and \
        (mine / "config.json").read_text() == "{}"
    earlier = tmp_path / "earlier"
    shutil.copytree(hf_dir, earlier)
    (tmp_path / "empty").mkdir()
    for out in (earlier, tmp_path / "empty"):
        assert convert("to-hf", kiln_dir, out, "--tokenizer", tiny.tokenizer).exit_code == 0
    assert convert("to-hf", kiln_dir, mine, "--tokenizer", tiny.tokenizer, "--force").exit_code == 0
    assert not (mine / "notes.txt").exists() and (mine / "model.safetensors").is_file()
    back = tmp_path / "back"
    back.mkdir()
    (back / "draft.md").write_text("mine")
    result = convert("from-hf", hf_dir, back)
    assert result.exit_code == 2 and "holds 'draft.md', which no model folder kiln writes holds" in result.output
    (tmp_path / "file").write_text("mine")
    for force in ((), ("--force",)):  # a file is never an output folder, forced or not
        result = convert("from-hf", hf_dir, tmp_path / "file", *force)
        assert result.exit_code == 2 and "file: a file; expected a folder" in result.output, result.output
    assert (tmp_path / "file").read_text() == "mine"
