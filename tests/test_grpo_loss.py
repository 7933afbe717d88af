"""GRPO's advantages and clipped policy loss: hand-computed values, gradients, a float64 loop reference, and TRL's
own `GRPOTrainer._compute_loss` (trl 1.16) driven with a stubbed trainer."""

import math
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from kiln.pipeline.post.grpo_loss import LOSS_TYPES, aggregate, group_advantages, k3_kl, policy_loss

F64 = torch.float64


def leaf(values, dtype=F64) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype, requires_grad=True)


def test_advantages_by_hand():
    """Group [1, 0, 0, 1]: mean 0.5, sample std sqrt((4 * 0.25) / 3) = 0.577350 (TRL's nanstd has Bessel's
    correction); group [2, 4, 6, 8]: mean 5, sample std sqrt(20 / 3) = 2.581989. eps 1e-4 is added to the std."""
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 4.0, 6.0, 8.0], dtype=F64)
    a1, a2 = 0.5 / (0.5773502692 + 1e-4), 1 / (2.5819888975 + 1e-4)
    want = torch.tensor([a1, -a1, -a1, a1, -3 * a2, -a2, a2, 3 * a2], dtype=F64)
    torch.testing.assert_close(group_advantages(rewards, 4), want, rtol=1e-9, atol=0)
    assert a1 == pytest.approx(0.865875, abs=1e-6)  # a population std (0.5) would give 0.999800
    # Dr. GRPO: no division by the std.
    torch.testing.assert_close(group_advantages(rewards, 4, scale=False),
                               torch.tensor([0.5, -0.5, -0.5, 0.5, -3, -1, 1, 3], dtype=F64), rtol=0, atol=0)
    # The groups are kept apart: as one group of 8 the baseline would be the overall mean 2.75.
    assert not torch.allclose(group_advantages(rewards, 4, scale=False), group_advantages(rewards, 8, scale=False))
    torch.testing.assert_close(group_advantages(rewards, 8, scale=False), rewards - 2.75)


def test_advantages_match_trls_formula():
    """TRL 1.16 `_generate_and_score_completions`, scale_rewards="group": (r - nanmean(group)) /
    (nanstd(group) + 1e-4), with TRL's own nanstd helper."""
    from trl.trainer.utils import nanstd

    torch.manual_seed(0)
    rewards = torch.randn(24, dtype=F64)
    grouped = rewards.view(-1, 6)
    mean = torch.nanmean(grouped, dim=1).repeat_interleave(6)
    std = nanstd(grouped, dim=1).repeat_interleave(6)
    torch.testing.assert_close(group_advantages(rewards, 6), (rewards - mean) / (std + 1e-4))
    torch.testing.assert_close(group_advantages(rewards, 6, scale=False), rewards - mean)


def test_equal_rewards_give_zero_advantage_and_zero_gradient():
    """0.3 sixteen times: the float32 mean is one ulp off 0.3, which divided by 1e-4 would be a spurious
    advantage of ~3e-4 (the naive formula below); the group carries no signal, so its advantages must be 0."""
    rewards = torch.tensor([0.3] * 16 + [1.0, 0.0] * 8)
    naive = (rewards[:16] - rewards[:16].mean()) / (rewards[:16].std() + 1e-4)
    assert naive.abs().max() > 0  # the case the guard exists for
    advantages = group_advantages(rewards, 16)
    assert torch.equal(advantages[:16], torch.zeros(16))
    assert advantages[16:].abs().min() > 0.9
    torch.manual_seed(1)
    old = -torch.rand(4, 5) * 3
    for loss_type in LOSS_TYPES:
        logps = (old + torch.randn(4, 5) * 0.5).requires_grad_()
        loss, _ = policy_loss(logps, old, advantages[:4], torch.ones(4, 5), 0.2, 0.28, loss_type=loss_type,
                              max_completion_length=5)
        loss.backward()
        assert loss.item() == 0.0
        assert torch.equal(logps.grad, torch.zeros(4, 5)), loss_type


