"""Muon (pipeline/train/muon.py): the step against a plain float64 reference of the same update, against
torch.optim.Muon's, and the two optimizers behind one state_dict that resumes bitwise."""

from __future__ import annotations

import math

import pytest
import torch

from kiln.pipeline.train.muon import Muon, Optimizers, orthogonalize

A, B, C = 3.4445, -4.7750, 2.0315


def reference_step(p, g, buf, step, lr, momentum, start, warmup, decay):
    """One Muon update written out in float64, matrix by matrix: momentum warmed up linearly, Nesterov by lerp,
    five quintic Newton-Schulz iterations on the wide orientation, decoupled decay, lr x sqrt(max(1, rows/cols))."""
    m = start + min(1.0, step / warmup) * (momentum - start)
    buf = buf + (1 - m) * (g - buf)
    update = g + m * (buf - g)
    x = update.T if update.shape[0] > update.shape[1] else update
    x = x / max(torch.linalg.matrix_norm(x).item(), 1e-7)
    for _ in range(5):
        gram = x @ x.T
        x = A * x + (B * gram + C * gram @ gram) @ x
    x = x.T if update.shape[0] > update.shape[1] else x
    p = p * (1 - lr * decay) - lr * math.sqrt(max(1.0, p.shape[0] / p.shape[1])) * x
    return p, buf


@pytest.mark.parametrize("shapes", [[(7, 5)], [(5, 7), (5, 7), (16, 16)], [(1, 9), (9, 1), (33, 17)]])
def test_muon_steps_equal_a_float64_reference(shapes):
    torch.manual_seed(len(shapes))
    params = [torch.nn.Parameter(torch.randn(*s, dtype=torch.float64)) for s in shapes]
    want = [p.detach().clone() for p in params]
    bufs = [torch.zeros_like(p) for p in want]
    opt = Muon(params, lr=0.02, momentum=0.95, momentum_start=0.85, momentum_warmup=3, weight_decay=0.1)
    for step in range(1, 6):
        grads = [torch.randn_like(p) for p in want]
        for p, g in zip(params, grads):
            p.grad = g.clone()
        opt.step()
        for i, g in enumerate(grads):
            want[i], bufs[i] = reference_step(want[i], g, bufs[i], step, 0.02, 0.95, 0.85, 3, 0.1)
    for p, w in zip(params, want):
        torch.testing.assert_close(p.detach(), w, rtol=1e-12, atol=1e-12)


def test_muon_update_is_torch_optim_muons():
    """The same semantics as torch.optim.Muon (whose Newton-Schulz runs in bf16: a bf16 tolerance)."""
    torch.manual_seed(0)
    shapes = [(24, 40), (40, 24), (32, 32)]
    ours = [torch.nn.Parameter(torch.randn(*s)) for s in shapes]
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    mine = Muon(ours, lr=0.05, momentum=0.95, momentum_start=0.95, momentum_warmup=0, weight_decay=0.1)
    torchs = torch.optim.Muon(theirs, lr=0.05, momentum=0.95, weight_decay=0.1, nesterov=True)
    starts = [p.detach().clone() for p in ours]
    for _ in range(3):
        for a, b in zip(ours, theirs):
            a.grad = torch.randn_like(a)
            b.grad = a.grad.clone()
        mine.step()
        torchs.step()
    for a, b, s in zip(ours, theirs, starts):
        moved, expected = a.detach() - s, b.detach() - s
        assert (moved - expected).norm() / expected.norm() < 0.03


def test_muon_refuses_what_is_not_a_matrix():
    with pytest.raises(ValueError, match=r"shape \(4,\)"):
        Muon([torch.nn.Parameter(torch.ones(4))], lr=0.1, momentum=0.9, momentum_start=0.9, momentum_warmup=0,
             weight_decay=0.0)


