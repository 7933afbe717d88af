"""DPO's loss as plain tensor functions, which the `dpo` stage trains with, kept apart from any model (as GRPO's is
in grpo_loss.py) so each can be checked against hand-computed numbers and against TRL's
`DPOTrainer._compute_loss` (trl 1.16): the sigmoid loss (with conservative DPO's label smoothing), IPO with its
per-length log-ratios, the implicit rewards, and RPO's NLL term on the chosen answers.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def dpo_loss(policy_chosen: torch.Tensor, policy_rejected: torch.Tensor, ref_chosen: torch.Tensor,
             ref_rejected: torch.Tensor, tokens: tuple[torch.Tensor, torch.Tensor], beta: float,
             label_smoothing: float = 0.0, loss: str = "sigmoid") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss per pair, chosen reward, rejected reward) from summed log-probabilities of shape (N,) and the
    answers' lengths `tokens` (chosen, rejected).

    h = (log pi(c) - log ref(c)) - (log pi(r) - log ref(r)), the implicit reward margin over beta.
    sigmoid: -(1 - eps) log sigmoid(beta h) - eps log sigmoid(-beta h)  (eps > 0: conservative DPO, which
    assumes a share eps of the labels are flipped); ipo: (h' - 1 / (2 beta))^2 with h' = h but each log-ratio
    divided by its answer's length, a squared loss that stops pushing once the margin reaches 1/(2 beta)
    instead of driving it to infinity. The rewards are beta times the summed log-ratios for either loss.
    """
    chosen, rejected = policy_chosen - ref_chosen, policy_rejected - ref_rejected
    if loss == "ipo":
        losses = (chosen / tokens[0] - rejected / tokens[1] - 1 / (2 * beta)) ** 2
    else:
        h = chosen - rejected
        losses = -(1 - label_smoothing) * F.logsigmoid(beta * h) - label_smoothing * F.logsigmoid(-beta * h)
    return losses, beta * chosen.detach(), beta * rejected.detach()


def batch_loss(losses: torch.Tensor, policy_chosen: torch.Tensor, chosen_tokens: torch.Tensor,
               sft_weight: float = 0.0) -> torch.Tensor:
    """The mean of the pairs' losses, plus with `sft_weight` (`dpo.sft_weight`) the chosen answers' NLL per token
    over the batch (TRL's loss_type "sft", RPO's term): it keeps DPO from lowering what it prefers."""
    loss = losses.mean()
    if sft_weight:
        loss = loss + sft_weight * -policy_chosen.sum() / chosen_tokens.sum()
    return loss