def test_group_advantages_refuses_bad_input():
    with pytest.raises(ValueError, match="groups of 4"):
        group_advantages(torch.zeros(6), 4)
    with pytest.raises(ValueError, match="1-D"):
        group_advantages(torch.zeros(2, 4), 4)
    with pytest.raises(ValueError, match="finite"):
        group_advantages(torch.tensor([1.0, float("nan")]), 2)
    assert torch.equal(group_advantages(torch.tensor([3.0, 5.0]), 1), torch.zeros(2))


def clip_case(eps_high: float):
    """Row 0, A = +1, ratios 1.5, 1.25, 0.5; row 1, A = -2, ratios 0.5, 1.2, 1.5; eps_low 0.2."""
    ratios = torch.tensor([[1.5, 1.25, 0.5], [0.5, 1.2, 1.5]], dtype=F64)
    logps = ratios.log().requires_grad_()
    loss, metrics = policy_loss(logps, torch.zeros(2, 3, dtype=F64), torch.tensor([1.0, -2.0], dtype=F64),
                                torch.ones(2, 3), 0.2, eps_high, loss_type="bnpo")
    loss.backward()
    return loss.item(), logps.grad, metrics


def test_clipping_on_both_sides_by_hand():
    """bnpo over 6 tokens, weight 1/6 each; eps_low 0.2, eps_high 0.28 (DAPO's clip-higher).
    Row 0 (A = +1): 1.5 > 1.28 is clipped to 1.28, no gradient; 1.25 is inside, objective 1.25, d/dlogp = 1.25;
      0.5 < 0.8 but A > 0: min(0.5, 0.8) keeps 0.5, d/dlogp = 0.5.
    Row 1 (A = -2): 0.5 < 0.8 is clipped, min(-1.0, -1.6) = -1.6, no gradient; 1.2 inside, -2.4, d/dlogp = -2.4;
      1.5 > 1.28 but A < 0: min(-3.0, -2.56) keeps -3.0, d/dlogp = -3.0.
    Loss = -(1.28 + 1.25 + 0.5 - 1.6 - 2.4 - 3.0) / 6 = 3.97 / 6; gradient of the loss = -(d objective) / 6."""
    loss, grad, metrics = clip_case(0.28)
    assert loss == pytest.approx(3.97 / 6, rel=1e-12)
    want = -torch.tensor([[0.0, 1.25, 0.5], [0.0, -2.4, -3.0]], dtype=F64) / 6
    torch.testing.assert_close(grad, want, rtol=1e-12, atol=0)
    assert grad[0, 0] == 0 and grad[1, 0] == 0
    assert metrics == pytest.approx({"clip_ratio/low_mean": 1 / 6, "clip_ratio/high_mean": 1 / 6,
                                     "clip_ratio/region_mean": 2 / 6, "clip_ratio/low_min": 0.0,
                                     "clip_ratio/high_max": 1 / 3})
    # Symmetric 0.2: ratio 1.25 with A > 0 is now clipped too (objective 1.2, no gradient).
    loss, grad, metrics = clip_case(0.2)
    assert loss == pytest.approx(-(1.2 + 1.2 + 0.5 - 1.6 - 2.4 - 3.0) / 6, rel=1e-12)
    assert grad[0, 1] == 0 and grad[1, 1] == pytest.approx(2.4 / 6)
    assert metrics["clip_ratio/high_mean"] == pytest.approx(2 / 6)
    assert metrics["clip_ratio/high_max"] == pytest.approx(2 / 3)