def test_two_optimizers_save_and_resume_as_one_bitwise():
    torch.manual_seed(1)

    def build(seed_params):
        ps = [torch.nn.Parameter(t.clone()) for t in seed_params]
        adamw = torch.optim.AdamW([{"params": ps[:2], "weight_decay": 0.1}, {"params": ps[2:3], "weight_decay": 0}],
                                  lr=1e-2)
        muon = Muon(ps[3:], lr=0.02, momentum=0.95, momentum_start=0.85, momentum_warmup=4, weight_decay=0.0)
        return ps, Optimizers(adamw, muon)

    start = [torch.randn(6, 4), torch.randn(4, 4), torch.randn(4), torch.randn(8, 4), torch.randn(4, 8)]
    grads = [[torch.randn_like(t) for t in start] for _ in range(6)]

    def steps(ps, opt, gs):
        for g in gs:
            for p, x in zip(ps, g):
                p.grad = x.clone()
            opt.step()
            opt.zero_grad()

    straight, opt = build(start)
    steps(straight, opt, grads)
    first, opt = build(start)
    steps(first, opt, grads[:3])
    saved = opt.state_dict()
    assert [g["params"] for g in saved["param_groups"]] == [[0, 1], [2], [3, 4]]  # one numbering, in order
    assert set(saved["state"]) == {0, 1, 2, 3, 4} and "momentum_buffer" in saved["state"][4]
    resumed, again = build([p.detach() for p in first])
    again.load_state_dict(saved)
    steps(resumed, again, grads[3:])
    for a, b in zip(straight, resumed):
        assert torch.equal(a, b)
    assert [g["lr"] for g in again.param_groups] == [1e-2, 1e-2, 0.02]  # the groups are the optimizers' own


def test_orthogonalize_pushes_singular_values_towards_one():
    torch.manual_seed(2)
    m = torch.randn(3, 48, 16, dtype=torch.float64) * torch.logspace(-1, 1, 16, dtype=torch.float64)
    assert (lambda s: s.max() / s.min())(torch.linalg.svdvals(m)) > 100
    s = torch.linalg.svdvals(orthogonalize(m))
    assert s.min() > 0.6 and s.max() < 1.2  # the quintic's band (~0.7-1.15), from singular values 100x apart


def test_build_optimizer_gives_the_blocks_matrices_to_muon_and_the_rest_to_adamw():
    from kiln.model.config import ModelConfig
    from kiln.model.gpt import GPT
    from kiln.pipeline.config import build_section
    from kiln.pipeline.train.loop import build_optimizer
    from kiln.pipeline.train.params import TrainParams

    model = GPT(ModelConfig(arch="llama", n_layer=2, n_head=2, n_kv_head=1, d_model=32, max_seq_len=16,
                            vocab_size=64))
    params = build_section(TrainParams, {"optimizer": "muon", "lr": 0.004, "muon_lr": 0.03})
    opt = build_optimizer(model, params, torch.device("cpu"))
    adamw, muon = opt.optimizers
    named = {id(p): n for n, p in model.named_parameters()}
    in_muon = {named[id(p)] for g in muon.param_groups for p in g["params"]}
    assert in_muon == {n for n, p in model.named_parameters() if n.startswith("blocks.") and p.dim() == 2}
    in_adamw = {named[id(p)] for g in adamw.param_groups for p in g["params"]}
    assert in_adamw == set(named.values()) - in_muon and "tok_emb.weight" in in_adamw
    # the loop sets each group's lr from the one schedule of train.lr: Muon's keeps its ratio
    for group in opt.param_groups:
        group["lr"] = 0.002 * group.get("lr_scale", 1.0)
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([0.002, 0.002, 0.015])
    plain = build_optimizer(model, build_section(TrainParams, {"optimizer": "adamw"}), torch.device("cpu"))
    assert isinstance(plain, torch.optim.AdamW)  # asked for, AdamW is the plain one, untouched


