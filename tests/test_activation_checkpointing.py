import pytest
import torch

from kiln.model.config import ModelConfig
from kiln.model.gpt import GPT, KVCache


def saved_bytes(model, x):
    """Bytes the autograd graph holds for the backward after a forward (each storage once)."""
    seen = {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(x, x)
    return loss, sum(seen.values())


@pytest.mark.parametrize("arch,dropout", [("llama", 0.0), ("llama", 0.2), ("gpt2", 0.1)])
def test_recomputed_blocks_give_the_same_loss_and_gradients(arch, dropout):
    config = ModelConfig(vocab_size=96, n_layer=3, n_head=4, n_kv_head=2 if arch == "llama" else 4, d_model=32,
                         max_seq_len=24, arch=arch, dropout=dropout)
    torch.manual_seed(0)
    plain = GPT(config).train()
    recomputed = GPT(config).train().set_checkpointing(True)
    recomputed.load_state_dict(plain.state_dict())
    x = torch.randint(0, 96, (3, 24))
    results = []
    for model in (plain, recomputed):
        torch.manual_seed(1)  # the same dropout masks: the recompute replays the RNG
        loss, held = saved_bytes(model, x)
        loss.backward()
        results.append((loss, held, {n: p.grad for n, p in model.named_parameters()}))
    (loss_a, held_a, grads_a), (loss_b, held_b, grads_b) = results
    assert abs(loss_a.item() - loss_b.item()) <= 1e-6
    for name, g in grads_a.items():
        assert (g - grads_b[name]).abs().max() <= 1e-6, name
    assert held_b < 0.6 * held_a  # only each block's input kept, not its attention and MLP activations


def test_no_recompute_without_gradients_or_with_a_cache(monkeypatch):
    calls = []
    real = torch.utils.checkpoint.checkpoint
    monkeypatch.setattr(torch.utils.checkpoint, "checkpoint", lambda *a, **k: calls.append(1) or real(*a, **k))
    config = ModelConfig(vocab_size=64, n_layer=2, n_head=2, n_kv_head=2, d_model=16, max_seq_len=8)
    model = GPT(config).set_checkpointing(True)
    x = torch.randint(0, 64, (1, 8))
    with torch.no_grad():
        logits = model(x)
    cache = KVCache(config, 1, 8)
    model(x, cache=cache)  # generation with a cache, gradients on: nothing to recompute for
    assert logits.shape == (1, 8, 64) and not calls
    model(x, x).backward()
    assert len(calls) == 2  # one per block when training


def test_the_train_param_recomputes_in_the_stage_and_trains_the_same_weights(tiny, tmp_path, monkeypatch):
    from tests.test_train import run

    calls = []
    real = torch.utils.checkpoint.checkpoint
    monkeypatch.setattr(torch.utils.checkpoint, "checkpoint", lambda *a, **k: calls.append(1) or real(*a, **k))
    _, plain = run(tiny, tmp_path / "a", max_steps=4)
    assert not calls
    _, recomputed = run(tiny, tmp_path / "b", max_steps=4, activation_checkpointing=True)
    assert calls
    for name, tensor in plain.items():
        assert (tensor - recomputed[name]).abs().max() <= 1e-6, name