def test_k3_kl_by_hand():
    """ref - logp = -0.5: e^-0.5 + 0.5 - 1 = 0.1065306597; ref - logp = 1: e - 1 - 1 = 0.7182818285."""
    logps, ref = torch.tensor([[-1.0, -2.0]], dtype=F64), torch.tensor([[-1.5, -1.0]], dtype=F64)
    torch.testing.assert_close(k3_kl(logps, ref), torch.tensor([[0.1065306597, 0.7182818285]], dtype=F64),
                               rtol=1e-9, atol=0)
    torch.manual_seed(2)
    a, b = torch.randn(50, 9) * 3, torch.randn(50, 9) * 3
    assert (k3_kl(a, b) >= 0).all()
    assert torch.equal(k3_kl(a, a), torch.zeros(50, 9))
    # In the loss: on-policy (ratio 1) with A = 0 the loss is beta times the token mean of the kl.
    loss, metrics = policy_loss(logps, logps, torch.zeros(1, dtype=F64), torch.ones(1, 2), 0.2, 0.2, ref_logps=ref,
                                beta=0.1)
    assert metrics["kl"] == pytest.approx((0.1065306597 + 0.7182818285) / 2, rel=1e-9)
    assert loss.item() == pytest.approx(0.1 * (0.1065306597 + 0.7182818285) / 2, rel=1e-9)
    _, metrics = policy_loss(logps, logps, torch.zeros(1, dtype=F64), torch.ones(1, 2), 0.2, 0.2, ref_logps=logps)
    assert metrics["kl"] == 0.0


def test_aggregations_by_hand():
    """On-policy (old_logps is logps itself: ratio 1, gradient of the ratio d logp), so each token's loss is -A.
    Row 0: a short right answer, 1 token, A = +1; row 1: a long wrong answer, 3 tokens, A = -1; T = 4 and
    max_completion_length = 5 (dr_grpo's constant is the generation limit, not the padded width).
      grpo:    (-1/1 + 3/3) / 2 = 0        token weights 1/2 (row 0) and 1/6 (row 1)
      bnpo:    (-1 + 3) / 4 = 0.5          weights 1/4
      dr_grpo: (-1 + 3) / (2 * 5) = 0.2    weights 1/10
      dapo, 8 tokens in the step: (-1 + 3) / 8 = 0.25   weights 1/8; without num_items_in_batch = bnpo.
    grpo's loss is 0: the long wrong answer is penalised per token 3x less than the short right one is rewarded."""
    mask = torch.tensor([[1, 0, 0, 0], [1, 1, 1, 0]])
    old = torch.tensor([[-0.5, 0.0, 0.0, 0.0], [-1.0, -2.0, -0.1, 0.0]], dtype=F64)
    advantages = torch.tensor([1.0, -1.0], dtype=F64)
    cases = {("grpo", None): (0.0, 1 / 2, 1 / 6), ("bnpo", None): (0.5, 1 / 4, 1 / 4),
             ("dr_grpo", None): (0.2, 1 / 10, 1 / 10), ("dapo", 8): (0.25, 1 / 8, 1 / 8),
             ("dapo", None): (0.5, 1 / 4, 1 / 4)}
    losses = {}
    for (loss_type, items), (want, w0, w1) in cases.items():
        logps = old.clone().requires_grad_()
        loss, _ = policy_loss(logps, logps, advantages, mask, 0.2, 0.28, loss_type=loss_type,
                              max_completion_length=5, num_items_in_batch=items)
        loss.backward()
        losses[loss_type, items] = loss.item()
        assert loss.item() == pytest.approx(want, abs=1e-12), loss_type
        want_grad = torch.tensor([[-w0, 0, 0, 0], [w1, w1, w1, 0]], dtype=F64)  # -w * ratio * A
        torch.testing.assert_close(logps.grad, want_grad, rtol=1e-12, atol=0)
    assert len({round(v, 9) for v in losses.values()}) == 4  # grpo, bnpo, dr_grpo and dapo(8) all differ


