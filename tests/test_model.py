"""The model package: config checks, both architectures, loss, KV cache, init, FLOPs, checkpoints, generation.

Tiny configs (d_model 64, 2 layers, vocab 300 -> padded 320) keep the file to seconds on a CPU. Reference
values come from independent code in this file: F.cross_entropy on returned logits, parameter counts from
the shapes, a no-cache argmax loop, an MHA model built from a GQA one.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open

import kiln.model.atomic
import kiln.model.checkpoint
from kiln.model.generate import generate
from kiln.model.checkpoint import load_config, load_model, save_model
from kiln.model.config import ModelConfig
from kiln.model.packed import Packed
from kiln.model.gpt import GPT, KVCache

from kernel_checks import DEVICE

ARCHS = ["llama", "gpt2"]
V = 300
# every model.* knob of the record runs on (issue 69), at values that make each one change the output
KNOBS = dict(qk_norm=True, mlp="relu2", logit_softcap=3.0, zero_init=True)


def cfg(arch: str = "llama", **kw) -> ModelConfig:
    base = dict(vocab_size=V, n_layer=2, n_head=4, n_kv_head=4, d_model=64, max_seq_len=64, arch=arch)
    return ModelConfig(**{**base, **kw})


def make(arch: str = "llama", seed: int = 0, scramble: float = 0.0, **kw) -> GPT:
    """A fresh model; scramble > 0 adds noise of that std to every parameter, so logits vary strongly between
    tokens and positions (at GPT-2 init a model mostly repeats one token, which would hide cache bugs)."""
    torch.manual_seed(seed)
    m = GPT(cfg(arch, **kw))
    if scramble:
        with torch.no_grad():
            for p in m.parameters():
                p.add_(torch.randn_like(p) * scramble)
    return m.eval()


def tokens(B: int, T: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(seed))


# --- config ---------------------------------------------------------------------------------------------

def test_config_derived_sizes():
    c = cfg()
    assert c.padded_vocab_size == 320 and c.head_dim == 16
    assert c.ffn_dim == 192  # ceil(8/3 * 64) = 171 -> 192
    assert ModelConfig(vocab_size=50257).padded_vocab_size == 50304
    assert ModelConfig(vocab_size=64).padded_vocab_size == 64
    assert ModelConfig(vocab_size=V, d_model=256).ffn_dim == 704  # 683 -> 704
    assert cfg("gpt2").ffn_dim == 256 and cfg(d_ff=100).ffn_dim == 100


@pytest.mark.parametrize("kw, field", [
    (dict(n_head=6), "n_head"),                 # 6 does not divide 64
    (dict(n_kv_head=3), "n_kv_head"),           # 3 does not divide 4
    (dict(arch="bert"), "arch"),
    (dict(d_model=0), "d_model"),
    (dict(vocab_size=-1), "vocab_size"),
    (dict(dropout=1.0), "dropout"),
    (dict(n_head=32, n_kv_head=32, d_model=32), "n_head"),  # head_dim 1: odd, no RoPE pairs
    (dict(arch="gpt2", tie_embeddings=False), "tie_embeddings"),
    (dict(n_layer="2"), "n_layer"),
])
def test_config_check_names_field(kw, field):
    with pytest.raises(ValueError, match=rf"^{field}: "):
        cfg(**kw).check()
    with pytest.raises(ValueError, match=rf"^{field}: "):
        GPT(cfg(**kw))


def test_config_check_message():
    with pytest.raises(ValueError, match=r"^n_head: 6 does not divide d_model=256$"):
        ModelConfig(vocab_size=V, n_head=6, d_model=256).check()


def test_config_dict_round_trip():
    c = cfg("gpt2", dropout=0.1)
    assert ModelConfig.from_dict(json.loads(json.dumps(c.to_dict()))) == c
    # a knob is saved only when on: a model written before the knobs existed keeps its config.json
    assert not set(c.to_dict()) & set(KNOBS)
    on = cfg(**KNOBS)
    assert {k: on.to_dict()[k] for k in KNOBS} == KNOBS
    assert ModelConfig.from_dict(json.loads(json.dumps(on.to_dict()))) == on
    with pytest.raises(ValueError, match="n_layers"):
        ModelConfig.from_dict({**c.to_dict(), "n_layers": 3})
    with pytest.raises(ValueError, match="^vocab_size"):
        ModelConfig.from_dict({"n_layer": 3})


# --- forward and loss -----------------------------------------------------------------------------------

@pytest.mark.parametrize("arch", ARCHS)
def test_fresh_loss_is_ln_vocab(arch):
    m = make(arch)
    loss = m(tokens(8, 64), tokens(8, 64, seed=2))
    assert abs(loss.item() - math.log(V)) < 0.1 * math.log(V)


@pytest.mark.parametrize("arch", ARCHS)
def test_logits_cover_real_vocab_only(arch):
    m = make(arch)
    with torch.no_grad():
        m.lm_head.weight[V:] = 100.0  # padded rows would win every argmax if they were returned
    logits = m(tokens(2, 10))
    assert logits.shape == (2, 10, V)
    assert m.tok_emb.weight.shape == (320, 64)


def test_gqa_equals_mha_with_repeated_kv_heads():
    """A GQA model is an MHA model whose query heads h share kv head h // n_rep: build that MHA model."""
    gqa = make("llama", n_kv_head=2, scramble=0.3)
    mha = make("llama", n_kv_head=4)
    sd = gqa.state_dict()
    for name, w in list(sd.items()):
        if name.endswith(("k_proj.weight", "v_proj.weight")):
            assert w.shape == (2 * 16, 64)
            sd[name] = w.view(2, 16, 64).repeat_interleave(2, dim=0).reshape(64, 64)
    mha.load_state_dict(sd)
    x = tokens(2, 20)
    torch.testing.assert_close(gqa(x), mha(x), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("arch", ARCHS)
def test_causal(arch):
    m = make(arch, scramble=0.3)
    x = tokens(1, 24)
    y = x.clone()
    t = 10
    y[0, t] = (x[0, t] + 1) % V
    a, b = m(x), m(y)
    torch.testing.assert_close(a[:, :t], b[:, :t], atol=0, rtol=0)
    assert not torch.allclose(a[:, t:], b[:, t:])


@pytest.mark.parametrize("arch, n_kv_head, kw", [("llama", 4, {}), ("llama", 2, {}), ("gpt2", 4, {}),
                                                 ("llama", 2, KNOBS), ("gpt2", 4, KNOBS)])
def test_kv_cache_matches_full_forward(arch, n_kv_head, kw):
    m = make(arch, n_kv_head=n_kv_head, scramble=0.1, **kw)
    x = tokens(2, 16)
    full = m(x)
    cache = KVCache(m.config, batch_size=2, max_len=16)
    with torch.no_grad():
        parts = [m(x[:, :5], cache=cache, pos=0),           # prefill
                 m(x[:, 5:9], cache=cache, pos=5)]          # a chunk after a prefix: explicit mask
        parts += [m(x[:, p:p + 1], cache=cache, pos=p) for p in range(9, 16)]  # one token at a time
    torch.testing.assert_close(torch.cat(parts, dim=1), full, atol=1e-5, rtol=0)
    with pytest.raises(ValueError):
        m(x[:, :2], cache=cache, pos=15)                    # past the cache


@pytest.mark.parametrize("arch, kw", [("llama", {}), ("gpt2", {}), ("llama", KNOBS)])
def test_loss_reductions_match_cross_entropy(arch, kw):
    m = make(arch, scramble=0.05, **kw)
    x, y = tokens(3, 12), tokens(3, 12, seed=5)
    y[0, :4] = -100
    y[2, 7] = -100
    logits = m(x).double()
    ref_none = F.cross_entropy(logits.reshape(-1, V), y.reshape(-1), ignore_index=-100, reduction="none").view(3, 12)
    keep = y != -100
    none = m(x, y, reduction="none")
    assert none.shape == (3, 12) and none.dtype == torch.float32
    assert (none[~keep] == 0).all()
    torch.testing.assert_close(none.double(), ref_none, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(m(x, y, reduction="sum").double(), ref_none.sum(), atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(m(x, y).double(), ref_none.sum() / keep.sum(), atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="reduction"):
        m(x, y, reduction="max")


@pytest.mark.parametrize("arch", ARCHS)
def test_softcapped_logits_and_loss(arch):
    """logit_softcap c: the logits are c·tanh(raw / c) of the same model's uncapped ones, and every loss and
    log-probability path (plain, per-token chunked, stats) is the cross-entropy of those, in float64."""
    raw = make(arch, scramble=0.3).double()
    capped = copy.deepcopy(raw)
    capped.config = dataclasses.replace(raw.config, logit_softcap=2.0)
    x, y = tokens(2, 10), tokens(2, 10, seed=4)
    y[1, :3] = -100
    want_logits = 2.0 * torch.tanh(raw(x) / 2.0)
    assert raw(x).abs().max() > 4  # the cap bends these logits a lot
    torch.testing.assert_close(capped(x), want_logits, rtol=1e-12, atol=1e-12)
    want = F.cross_entropy(want_logits.reshape(-1, V), y.reshape(-1), reduction="none").view(2, 10)
    torch.testing.assert_close(capped(x, y, reduction="none"), want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(capped(x, y), want.sum() / (y != -100).sum(), rtol=1e-12, atol=1e-12)
    stats = capped(x, y, stats=True)
    torch.testing.assert_close(stats.logp, -want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(stats.hit, (want_logits.argmax(-1) == y) & (y != -100))


def test_qk_norm_makes_attention_scale_free():
    """QK-norm divides each head's queries and keys by their RMS: scaling q_proj and k_proj changes nothing,
    where without it the attention logits grow with them."""
    x = tokens(2, 12)
    for qk_norm in (True, False):
        m = make(qk_norm=qk_norm, scramble=0.1)
        before = m(x)
        with torch.no_grad():
            for block in m.blocks:
                block.attn.q_proj.weight.mul_(7.0)
                block.attn.k_proj.weight.mul_(0.2)
        moved = (m(x) - before).abs().max().item()
        assert moved < 1e-3 if qk_norm else moved > 0.1  # (RMSNorm's eps: not exactly invariant)


def test_relu2_mlp():
    m = make(mlp="relu2", scramble=0.1)
    mlp = m.blocks[0].mlp
    assert mlp.gate_proj is None and mlp.up_proj.out_features == 4 * m.config.d_model
    h = torch.randn(3, 5, m.config.d_model)
    want = mlp.down_proj(torch.clamp(mlp.up_proj(h), min=0) ** 2)
    torch.testing.assert_close(mlp(h), want)


def test_loss_is_float32_under_autocast():
    m = make()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = m(tokens(2, 8), tokens(2, 8, seed=3))
    assert loss.dtype == torch.float32 and math.isfinite(loss.item())


# --- size, FLOPs, init ----------------------------------------------------------------------------------

def hand_count(c: ModelConfig) -> tuple[int, int]:
    """(total, embedding) parameters from the architecture's shapes."""
    d, f, L, kv = c.d_model, c.ffn_dim, c.n_layer, c.n_kv_head * c.head_dim
    emb = c.padded_vocab_size * d
    qk = 2 * c.head_dim if c.qk_norm else 0  # a gain per head channel for queries and keys
    if c.arch == "llama":
        mlp = (3 if c.mlp == "auto" else 2) * d * f  # gate/up/down, or up/down
        per_layer = d * d + 2 * d * kv + d * d + mlp + 2 * d + qk      # q, k, v, o, MLP, 2 RMSNorms
        total = emb + L * per_layer + d + (0 if c.tie_embeddings else emb)
    else:
        emb += c.max_seq_len * d
        per_layer = (d * d + d) * 4 + (d * f + f) + (f * d + d) + 2 * 2 * d + qk  # biased attn, MLP, 2 LayerNorms
        total = emb + L * per_layer + 2 * d
    return total, emb


@pytest.mark.parametrize("arch, kw", [("llama", {}), ("llama", dict(n_kv_head=2, tie_embeddings=False)),
                                      ("gpt2", {}), ("llama", KNOBS), ("gpt2", KNOBS)])
def test_num_params_and_flops(arch, kw):
    m = make(arch, **kw)
    c = m.config
    total, emb = hand_count(c)
    assert m.num_params() == total == c.num_params()
    assert m.num_params() == len(torch.nn.utils.parameters_to_vector(m.parameters()))
    assert m.num_params(embeddings=False) == total - emb
    head = c.d_model * c.padded_vocab_size if c.tie_embeddings else 0  # an untied head is already in N
    n = total - emb + head
    assert m.flops_per_token() == 6 * n + 12 * c.n_layer * c.d_model * c.max_seq_len
    assert m.flops_per_token(seq_len=16) == 6 * n + 12 * c.n_layer * c.d_model * 16


@pytest.mark.parametrize("arch", ARCHS)
def test_init(arch):
    torch.manual_seed(0)
    m = GPT(ModelConfig(vocab_size=V, n_layer=8, n_head=4, n_kv_head=4, d_model=256, arch=arch))
    resid = 0.02 / math.sqrt(2 * 8)
    for name, p in m.named_parameters():
        if name.endswith(("attn.o_proj.weight", "mlp.down_proj.weight")):
            assert p.std().item() == pytest.approx(resid, rel=0.05), name
        elif "norm" in name and name.endswith("weight"):
            assert (p == 1).all(), name
        elif name.endswith("bias"):
            assert (p == 0).all(), name
        else:
            assert p.std().item() == pytest.approx(0.02, rel=0.05), name


def test_zero_init():
    """zero_init: the residual projections start at zero, so at init every block is the identity and the logits
    are the head's reading of the normed embeddings."""
    m = make(zero_init=True)
    x = tokens(2, 8)
    for name, p in m.named_parameters():
        if name.endswith(("attn.o_proj.weight", "mlp.down_proj.weight")):
            assert (p == 0).all(), name
    torch.testing.assert_close(m(x), m.lm_head(m.norm(m.tok_emb(x)))[..., :V])
    m.train()
    m(x, tokens(2, 8, seed=2)).backward()  # their inputs are not zero: they leave zero at the first step
    assert m.blocks[0].attn.o_proj.weight.grad.abs().sum() > 0


def test_overfits_one_batch():
    torch.manual_seed(0)
    m = GPT(cfg(max_seq_len=32)).train()
    x = tokens(4, 32, seed=7)
    y = tokens(4, 32, seed=8)
    opt = torch.optim.AdamW(m.parameters(), lr=3e-3, weight_decay=0.0)
    for _ in range(150):
        loss = m(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    assert loss.item() < 0.1


@pytest.mark.parametrize("arch", ARCHS)
def test_no_graph_breaks(arch):
    m = make(arch, n_kv_head=2 if arch == "llama" else 4).train()
    x, y = tokens(2, 16), tokens(2, 16, seed=2)
    explained = torch._dynamo.explain(m)(x, y)
    assert explained.graph_break_count == 0, explained.break_reasons


# --- checkpoints ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("arch, kw", [("llama", dict(n_kv_head=2)), ("llama", dict(tie_embeddings=False)),
                                      ("gpt2", {})])
def test_checkpoint_round_trip(tmp_path, arch, kw):
    m = make(arch, scramble=0.05, **kw)
    out = save_model(m, m.config, tmp_path / "base", {"tokenizer_sha256": "ab" * 32})
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    assert json.loads((out / "config.json").read_text()) == {"model": m.config.to_dict(),
                                                            "tokenizer_sha256": "ab" * 32}
    with safe_open(out / "model.safetensors", "pt") as f:
        assert ("lm_head.weight" in f.keys()) == (not m.config.tie_embeddings)
    loaded, meta = load_model(out)
    assert meta == {"tokenizer_sha256": "ab" * 32} and loaded.config == m.config
    assert load_config(out) == (m.config, meta)
    a, b = m.state_dict(), loaded.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    if m.config.tie_embeddings:
        assert loaded.lm_head.weight is loaded.tok_emb.weight
    x = tokens(2, 12)
    assert torch.equal(m(x), loaded(x))


def test_checkpoint_from_wrapped_state_dict(tmp_path):
    """torch.compile (and DDP) prefix names; a state dict from either saves under the plain names."""
    m = make()
    sd = {f"_orig_mod.{k}": v for k, v in m.state_dict().items()}
    loaded, _ = load_model(save_model(sd, m.config, tmp_path / "m", {}))
    assert torch.equal(loaded.tok_emb.weight, m.tok_emb.weight)


def test_checkpoint_save_refuses_wrong_shapes(tmp_path):
    m = make()
    with pytest.raises(ValueError, match="shapes"):
        save_model(m, cfg(d_ff=128), tmp_path / "m", {})
    assert list(tmp_path.iterdir()) == []


def test_checkpoint_bad_files(tmp_path):
    m = make()
    out = save_model(m, m.config, tmp_path / "m", {})
    weights = (out / "model.safetensors").read_bytes()

    (out / "model.safetensors").write_bytes(weights[: len(weights) // 2])
    with pytest.raises(ValueError, match="model.safetensors"):
        load_model(out)
    (out / "model.safetensors").write_bytes(b"\x00" * 64)
    with pytest.raises(ValueError, match="model.safetensors"):
        load_model(out)
    (out / "model.safetensors").unlink()
    with pytest.raises(ValueError, match="model.safetensors"):
        load_model(out)

    (out / "model.safetensors").write_bytes(weights)
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "model": {**config["model"], "d_ff": 128}}))
    with pytest.raises(ValueError, match="model.safetensors.*shapes"):
        load_model(out)
    (out / "config.json").write_text(json.dumps({**config, "model": {**config["model"], "n_head": 5}}))
    with pytest.raises(ValueError, match="config.json: model.n_head"):
        load_model(out)
    (out / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="config.json"):
        load_model(out)
    (out / "config.json").unlink()
    with pytest.raises(ValueError, match="config.json"):
        load_model(out)


@pytest.mark.parametrize("fail_in", ["save_file", "json"])
def test_failed_save_keeps_previous_checkpoint(tmp_path, monkeypatch, fail_in):
    old = make(seed=0)
    out = save_model(old, old.config, tmp_path / "m", {"run": 1})

    def boom(*args, **kwargs):
        raise OSError("disk full")

    if fail_in == "save_file":
        monkeypatch.setattr(kiln.model.checkpoint, "save_file", boom)
    else:
        monkeypatch.setattr(kiln.model.atomic, "fsync_tree", boom)  # after both files are written, before rename
    new = make(seed=1)
    with pytest.raises(OSError, match="disk full"):
        save_model(new, new.config, out, {"run": 2})
    assert [p.name for p in tmp_path.iterdir()] == ["m"]
    loaded, meta = load_model(out)
    assert meta == {"run": 1} and torch.equal(loaded.tok_emb.weight, old.tok_emb.weight)


def test_save_replaces_previous_checkpoint(tmp_path):
    first, second = make(seed=0), make(seed=1)
    save_model(first, first.config, tmp_path / "m", {"run": 1})
    save_model(second, second.config, tmp_path / "m", {"run": 2})
    assert [p.name for p in tmp_path.iterdir()] == ["m"]
    loaded, meta = load_model(tmp_path / "m")
    assert meta == {"run": 2} and torch.equal(loaded.tok_emb.weight, second.tok_emb.weight)


# --- generation -----------------------------------------------------------------------------------------

def argmax_loop(m: GPT, prompt: list[int], n: int) -> list[int]:
    """Greedy decoding the slow way: a full forward over the whole sequence for every new token."""
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            seq.append(int(m(torch.tensor([seq]))[0, -1].argmax()))
    return seq[len(prompt):]


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_matches_no_cache_loop(arch):
    m = make(arch, scramble=0.3)
    prompt = tokens(1, 7)[0].tolist()
    want = argmax_loop(m, prompt, 12)
    assert len(set(want)) > 3  # the scrambled model does not just repeat itself
    assert generate(m, [prompt], 12, temperature=0) == [want]
    assert generate(m, [prompt], 12, top_k=1, seed=3) == [want]
    assert generate(m, [prompt], 12, top_p=1e-6, seed=3) == [want]


def test_seeded_sampling_is_reproducible():
    m = make(scramble=0.05)
    prompts = [[1, 2, 3], [4, 5, 6], [7, 8]]
    a = generate(m, prompts, 10, temperature=1.0, top_k=50, top_p=0.9, seed=123)
    b = generate(m, prompts, 10, temperature=1.0, top_k=50, top_p=0.9, seed=123)
    assert a == b and all(len(row) == 10 for row in a)
    assert all(0 <= t < V for row in a for t in row)


def test_stop_ids_end_generation():
    m = make(scramble=0.3)
    prompt = tokens(1, 5)[0].tolist()
    free = generate(m, [prompt], 12, temperature=0)[0]
    stop = free[4]
    first = free.index(stop)
    assert generate(m, [prompt], 12, temperature=0, stop_ids=[stop]) == [free[:first + 1]]  # stop id kept
    assert generate(m, [prompt], 0) == [[]]


@pytest.mark.parametrize("arch, n_kv_head", [("llama", 4), ("llama", 2), ("gpt2", 4)])
def test_left_padded_rows_compute_what_they_would_alone(arch, n_kv_head):
    """Each row of a left-padded batch, with and without a cache, gives the logits of that row run by itself."""
    m = make(arch, n_kv_head=n_kv_head, scramble=0.1).double()
    rows = [tokens(1, n, seed=n)[0] for n in (9, 4, 1, 7)]
    L = max(len(r) for r in rows)
    pad = torch.tensor([L - len(r) for r in rows])
    x = torch.stack([torch.cat([torch.full((L - len(r),), 5), r]) for r in rows])
    with torch.no_grad():
        full = m(x, pad=pad)
        cache = KVCache(m.config, batch_size=len(rows), max_len=L + 3, dtype=torch.float64)
        m(x, cache=cache, pos=0, pad=pad)
        step = torch.tensor([[3], [1], [4], [1]])
        stepped = m(step, cache=cache, pos=L, pad=pad)[:, 0]
        for i, r in enumerate(rows):
            alone = m(r[None])[0]
            torch.testing.assert_close(full[i, pad[i]:], alone, atol=1e-10, rtol=0)
            torch.testing.assert_close(stepped[i], m(torch.cat([r, step[i]])[None])[0, -1], atol=1e-10, rtol=0)
        assert torch.isfinite(full).all()  # padding queries see their own slot: no NaN anywhere
    with pytest.raises(ValueError, match="pad"):
        m(x, pad=pad[:2])


@pytest.mark.parametrize("arch, n_kv_head", [("llama", 2), ("gpt2", 4)])
def test_cached_generation_equals_uncached(arch, n_kv_head):
    m = make(arch, n_kv_head=n_kv_head, scramble=0.3).double()
    one = [tokens(1, 6)[0].tolist()]
    mixed = [tokens(1, n, seed=n)[0].tolist() for n in (3, 11, 1, 6, 3)]
    for prompts in (one, mixed):
        cached = generate(m, prompts, 10, temperature=0)
        assert cached == generate(m, prompts, 10, temperature=0, cache=False)
        assert cached == [argmax_loop(m, p, 10) for p in prompts]
        assert len({t for row in cached for t in row}) > 5  # not one repeated token


def test_mixed_prompt_lengths_match_one_at_a_time():
    m = make(scramble=0.3)
    prompts = [tokens(1, n, seed=n)[0].tolist() for n in (3, 9, 3, 1, 6)]
    together = generate(m, prompts, 8, temperature=0)
    assert together == [generate(m, [p], 8, temperature=0)[0] for p in prompts]
    assert together == [argmax_loop(m, p, 8) for p in prompts]


def test_generate_checks_args_and_restores_mode():
    m = make()
    m.train()
    generate(m, [[1, 2]], 3)
    assert m.training
    with pytest.raises(ValueError, match="max_seq_len"):
        generate(m, [[1] * 60], 10)
    with pytest.raises(ValueError, match=r"prompt_ids\[1\]"):
        generate(m, [[1], []], 3)
    with pytest.raises(ValueError, match=r"prompt_ids\[0\]"):
        generate(m, [[V]], 3)
    with pytest.raises(ValueError, match="top_p"):
        generate(m, [[1]], 3, top_p=0)


@pytest.mark.parametrize("arch, kw", [("llama", {"n_kv_head": 1}), ("gpt2", {"n_kv_head": 2}),
                                      ("llama", {"n_kv_head": 1, **KNOBS, "zero_init": False, "mlp": "auto"}), ("gpt2", {"n_kv_head": 2, **KNOBS})])
def test_triton_kernels_match_torch(arch, kw):
    """set_kernels("triton") (natively on a GPU, in the interpreter on a CPU) computes the same loss and gradients
    as plain torch on the same device."""
    torch.manual_seed(0)
    config = ModelConfig(vocab_size=100, n_layer=2, n_head=2, d_model=32, max_seq_len=17, arch=arch, **kw)
    plain = GPT(config).to(DEVICE)
    fused = copy.deepcopy(plain).set_kernels("triton")
    x, y = torch.randint(0, 100, (2, 2, 17)).to(DEVICE)
    y[0, :3] = -100
    for model in (plain, fused):
        model(x, y).backward()
    assert fused(x, y).item() == pytest.approx(plain(x, y).item(), abs=1e-5)
    for (name, p), q in zip(plain.named_parameters(), fused.parameters()):
        torch.testing.assert_close(q.grad, p.grad, atol=1e-5, rtol=1e-4, msg=lambda m: f"{name}: {m}")
    per_token = fused(x, y, reduction="none")
    torch.testing.assert_close(per_token, plain(x, y, reduction="none"), atol=1e-5, rtol=1e-4)
    with pytest.raises(ValueError, match="kernels"):
        plain.set_kernels("cuda")


def test_kernels_for_some_ops_only():
    """set_kernels(backend, ops) gives `backend` to the named ops alone (the rest run torch's), so a benchmark
    can split a step's time by op; the loss is the same whichever ops run kiln's kernels."""
    from kiln.model.gpt import KERNEL_OPS, MLP, Attention, RMSNorm

    torch.manual_seed(0)
    config = ModelConfig(vocab_size=100, n_layer=1, n_head=2, n_kv_head=2, d_model=32, max_seq_len=17)
    plain = GPT(config).to(DEVICE)
    x, y = torch.randint(0, 100, (2, 2, 17)).to(DEVICE)
    want = plain(x, y).item()
    for ops in (("head",), ("attention", "norm")):
        model = copy.deepcopy(plain).set_kernels("triton", ops)
        kinds = {Attention: "attention", MLP: "mlp", RMSNorm: "norm", GPT: "head"}
        backends = {kinds[type(m)]: m.backend for m in model.modules() if type(m) in kinds}
        assert backends == {op: "triton" if op in ops else "torch" for op in KERNEL_OPS}
        assert model(x, y).item() == pytest.approx(want, abs=1e-5)
    with pytest.raises(ValueError, match="kernel ops: softmax not among norm, mlp, attention, head"):
        plain.set_kernels("triton", ("softmax",))


# --- packed documents (segments, train.doc_mask) ----------------------------------------------------------------

@pytest.mark.parametrize("arch, kw, kernels", [("llama", {"n_kv_head": 2}, "torch"), ("gpt2", {}, "torch"),
                                               ("llama", {"n_kv_head": 2, **KNOBS}, "torch"),
                                               ("llama", {"n_kv_head": 2}, "triton")])
def test_packed_documents_compute_what_each_document_does_alone(arch, kw, kernels, monkeypatch):
    """A row of several documents with `segments`: every document's logits, losses and gradients (float64) are
    those of one forward of it alone, on the torch path and through kiln's kernels (the flash kernel's segment
    ids, in the interpreter on a CPU, whose softmaxes run in fp32 whatever the inputs: to 1e-5, as test_triton_kernels_match_torch)."""
    tol = dict(rtol=1e-10, atol=1e-10)
    if kernels == "triton":
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        tol = dict(rtol=1e-4, atol=1e-5)
    model = make(arch, scramble=0.1, **kw).double().set_kernels(kernels)
    x, y = tokens(2, 24), tokens(2, 24, seed=7)
    starts = [[0, 5, 13, 14], [0, 20]]  # documents of 5, 8, 1 and 10 tokens; of 20 and 4
    segments = torch.zeros(2, 24, dtype=torch.int64)
    for b, row in enumerate(starts):
        for i, s in enumerate(row):
            segments[b, s:] = i
    packed = copy.deepcopy(model)
    logits = packed(x, packed=Packed(segments))
    loss = packed(x, y, reduction="sum", packed=Packed(segments))
    loss.backward()
    alone_loss = 0.0
    for b, row in enumerate(starts):
        for lo, hi in zip(row, [*row[1:], 24]):
            torch.testing.assert_close(logits[b, lo:hi], model(x[b:b + 1, lo:hi])[0], **tol)
            alone_loss = alone_loss + model(x[b:b + 1, lo:hi], y[b:b + 1, lo:hi], reduction="sum")
    alone_loss.backward()
    torch.testing.assert_close(loss, alone_loss, **tol)
    for (name, p), q in zip(model.named_parameters(), packed.parameters()):
        torch.testing.assert_close(q.grad, p.grad, **tol, msg=lambda m: f"{name}: {m}")
    with pytest.raises(ValueError, match="packed.segments"):
        packed(x, packed=Packed(segments[:, :5]))


@pytest.mark.parametrize("arch, kw, kernels", [("llama", {"n_kv_head": 2, **KNOBS}, "torch"), ("gpt2", {}, "torch"),
                                               ("llama", {"n_kv_head": 2}, "triton")])
def test_shared_prompts_compute_what_each_prompt_and_answer_do_alone(arch, kw, kernels, monkeypatch):
    """Rows holding a prompt once and the answers that follow it (`Packed.shares`), beside a sequence that shares
    nothing and padding: each answer's logits and losses, and every gradient (float64), are those of its prompt
    and itself in a row alone, the prompt's own counted once. Kiln's kernels take this mask through SDPA."""
    tol = dict(rtol=1e-10, atol=1e-10)
    if kernels == "triton":
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        tol = dict(rtol=1e-4, atol=1e-5)
    model = make(arch, scramble=0.1, **kw).double().set_kernels(kernels)
    T = 40  # longer than max_seq_len (32): a packed row may be, its positions stay below it
    x, y = tokens(2, T), tokens(2, T, seed=7)
    # (start, end, the piece it shares): row 0 a prompt of 9, its answers of 7, 1 and 12, then pads; row 1 a
    # sequence alone, then a prompt of 6 and its answers of 5 and 4, then pads
    pieces = [[(0, 9, 0), (9, 16, 0), (16, 17, 0), (17, 29, 0), (29, T, 4)],
              [(0, 11, 0), (11, 17, 1), (17, 22, 1), (22, 26, 1), (26, T, 4)]]
    segments, shares = torch.zeros(2, T, dtype=torch.int64), torch.zeros(2, T, dtype=torch.int64)
    for b, row in enumerate(pieces):
        for i, (lo, hi, shared) in enumerate(row):
            segments[b, lo:hi], shares[b, lo:hi] = i, shared
        y[b, row[-1][0]:] = -100
    layout = Packed(segments, shares)
    got = copy.deepcopy(model)
    logits = got(x, packed=layout)
    loss = got(x, y, reduction="sum", packed=layout)
    loss.backward()
    alone_loss = 0.0
    for b, row in enumerate(pieces):
        for i, (lo, hi, shared) in enumerate(row[:-1]):
            p_lo, p_hi = (row[shared][0], row[shared][1]) if shared != i else (lo, lo)
            idx = torch.cat([x[b, p_lo:p_hi], x[b, lo:hi]])[None]
            tgt = torch.cat([torch.full((p_hi - p_lo,), -100), y[b, lo:hi]])[None]
            torch.testing.assert_close(logits[b, lo:hi], model(idx)[0, p_hi - p_lo:], **tol)
            alone_loss = alone_loss + model(idx, tgt, reduction="sum")
    alone_loss.backward()
    torch.testing.assert_close(loss, alone_loss, **tol)
    for (name, p), q in zip(model.named_parameters(), got.parameters()):
        torch.testing.assert_close(q.grad, p.grad, **tol, msg=lambda m: f"{name}: {m}")
