"""train.stats_every: per-layer statistics from hooks, against the same quantities computed by hand."""

import contextlib
import copy
import math

import torch

from kiln.model.config import ModelConfig
from kiln.model.gpt import GPT
from kiln.model.gpt import apply_rope
from kiln.pipeline.config import build_section
from kiln.pipeline.train.curves import metric_files
from kiln.pipeline.train.lm import lm_loss
from kiln.pipeline.train.loop import Step, build_optimizer, train
from kiln.pipeline.train.params import TrainParams
from kiln.pipeline.train.stats import StepStats
from tests.test_train import loop_run, run

CONFIG = ModelConfig(vocab_size=64, n_layer=2, n_head=4, n_kv_head=2, d_model=32, max_seq_len=16)


def one_step(model, batch, stats=None):
    params = build_section(TrainParams, {"lr": 0.01, "device": "cpu", "grad_clip": 0.0})
    device = torch.device("cpu")
    step = Step(model, model, build_optimizer(model, params, device), torch.amp.GradScaler("cpu", enabled=False),
                lm_loss, 1, params, device)
    step(iter([batch]), 0.01, lambda loss: None, 1, stats)


def test_statistics_equal_the_same_quantities_by_hand():
    torch.manual_seed(0)
    model = GPT(CONFIG)
    with torch.no_grad():
        model.blocks[1].mlp.gate_proj.weight[:7] = 0  # silu(0) = 0: 7 hidden units of layer 1 never fire
    by_hand = copy.deepcopy(model)
    x = torch.randint(0, 64, (3, 16))
    stats = StepStats(model).attach()
    one_step(model, (x, x), stats)
    stats.detach()
    got = stats.results()

    # the forward, block by block, with its activations and attention logits computed explicitly
    with torch.no_grad():
        h = by_hand.tok_emb(x)
        rope = (by_hand.rope_cos[:16], by_hand.rope_sin[:16])
        for i, block in enumerate(by_hand.blocks):
            attn = block.attn
            a = block.attn_norm(h[:1])
            q = apply_rope(attn.q_proj(a).view(1, 16, 4, 8).transpose(1, 2), *rope)
            k = apply_rope(attn.k_proj(a).view(1, 16, 2, 8).transpose(1, 2), *rope).repeat_interleave(2, dim=1)
            scores = [(q[0, hd, t] @ k[0, hd, s]).item() / math.sqrt(8)
                      for hd in range(4) for t in range(16) for s in range(t + 1)]
            assert math.isclose(got[f"stats/attn_logit_max/layer_{i:02d}"], max(scores), rel_tol=1e-5)
            mid = h + attn(block.attn_norm(h), rope, None, i, 0, (None, True))
            m = block.mlp_norm(mid)
            hidden = torch.nn.functional.silu(block.mlp.gate_proj(m)) * block.mlp.up_proj(m)
            h = mid + block.mlp.down_proj(hidden)
            assert math.isclose(got[f"stats/act_rms/layer_{i:02d}"], h.pow(2).mean().sqrt().item(), rel_tol=1e-5)
            assert math.isclose(got[f"stats/act_max/layer_{i:02d}"], h.abs().max().item(), rel_tol=1e-6)
            never = (hidden.abs() <= 1e-3 * hidden.pow(2).mean().sqrt()).all(dim=(0, 1)).float().mean().item()
            assert math.isclose(got[f"stats/dead_units/layer_{i:02d}"], never, abs_tol=1e-9)
    assert got["stats/dead_units/layer_01"] >= 7 / CONFIG.ffn_dim

    # gradients and the update, from a second copy stepped the same way
    before = {n: p.detach().clone() for n, p in by_hand.named_parameters()}
    by_hand.zero_grad()
    lm_loss(by_hand, (x, x)).backward()
    grads = {n: p.grad.clone() for n, p in by_hand.named_parameters()}
    by_hand.zero_grad(set_to_none=True)
    one_step(by_hand, (x, x))
    for layer in range(2):
        for group, names in [("attn", ["attn.q_proj", "attn.k_proj", "attn.v_proj", "attn.o_proj"]),
                             ("mlp", ["mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]),
                             ("norm", ["attn_norm", "mlp_norm"])]:
            keys = [f"blocks.{layer}.{n}.weight" for n in names]
            norm = math.sqrt(sum(grads[k].pow(2).sum().item() for k in keys))
            assert math.isclose(got[f"stats/grad_norm/layer_{layer:02d}.{group}"], norm, rel_tol=1e-4)
            after = dict(by_hand.named_parameters())
            change = math.sqrt(sum((after[k] - before[k]).pow(2).sum().item() for k in keys))
            ratio = change / math.sqrt(sum(before[k].pow(2).sum().item() for k in keys))
            assert math.isclose(got[f"stats/update_ratio/layer_{layer:02d}.{group}"], ratio, rel_tol=1e-4)
    assert "stats/grad_norm/embed" in got


def test_update_ratios_per_optimizer_group_and_qk_normed_logits():
    """With Muon: one update ratio per optimizer group (Muon's matrices, AdamW's decayed and undecayed tensors),
    each the group's ||W_after - W_before|| / ||W_before|| by hand; with QK-norm the attention logits measured are
    the normed queries' and keys'."""
    torch.manual_seed(0)
    config = ModelConfig(vocab_size=64, n_layer=2, n_head=4, n_kv_head=2, d_model=32, max_seq_len=16, qk_norm=True)
    model = GPT(config)
    with torch.no_grad():
        for block in model.blocks:
            block.attn.q_norm.weight.mul_(3.0)  # gains other than 1, so a missed norm shows
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    x = torch.randint(0, 64, (3, 16))
    params = build_section(TrainParams, {"lr": 0.01, "device": "cpu", "grad_clip": 0.0, "optimizer": "muon"})
    device = torch.device("cpu")
    step = Step(model, model, build_optimizer(model, params, device), torch.amp.GradScaler("cpu", enabled=False),
                lm_loss, 1, params, device)
    stats = StepStats(model).attach()
    with torch.no_grad():  # the first layer's logits, by hand, before the step
        a = model.blocks[0].attn_norm(model.tok_emb(x[:1]))
        attn, rope = model.blocks[0].attn, (model.rope_cos[:16], model.rope_sin[:16])
        q = apply_rope(attn.q_norm(attn.q_proj(a).view(1, 16, 4, 8)).transpose(1, 2), *rope)
        k = apply_rope(attn.k_norm(attn.k_proj(a).view(1, 16, 2, 8)).transpose(1, 2), *rope).repeat_interleave(2, 1)
        logits = (q @ k.transpose(-1, -2) / math.sqrt(8)).masked_fill(~torch.ones(16, 16).tril().bool(), -1e9)
    step(iter([(x, x)]), 0.01, lambda loss: None, 1, stats)
    stats.detach()
    got = stats.results()
    assert math.isclose(got["stats/attn_logit_max/layer_00"], logits.max().item(), rel_tol=1e-5)
    after = dict(model.named_parameters())
    muon = [n for n, p in model.blocks.named_parameters() if p.dim() == 2]
    groups = {"muon": [f"blocks.{n}" for n in muon],
              "adamw_decay": ["tok_emb.weight"],  # tied with the head
              "adamw_no_decay": [n for n, p in model.named_parameters() if p.dim() < 2]}
    for group, names in groups.items():
        ratio = math.sqrt(sum((after[n] - before[n]).pow(2).sum().item() for n in names) /
                          sum(before[n].pow(2).sum().item() for n in names))
        assert math.isclose(got[f"stats/update_ratio/optimizer.{group}"], ratio, rel_tol=1e-4), group
    assert len(groups["muon"]) == 2 * 7 and len(groups["adamw_no_decay"]) == 2 * 4 + 1


def hooked(model):
    return [name for name, m in model.named_modules() if m._forward_hooks or m._forward_pre_hooks]


def test_hooks_exist_on_stats_steps_only_and_never_when_off(tmp_path):
    seen = []

    def watching(model, batch):
        seen.append(bool(hooked(model)))
        return lm_loss(model, batch)

    gen = torch.Generator().manual_seed(3)
    batch = (torch.randint(0, 64, (8, 16), generator=gen), torch.randint(0, 64, (8, 16), generator=gen))
    for stats_every, want in [(0, [False] * 4), (2, [False, True, False, True])]:
        seen.clear()
        torch.manual_seed(0)
        model = GPT(ModelConfig(vocab_size=64, n_layer=1, n_head=2, n_kv_head=1, d_model=32, max_seq_len=16))
        with contextlib.chdir(tmp_path):
            train(model, loop_run(tmp_path / f"s{stats_every}", [batch], loss_fn=watching, max_steps=4,
                                  batch_size=8, stats_every=stats_every))
        assert seen == want and not hooked(model)


def test_a_run_with_statistics_trains_the_same_weights_and_draws_heatmaps(tiny, tmp_path):
    _, plain = run(tiny, tmp_path / "a", max_steps=4)
    _, observed = run(tiny, tmp_path / "b", max_steps=4, stats_every=2)
    for name, tensor in plain.items():
        assert torch.equal(tensor, observed[name]), name
    curves = metric_files(tmp_path / "b" / "metrics/pretrain")
    assert {"stats/grad_norm/layer_00.attn", "stats/update_ratio/embed", "stats/act_rms/layer_00",
            "stats/attn_logit_max/layer_00", "stats/dead_units/layer_00"} <= set(curves)
    assert not any(name.startswith("stats/") for name in metric_files(tmp_path / "a" / "metrics/pretrain"))
    for stat in ("grad_norm", "update_ratio", "act_rms", "act_max", "attn_logit_max", "dead_units"):
        assert (tmp_path / "b" / "metrics/pretrain/stats" / f"{stat}.png").read_bytes().startswith(b"\x89PNG")