def test_padding_cannot_poison_loss_or_gradient():
    """Prompt and padding positions may hold -inf or NaN log-probs; the loss and gradient are those of zeros."""
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    clean = torch.tensor([[-0.3, -1.2, 0.0], [-2.0, 0.0, 0.0]], dtype=F64)
    dirty = clean.clone()
    dirty[0, 2], dirty[1, 1], dirty[1, 2] = -math.inf, math.nan, -math.inf
    advantages = torch.tensor([0.7, -1.1], dtype=F64)
    results = []
    for values in (clean, dirty):
        logps = (values + torch.tensor([[0.1, -0.2, 0.0], [0.3, 0.0, 0.0]], dtype=F64)).requires_grad_()
        loss, metrics = policy_loss(logps, values, advantages, mask, 0.2, 0.28, ref_logps=values, beta=0.1,
                                    loss_type="grpo")
        loss.backward()
        results.append((loss.item(), logps.grad, metrics))
    assert math.isfinite(results[1][0]) and results[0][0] == results[1][0]
    assert torch.equal(results[0][1], results[1][1])
    assert results[0][2] == results[1][2]
    assert (results[1][1][mask == 0] == 0).all()


def reference_loss(logps, old, ref, advantages, mask, eps_low, eps_high, beta, loss_type, max_len, items):
    """Token by token in float64, straight from the formulas; metrics as TRL 1.16 defines them."""
    B, T = mask.shape
    rows, low, high, kls, row_low, row_high = [], [], [], [], [], []
    for b in range(B):
        row, n_low, n_high = [], len(low), len(high)
        for t in range(T):
            if not mask[b, t]:
                continue
            ratio = torch.exp(logps[b, t] - old[b, t])
            a = advantages[b]
            objective = torch.minimum(ratio * a, torch.clamp(ratio, 1 - eps_low, 1 + eps_high) * a)
            kl = torch.exp(ref[b, t] - logps[b, t]) - (ref[b, t] - logps[b, t]) - 1
            row.append(-objective + beta * kl)
            low.append(float(ratio < 1 - eps_low and a < 0))
            high.append(float(ratio > 1 + eps_high and a > 0))
            kls.append(kl.item())
        rows.append(row)
        if row:
            row_low.append(sum(low[n_low:]) / len(row))
            row_high.append(sum(high[n_high:]) / len(row))
    total = sum(sum(row) for row in rows)
    n = sum(len(row) for row in rows)
    loss = {"grpo": sum(sum(row) / max(len(row), 1) for row in rows) / B, "bnpo": total / n,
            "dr_grpo": total / (B * max_len), "dapo": total / (items or n)}[loss_type]
    metrics = {"clip_ratio/low_mean": sum(low) / n, "clip_ratio/high_mean": sum(high) / n,
               "clip_ratio/region_mean": sum(max(x, y) for x, y in zip(low, high)) / n, "kl": sum(kls) / n,
               "clip_ratio/low_min": min(row_low), "clip_ratio/high_max": max(row_high)}
    return loss, metrics


@pytest.mark.parametrize("seed", [0, 1, 4])
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_matches_float64_reference(seed, loss_type):
    """B = 3, T = 7, ragged masks with a one-token row, float32 against a float64 token loop, loss and gradient.
    Ratios spread over exp(+-0.8); these seeds clip some tokens, not all (seeds 1 and 4 on both sides)."""
    gen = torch.Generator().manual_seed(seed)
    mask = torch.tensor([[0, 0, 1, 1, 1, 1, 1], [0, 0, 0, 0, 0, 0, 1], [0, 1, 1, 1, 0, 0, 0]])
    old = -torch.rand(3, 7, generator=gen, dtype=F64) * 4
    logps64 = old + (torch.rand(3, 7, generator=gen, dtype=F64) - 0.5) * 1.6
    ref = old + torch.randn(3, 7, generator=gen, dtype=F64) * 0.3
    advantages = torch.randn(3, generator=gen, dtype=F64)
    items = 23 if loss_type == "dapo" else None
    logps32 = logps64.float().requires_grad_()
    loss, metrics = policy_loss(logps32, old.float(), advantages.float(), mask, 0.2, 0.28, ref_logps=ref.float(),
                                beta=0.04, loss_type=loss_type, max_completion_length=7, num_items_in_batch=items)
    loss.backward()
    logps64.requires_grad_()
    want, want_metrics = reference_loss(logps64, old, ref, advantages, mask, 0.2, 0.28, 0.04, loss_type, 7, items)
    want.backward()
    assert loss.item() == pytest.approx(want.item(), rel=1e-5, abs=1e-7)
    torch.testing.assert_close(logps32.grad.double(), logps64.grad, rtol=1e-5, atol=1e-7)
    assert {k: metrics[k] for k in want_metrics} == pytest.approx(want_metrics, rel=1e-5, abs=1e-7)
    assert 0 < metrics["clip_ratio/region_mean"] < 1


