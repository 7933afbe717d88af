"""Per-token log-probabilities a chunk at a time (model/logprobs.py, GPT.forward's reduction "none" and stats):
values and gradients against a float64 computation from full logits, on awkward shapes, and a memory guard that
sees no (tokens x vocab) tensor in forward or backward, though it does see one in the old full-logits path."""

import pytest
import torch
import torch.nn.functional as F

import kiln.model.logprobs as logprobs
from kiln.model.config import ModelConfig
from kiln.model.gpt import GPT
from kiln.model.logprobs import token_logprobs
from tests.test_kernel_linear_cross_entropy import LargestTensor


def inputs(n, v, d, seed=0, ignored=3):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, d, generator=g, dtype=torch.float64)
    weight = torch.randn(v, d, generator=g, dtype=torch.float64) * 0.5
    targets = torch.randint(0, v, (n,), generator=g)
    targets[torch.randperm(n, generator=g)[:ignored]] = -100
    return hidden, weight, targets


def full(hidden, weight, targets, temperature):
    logp = (hidden @ weight.T / temperature).log_softmax(-1)
    picked = logp.gather(-1, targets.clamp(min=0)[:, None])[:, 0] * (targets != -100)
    # an ignored position is never computed: entropy 0 there
    return picked, -(logp.exp() * logp).sum(-1) * (targets != -100), logp.argmax(-1) == targets


@pytest.mark.parametrize(("n", "v", "d", "chunk", "temperature"), [
    (37, 101, 8, 5, 1.0), (37, 101, 8, 1, 0.7), (64, 130, 16, None, 1.3), (3, 7, 4, 10, 1.0)])
def test_values_and_gradients_match_full_logits(n, v, d, chunk, temperature):
    hidden, weight, targets = inputs(n, v, d)
    g = torch.Generator().manual_seed(1)
    upstream = [torch.randn(n, generator=g, dtype=torch.float64) for _ in range(2)]
    grads = []
    for fn in (lambda h, w: token_logprobs(h, w, targets, temperature, stats=True, chunk_size=chunk),
               lambda h, w: full(h, w, targets, temperature)):
        h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        logp, entropy, hit = fn(h, w)
        ((logp * upstream[0]).sum() + (entropy * upstream[1]).sum()).backward()
        grads.append((logp.detach(), entropy.detach(), hit, h.grad, w.grad))
    for ours, want in zip(*grads):
        if ours.dtype == torch.bool:
            assert torch.equal(ours, want)
        else:
            torch.testing.assert_close(ours, want, rtol=1e-10, atol=1e-12)
    assert (grads[0][0][targets == -100] == 0).all() and not grads[0][2][targets == -100].any()



def test_frozen_head_no_grad_and_autocast():
    """A frozen head (LoRA, QLoRA) gets no gradient while hidden does; without grad the chunks run plainly and give
    the same values; under bf16 autocast the log-softmax is still float32 (bf16 only in the matmul: 0.01 off)."""
    hidden, weight, targets = inputs(50, 130, 8)
    h = hidden.clone().requires_grad_(True)
    token_logprobs(h, weight, targets, 0.9, chunk_size=7).sum().backward()
    want = hidden.clone().requires_grad_(True)
    full(want, weight, targets, 0.9)[0].sum().backward()
    torch.testing.assert_close(h.grad, want.grad, rtol=1e-10, atol=1e-12)
    with torch.no_grad():
        torch.testing.assert_close(token_logprobs(hidden, weight, targets, 0.9, chunk_size=7),
                                   full(hidden, weight, targets, 0.9)[0], rtol=1e-10, atol=1e-12)
    with torch.autocast("cpu", torch.bfloat16):
        logp = token_logprobs(hidden.float().requires_grad_(True), weight.float(), targets, chunk_size=7)
    assert logp.dtype == torch.float32
    torch.testing.assert_close(logp.double(), full(hidden, weight, targets, 1.0)[0], rtol=0, atol=0.05)

def tiny_model() -> GPT:
    torch.manual_seed(0)
    return GPT(ModelConfig(vocab_size=500, n_layer=1, n_head=2, n_kv_head=1, d_model=16, max_seq_len=64)).double()


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_forward_modes_equal_the_full_logits(dtype):
    """As the old code computed them (float32: GRPO's and evaluation's log-softmax of the logits), to rounding."""
    model = tiny_model().to(dtype)
    x, y = torch.randint(0, 500, (3, 40)), torch.randint(0, 500, (3, 40))
    y[1, :7] = -100
    logits = model(x)
    want = F.cross_entropy(logits.reshape(-1, 500), y.reshape(-1), reduction="none").view(3, 40)
    torch.testing.assert_close(model(x, y, reduction="none"), want)
    stats = model(x, y, temperature=0.8, stats=True)
    ref = (logits / 0.8).log_softmax(-1)
    torch.testing.assert_close(stats.logp, ref.gather(-1, y.clamp(min=0)[..., None])[..., 0] * (y != -100))
    torch.testing.assert_close(stats.entropy, -(ref.exp() * ref).sum(-1) * (y != -100))
    assert torch.equal(stats.hit, ref.argmax(-1) == y)


@pytest.mark.parametrize("mode", [{"reduction": "none"}, {"stats": True, "temperature": 0.7}])
def test_no_tokens_by_vocab_tensor_in_forward_or_backward(monkeypatch, mode):
    monkeypatch.setattr(logprobs, "CHUNK_ELEMENTS", 16 * 500)  # 16 rows a chunk; 120 tokens here
    model = tiny_model().float()
    x, y = torch.randint(0, 500, (3, 40)), torch.randint(0, 500, (3, 40))
    with LargestTensor() as largest:
        out = model(x, y, **mode)
        (out if mode.get("reduction") else out.logp).sum().backward()
    n_by_v = 4 * 120 * 500
    assert largest.bytes < n_by_v and largest.bytes <= 4 * max(16 * 500, 512 * 16)
    with LargestTensor() as old:  # the guard sees the full-logits path
        F.cross_entropy(model(x).reshape(-1, 500), y.reshape(-1), reduction="none").sum().backward()
    assert old.bytes >= n_by_v


@pytest.mark.parametrize("mode", [{"reduction": "none"}, {"stats": True, "temperature": 0.7}])
def test_compiles_in_one_graph(mode):
    model = tiny_model().float().train()
    x, y = torch.randint(0, 500, (2, 20)), torch.randint(0, 500, (2, 20))
    explained = torch._dynamo.explain(model)(x, y, **mode)
    assert explained.graph_break_count == 0, explained.break_reasons
