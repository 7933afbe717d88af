"""model.norm: the arch's own norm, either norm on either arch, and Dynamic Tanh."""

import pytest
import torch

from kiln.model.config import ModelConfig
from kiln.model.gpt import GPT
from kiln.model.gpt import DyT
from kiln.model.hf import hf_config


def test_dyt_forward_and_backward_match_a_float64_reference():
    torch.manual_seed(0)
    for shape in [(3, 5, 48), (1, 1, 7), (2, 130)]:
        norm = DyT(shape[-1])
        with torch.no_grad():  # away from the init so every parameter matters
            norm.alpha.fill_(0.8)
            norm.weight.normal_()
            norm.bias.normal_()
        x = (3 * torch.randn(shape)).requires_grad_()
        y = norm(x)
        g = torch.randn(shape)
        y.backward(g)
        ref = {k: v.detach().double().requires_grad_() for k, v in
               [("x", x), ("alpha", norm.alpha), ("weight", norm.weight), ("bias", norm.bias)]}
        want = torch.tanh(ref["alpha"] * ref["x"]) * ref["weight"] + ref["bias"]
        want.backward(g.double())
        assert torch.allclose(y.double(), want, atol=1e-6)
        for name, got in [("x", x.grad), ("alpha", norm.alpha.grad), ("weight", norm.weight.grad),
                          ("bias", norm.bias.grad)]:
            assert torch.allclose(got.double(), ref[name].grad, rtol=1e-5, atol=1e-5), (shape, name)


def test_dyt_starts_at_the_papers_init():
    norm = DyT(4)
    assert norm.alpha.item() == 0.5 and (norm.weight == 1).all() and (norm.bias == 0).all()


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
@pytest.mark.parametrize("norm", ["auto", "rmsnorm", "layernorm", "dyt"])
def test_every_norm_builds_counts_and_learns(arch, norm):
    config = ModelConfig(vocab_size=64, n_layer=2, n_head=2, n_kv_head=2, d_model=16, max_seq_len=8, arch=arch,
                         norm=norm)
    torch.manual_seed(0)
    model = GPT(config)
    kind = {"auto": "rmsnorm" if arch == "llama" else "layernorm"}.get(norm, norm)
    want = {"rmsnorm": torch.nn.RMSNorm, "layernorm": torch.nn.LayerNorm, "dyt": DyT}[kind]
    assert all(isinstance(m, want) for m in (model.norm, *(b.attn_norm for b in model.blocks)))
    assert model.num_params() == config.num_params()
    # DyT does not rescale its input: the embeddings get the authors' learnable sqrt(d_model) scale
    assert (model.emb_scale is not None) == (kind == "dyt")
    if kind == "dyt":
        assert model.emb_scale.item() == pytest.approx(16 ** 0.5)
    x = torch.randint(0, 64, (4, 8))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    first = None
    for _ in range(40):
        loss = model(x, x)
        first = first if first is not None else loss.item()
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < first - 1.0


def test_an_unknown_norm_is_refused():
    with pytest.raises(ValueError, match="norm: 'batchnorm'"):
        ModelConfig(vocab_size=64, norm="batchnorm").check()


def test_only_the_archs_own_norm_exports_to_hf():
    special = {"bos_token_id": None, "eos_token_id": None, "pad_token_id": None}
    assert hf_config(ModelConfig(vocab_size=64, norm="rmsnorm"), special)["model_type"] == "llama"
    for arch, norm in [("llama", "dyt"), ("llama", "layernorm"), ("gpt2", "rmsnorm"), ("gpt2", "dyt")]:
        with pytest.raises(ValueError, match=f"model.norm={norm}: HF's {arch} model has only"):
            hf_config(ModelConfig(vocab_size=64, arch=arch, norm=norm), special)