def trl_grpo(logps, old, ref, advantages, mask, loss_type, eps_low, eps_high, beta, max_len, items,
             accumulation=1):
    """(loss, d loss / d logps, logged metrics) of TRL's own `GRPOTrainer._compute_loss` (trl 1.16,
    trl/trainer/grpo_trainer.py) on one process. The trainer is stubbed: its per-token log-prob function returns
    our `logps` (a leaf), so TRL's formulas run on exactly the tensors kiln's do; steps_per_generation equals the
    gradient-accumulation steps, TRL's default, and num_items_in_batch is the generation batch's token count."""
    from trl.trainer.grpo_trainer import GRPOTrainer

    B, T = mask.shape
    logps = logps.detach().clone().requires_grad_()
    trainer = SimpleNamespace(
        _get_per_token_logps_and_entropies=lambda *args, **kwargs: (logps, torch.zeros_like(logps), None),
        model=SimpleNamespace(training=True), top_entropy_quantile=1.0, off_policy_mask_threshold=None,
        importance_sampling_level="token", loss_type=loss_type, epsilon_low=eps_low, epsilon_high=eps_high,
        beta=beta, use_vllm=False, vllm_importance_sampling_correction=False, _entropy_bonus_enabled=False,
        aux_loss_enabled=False, max_completion_length=max_len, current_gradient_accumulation_steps=accumulation,
        args=SimpleNamespace(use_bias_correction_kl=False, delta=None, steps_per_generation=accumulation),
        accelerator=SimpleNamespace(num_processes=1, gather=lambda t: t, reduce=lambda t, reduction: t),
        _metrics={"train": defaultdict(list), "eval": defaultdict(list)})
    inputs = {"prompt_ids": torch.zeros(B, 2, dtype=torch.long), "prompt_mask": torch.ones(B, 2, dtype=torch.long),
              "completion_ids": torch.zeros(B, T, dtype=torch.long), "completion_mask": mask,
              "advantages": advantages, "old_per_token_logps": old, "ref_per_token_logps": ref,
              "num_items_in_batch": torch.tensor(items)}
    loss = GRPOTrainer._compute_loss(trainer, None, inputs)
    loss.backward()
    return loss.item(), logps.grad, {k: v[0] for k, v in trainer._metrics["train"].items()}