def test_embed_and_head_lrs_get_groups_of_their_own_only_when_set():
    from kiln.model.config import ModelConfig
    from kiln.model.gpt import GPT
    from kiln.pipeline.config import build_section
    from kiln.pipeline.errors import UserError
    from kiln.pipeline.train.loop import build_optimizer
    from kiln.pipeline.train.params import TrainParams, run_identity
    from kiln.pipeline.train.stats import optimizer_group_name

    def model(tied):
        return GPT(ModelConfig(arch="llama", n_layer=1, n_head=2, n_kv_head=1, d_model=32, max_seq_len=16,
                               vocab_size=64, tie_embeddings=tied))

    untied = model(False)
    params = build_section(TrainParams, {"optimizer": "muon", "lr": 0.004, "embed_lr": 0.2, "head_lr": 0.008})
    opt = build_optimizer(untied, params, torch.device("cpu"))
    for group in opt.param_groups:  # as the loop does, halfway down a schedule
        group["lr"] = 0.002 * group.get("lr_scale", 1.0)
    named = {id(p): n for n, p in untied.named_parameters()}
    by_group = {optimizer_group_name(g): ([named[id(p)] for p in g["params"]], g["lr"]) for g in opt.param_groups}
    assert by_group["adamw_embed"] == (["tok_emb.weight"], pytest.approx(0.1))
    assert by_group["adamw_head"] == (["lm_head.weight"], pytest.approx(0.004))
    assert by_group["adamw_decay"] == ([], pytest.approx(0.002))  # every other matrix is Muon's
    assert sum(len(g["params"]) for g in opt.param_groups) == len(named)
    tied = model(True)
    shared = build_optimizer(tied, build_section(TrainParams, {"optimizer": "adamw", "embed_lr": 0.2}),
                             torch.device("cpu"))
    assert [len(g["params"]) for g in shared.param_groups] == [7, 3, 1]  # 7 block matrices, 3 norms, the tied embedding
    with pytest.raises(UserError, match=r"train\.head_lr=0\.008: expected null with model\.tie_embeddings=true"):
        build_optimizer(tied, params, torch.device("cpu"))
    plain = build_section(TrainParams, {"optimizer": "adamw"})
    assert len(build_optimizer(tied, plain, torch.device("cpu")).param_groups) == 2  # unset: the old layout
    assert "embed_lr" not in run_identity(plain) and run_identity(params)["embed_lr"] == 0.2
    with pytest.raises(UserError, match=r"train\.embed_lr"):
        build_section(TrainParams, {"embed_lr": 0})


@pytest.mark.parametrize("settings,key", [
    ({"optimizer": "sgd"}, "optimizer"),
    ({"muon_momentum_start": 0.99}, "muon_momentum_start"),
    ({"muon_lr": 0}, "muon_lr"),
    ({"muon_momentum": 1.0}, "muon_momentum"),
])
def test_bad_muon_settings_are_refused_naming_the_key(settings, key):
    from kiln.pipeline.config import build_section
    from kiln.pipeline.errors import UserError
    from kiln.pipeline.train.params import TrainParams

    with pytest.raises(UserError, match=rf"train\.{key}"):
        build_section(TrainParams, settings)


def test_muon_keys_are_part_of_a_runs_identity_only_with_muon():
    from kiln.pipeline.config import build_section
    from kiln.pipeline.train.params import TrainParams, run_identity

    adamw = run_identity(build_section(TrainParams, {"optimizer": "adamw", "muon_lr": 0.5}))
    assert "muon_lr" not in adamw and "optimizer" not in adamw  # AdamW checkpoints written before still resume
    assert run_identity(build_section(TrainParams, {"optimizer": "muon"}))["muon_lr"] == 0.02
    # the same rule for train.batching: only document rows are another run
    assert "batching" not in adamw and "doc_mask" not in adamw
    assert run_identity(build_section(TrainParams, {"batching": "documents", "doc_mask": True}))["doc_mask"]
    assert run_identity(build_section(TrainParams, {"batching": "documents"}))["batching"] == "documents"
