"""GRPO's policy loss as plain tensor functions, which the `grpo` stage trains with: group-relative advantages and the
clipped surrogate with its aggregations, kept apart from any model so each can be checked against hand-computed
numbers and against TRL's own `GRPOTrainer._compute_loss` (trl 1.16, trl/trainer/grpo_trainer.py).

GRPO (Shao et al., 2024, DeepSeekMath) samples a group of completions per prompt, scores them, and uses each
completion's reward relative to its group as the advantage of every one of its tokens; there is no value model.
The loss is PPO's token-level clipped surrogate, optionally with a k3 KL penalty towards a frozen reference.

How per-token losses become one number is the choice that matters (`loss_type`, TRL's names and formulas):
  grpo     mean over each sequence's tokens, then mean over sequences (the DeepSeekMath paper's 1/|o_i|);
  bnpo     sum over the batch's completion tokens / their number (a token mean over this micro-batch);
  dr_grpo  sum over the batch's completion tokens / (B * max_completion_length) (Liu et al., 2025, Dr. GRPO);
  dapo     sum over the batch's completion tokens / the number of completion tokens in the whole optimiser
           step, every micro-batch of it (Yu et al., 2025, DAPO); TRL 1.16's default.
Recommended kiln default: `dapo`. `grpo` weighs a token by 1/length of its sequence, so a long wrong answer is
penalised less per token than a short one and a long right answer rewarded less: the policy learns to ramble
when wrong (Dr. GRPO, section 3; DAPO, "token-level policy gradient loss"). `dapo` weighs every completion token
of the step alike, and unlike `dr_grpo` its scale does not depend on how far max_completion_length sits above the
answers' actual lengths, so the learning rate means the same thing whatever the generation limit.

TRL's other loss types (cispo, sapo, luspo, vespo) are different surrogates rather than aggregations, and its
`delta` (INTELLECT-2's two-sided clip), vLLM importance correction, entropy masks and sequence-level ratios
(GSPO) are left out; this module covers the clipped token-level surrogate only.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from kiln.pipeline.post.grpo_params import LOSS_TYPES


def group_advantages(rewards: Tensor, group_size: int, scale: bool = True, eps: float = 1e-4) -> Tensor:
    """Each completion's advantage (N,) from rewards (N,) that come in consecutive groups of `group_size`
    completions of one prompt: r - mean(group), divided by (std(group) + eps) when `scale`.

    As TRL 1.16 (`GRPOTrainer._generate_and_score_completions`, scale_rewards="group"): the std is the sample std
    (Bessel's correction, trl.trainer.utils.nanstd) and eps = 1e-4 is added to it, not under a square root.
    `scale=False` is Dr. GRPO's (scale_rewards="none"): dividing by the std up-weights prompts that are nearly
    always or nearly never solved, a question-level difficulty bias. TRL's "batch" scaling is not offered.
    Two departures, both where TRL's answer carries no information: a group whose rewards are all equal gets
    advantages of exactly zero (the float mean of equal values can be one ulp off, which TRL divides by 1e-4 into
    a spurious advantage), and group_size 1 gives zeros as TRL's eval path does. Non-finite rewards are refused
    (TRL reads NaN as "unscored" and masks it; kiln's rewards are always scored).
    """
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D (N,), got shape {tuple(rewards.shape)}")
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    if rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size}")
    if not torch.isfinite(rewards).all():
        raise ValueError("rewards must be finite")
    if group_size == 1:
        return torch.zeros_like(rewards)
    groups = rewards.view(-1, group_size)
    advantages = groups - groups.mean(dim=1, keepdim=True)
    if scale:
        advantages = advantages / (groups.std(dim=1, keepdim=True) + eps)
    uniform = (groups == groups[:, :1]).all(dim=1, keepdim=True)
    return torch.where(uniform, torch.zeros_like(advantages), advantages).view(-1)


def k3_kl(logps: Tensor, ref_logps: Tensor) -> Tensor:
    """Per-token k3 estimate of KL(policy || reference): exp(ref - logp) - (ref - logp) - 1 (Schulman, 2020,
    "Approximating KL divergence"; TRL's per_token_kl). Unbiased for tokens sampled from the policy, and never
    negative since e^x >= 1 + x, so the penalty cannot reward drifting away from the reference."""
    delta = ref_logps - logps
    return torch.exp(delta) - delta - 1


def clipped_objective(ratio: Tensor, advantages: Tensor, eps_low: float, eps_high: float) -> Tensor:
    """Per-token PPO surrogate min(ratio * A, clip(ratio, 1 - eps_low, 1 + eps_high) * A), to be maximised.
    The min makes the clip one-sided in effect: it only removes the incentive to push a ratio further in the
    direction A already favours, so a token past the bound on its advantage's side has zero gradient, while one
    that moved the wrong way keeps its full gradient. eps_high > eps_low is DAPO's clip-higher (0.2 / 0.28),
    room for unlikely tokens with a positive advantage to grow, against entropy collapse."""
    a = advantages.unsqueeze(1)
    return torch.min(ratio * a, ratio.clamp(1 - eps_low, 1 + eps_high) * a)


def aggregate(per_token_loss: Tensor, mask: Tensor, loss_type: str, max_completion_length: int | None = None,
              num_items_in_batch: float | Tensor | None = None) -> Tensor:
    """One scalar from per-token losses (B, T) over the completion tokens `mask` marks, TRL 1.16's formulas (see the
    module docstring). Rows with no completion token count in grpo's mean over sequences and add zero, as in TRL.

    TRL divides grpo, bnpo and dr_grpo by the gradient-accumulation steps itself; here that is the caller's job,
    so these return TRL's logged `policy_loss`. dapo needs no such division: `num_items_in_batch` is already the
    completion-token count of the whole optimiser step (TRL's num_items_in_batch, summed over the generation batch,
    with steps_per_generation equal to gradient_accumulation_steps as by default; under data parallelism whose
    gradients are averaged over P ranks, pass the global count / P, as TRL does). Left None it is this batch's own
    count, and dapo equals bnpo.
    """
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"unknown loss_type {loss_type!r}; choose one of {', '.join(LOSS_TYPES)}")
    masked = per_token_loss * mask
    if loss_type == "grpo":
        return (masked.sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    if loss_type == "bnpo":
        return masked.sum() / mask.sum().clamp(min=1.0)
    if loss_type == "dr_grpo":
        if max_completion_length is None or max_completion_length < 1:
            raise ValueError(f"dr_grpo needs max_completion_length >= 1, got {max_completion_length}")
        if mask.sum(-1).max() > max_completion_length:
            raise ValueError(f"a row has more than max_completion_length={max_completion_length} completion tokens")
        return masked.sum() / (per_token_loss.size(0) * max_completion_length)
    if num_items_in_batch is None:
        num_items_in_batch = mask.sum()
    # No check against this batch's own count: under data parallelism global / P can be below a long rank's count.
    normaliser = torch.as_tensor(num_items_in_batch, dtype=masked.dtype, device=masked.device)
    return masked.sum() / normaliser.clamp(min=1.0)


def masked_mean(x: Tensor, mask: Tensor) -> float:
    """Mean of x over the masked tokens, 0 when there are none: TRL's global_masked_mean on one process."""
    return ((x * mask).sum() / mask.sum().clamp(min=1.0)).item()


def clip_metrics(ratio: Tensor, advantages: Tensor, mask: Tensor, eps_low: float, eps_high: float) -> dict[str, float]:
    """TRL's clip_ratio/* logs: the share of completion tokens whose clip was active, i.e. the ratio was past the
    bound on the side the advantage pushes it (past the other side the min keeps the unclipped term). low_min and
    high_max are the smallest and largest per-sequence shares, sequences without completion tokens skipped."""
    a = advantages.unsqueeze(1)
    low = ((ratio < 1 - eps_low) & (a < 0)).to(mask.dtype)
    high = ((ratio > 1 + eps_high) & (a > 0)).to(mask.dtype)
    rows = mask.sum(-1) > 0
    per_row = mask.sum(-1).clamp(min=1.0)
    low_rows, high_rows = ((low * mask).sum(-1) / per_row)[rows], ((high * mask).sum(-1) / per_row)[rows]
    return {
        "clip_ratio/low_mean": masked_mean(low, mask),
        "clip_ratio/low_min": low_rows.min().item() if rows.any() else math.nan,
        "clip_ratio/high_mean": masked_mean(high, mask),
        "clip_ratio/high_max": high_rows.max().item() if rows.any() else math.nan,
        "clip_ratio/region_mean": masked_mean(torch.maximum(low, high), mask),
    }


def policy_loss(logps: Tensor, old_logps: Tensor, advantages: Tensor, mask: Tensor, eps_low: float, eps_high: float,
                ref_logps: Tensor | None = None, beta: float = 0.0, loss_type: str = "dapo",
                max_completion_length: int | None = None, num_items_in_batch: float | Tensor | None = None,
                ) -> tuple[Tensor, dict[str, float]]:
    """(loss, metrics) of GRPO's clipped surrogate with an optional k3 KL penalty, as TRL 1.16's `_compute_loss`
    with importance_sampling_level="token", delta=None and no vLLM correction.

    logps (B, T): log-probs of the sampled completion tokens under the policy being trained (with grad);
    old_logps (B, T): under the policy that sampled them (detached here: passing `logps` itself is the on-policy
    case, ratio 1, gradient -A * grad logp); ref_logps (B, T): under the frozen reference, needed when beta != 0;
    advantages (B,); mask (B, T): 1 on completion tokens, 0 on prompt and padding. Per-token loss =
    -clipped_objective + beta * k3_kl, aggregated by `loss_type` (see `aggregate` for max_completion_length and
    num_items_in_batch). Metrics carry TRL's names: clip_ratio/{low_mean, low_min, high_mean, high_max,
    region_mean}, and kl (masked mean of k3) when ref_logps is given.
    """
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"unknown loss_type {loss_type!r}; choose one of {', '.join(LOSS_TYPES)}")
    if logps.dim() != 2:
        raise ValueError(f"logps must be (B, T), got shape {tuple(logps.shape)}")
    named = {"old_logps": old_logps, "mask": mask} | ({"ref_logps": ref_logps} if ref_logps is not None else {})
    for name, t in named.items():
        if t.shape != logps.shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)}, logps {tuple(logps.shape)}")
    if advantages.shape != logps.shape[:1]:
        raise ValueError(f"advantages must be ({logps.size(0)},), got shape {tuple(advantages.shape)}")
    if not 0 <= eps_low < 1 or eps_high < 0:
        raise ValueError(f"need 0 <= eps_low < 1 and eps_high >= 0, got {eps_low}, {eps_high}")
    if beta != 0.0 and ref_logps is None:
        raise ValueError("beta != 0 needs ref_logps")

    keep = mask.bool()
    weights = keep.to(logps.dtype)
    # Padding positions may hold anything (a pad token's log-prob, -inf); zeroed before any arithmetic so that
    # neither the loss nor its gradient can pick up a NaN from them (0 * NaN is NaN).
    logps = torch.where(keep, logps, torch.zeros_like(logps))
    old_logps = torch.where(keep, old_logps.detach(), torch.zeros_like(logps))
    ratio = torch.exp(logps - old_logps)
    per_token_loss = -clipped_objective(ratio, advantages.detach().to(logps.dtype), eps_low, eps_high)
    metrics = clip_metrics(ratio.detach(), advantages, weights, eps_low, eps_high)
    if ref_logps is not None:
        kl = k3_kl(logps, torch.where(keep, ref_logps.detach(), torch.zeros_like(logps)))
        metrics["kl"] = masked_mean(kl.detach(), weights)
        if beta != 0.0:
            per_token_loss = per_token_loss + beta * kl
    loss = aggregate(per_token_loss, weights, loss_type, max_completion_length, num_items_in_batch)
    return loss, metrics