@pytest.mark.parametrize("beta", [0.0, 0.05])
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_matches_trl(loss_type, beta):
    """Loss, gradient and clip/kl metrics against TRL's `_compute_loss`, one micro-batch per optimiser step,
    max_completion_length 9 above the batch's padded width 6."""
    gen = torch.Generator().manual_seed(7)
    mask = torch.tensor([[1, 1, 1, 1, 1, 0], [1, 0, 0, 0, 0, 0], [1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 1]])
    old = -torch.rand(4, 6, generator=gen) * 4
    logps = old + (torch.rand(4, 6, generator=gen) - 0.5) * 1.2
    ref = old + torch.randn(4, 6, generator=gen) * 0.3
    advantages = torch.tensor([1.3, -0.4, -1.7, 0.8])
    items = int(mask.sum())
    want, want_grad, want_metrics = trl_grpo(logps, old, ref, advantages, mask, loss_type, 0.2, 0.28, beta, 9, items)
    mine = logps.clone().requires_grad_()
    loss, metrics = policy_loss(mine, old, advantages, mask, 0.2, 0.28, ref_logps=ref if beta else None, beta=beta,
                                loss_type=loss_type, max_completion_length=9, num_items_in_batch=items)
    loss.backward()
    assert loss.item() == pytest.approx(want, rel=1e-6)
    torch.testing.assert_close(mine.grad, want_grad, rtol=1e-6, atol=1e-8)
    assert set(want_metrics) - set(metrics) == {"entropy"}  # TRL also logs the entropy, which needs the logits
    assert {k: metrics[k] for k in want_metrics if k != "entropy"} == pytest.approx(
        {k: v for k, v in want_metrics.items() if k != "entropy"}, rel=1e-6)
    assert want_metrics["clip_ratio/low_mean"] > 0 and want_metrics["clip_ratio/high_mean"] > 0


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_accumulation_against_trl(loss_type):
    """Four micro-batches per optimiser step: TRL divides grpo, bnpo and dr_grpo by the 4 steps itself (ours leave
    that to the caller), while dapo divides by the whole step's token count, which the caller passes."""
    gen = torch.Generator().manual_seed(3)
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0]])
    old = -torch.rand(2, 4, generator=gen) * 3
    logps = old + (torch.rand(2, 4, generator=gen) - 0.5)
    advantages = torch.tensor([-0.9, 1.2])
    step_items = 19  # this micro-batch's 4 tokens and 15 in the step's other three
    want, want_grad, _ = trl_grpo(logps, old, None, advantages, mask, loss_type, 0.2, 0.28, 0.0, 4, step_items,
                                  accumulation=4)
    mine = logps.clone().requires_grad_()
    loss, _ = policy_loss(mine, old, advantages, mask, 0.2, 0.28, loss_type=loss_type, max_completion_length=4,
                          num_items_in_batch=step_items)
    divisor = 1 if loss_type == "dapo" else 4
    (loss / divisor).backward()
    assert loss.item() / divisor == pytest.approx(want, rel=1e-6)
    torch.testing.assert_close(mine.grad, want_grad, rtol=1e-6, atol=1e-8)


def test_policy_loss_refuses_bad_input():
    x, m, a = torch.zeros(2, 3), torch.ones(2, 3), torch.zeros(2)
    with pytest.raises(ValueError, match="grpo, bnpo, dr_grpo, dapo"):
        policy_loss(x, x, a, m, 0.2, 0.2, loss_type="ppo")
    with pytest.raises(ValueError, match="choose one of"):
        aggregate(x, m, "cispo")
    with pytest.raises(ValueError, match="old_logps"):
        policy_loss(x, torch.zeros(2, 4), a, m, 0.2, 0.2)
    with pytest.raises(ValueError, match="mask"):
        policy_loss(x, x, a, torch.ones(3, 3), 0.2, 0.2)
    with pytest.raises(ValueError, match="ref_logps"):
        policy_loss(x, x, a, m, 0.2, 0.2, ref_logps=torch.zeros(3))
    with pytest.raises(ValueError, match="advantages"):
        policy_loss(x, x, torch.zeros(2, 3), m, 0.2, 0.2)
    with pytest.raises(ValueError, match="beta"):
        policy_loss(x, x, a, m, 0.2, 0.2, beta=0.1)
    with pytest.raises(ValueError, match="max_completion_length"):
        policy_loss(x, x, a, m, 0.2, 0.2, loss_type="dr_grpo")
    with pytest.raises(ValueError, match="max_completion_length"):
        policy_loss(x, x, a, m, 0.2, 0.2, loss_type="dr_grpo", max_completion_length=2)
    with pytest.raises(ValueError, match="eps_low"):
        policy_loss(x, x, a, m, 1.0, 0.2)
