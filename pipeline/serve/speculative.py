"""Speculative sampling's acceptance rule (Leviathan et al. 2023; Chen et al. 2023): which of a draft model's k
proposed tokens the target keeps, so that what comes out is distributed exactly as the target's own samples.

The draft proposes x_1..x_k, each drawn from its distribution q_i; one forward of the target over them gives
p_1..p_{k+1}. Token x_i is kept with probability min(1, p_i(x_i) / q_i(x_i)); at the first rejection a
replacement is drawn from the residual max(0, p_i - q_i) (renormalised) and the rest are dropped; if all k are
kept, a bonus token is drawn from p_{k+1}. Each step thus yields between 1 and k + 1 tokens, and every token
has the target's distribution given the ones before it (the papers' theorem; tests/test_serve_speculative.py
checks it with a chi-square test). Greedy decoding is the limit of one-hot distributions: a draft token is
kept when it is the target's argmax, and the first one that is not becomes that argmax, so the output is
exactly the target's greedy output.
"""

from __future__ import annotations

import torch


def accept(target_probs: torch.Tensor, draft_probs: torch.Tensor, drafted: list[int],
           generator: torch.Generator | None = None) -> list[int]:
    """The tokens this step yields: a kept prefix of `drafted` (k tokens) and one more from the target.
    `target_probs` (k + 1, V) and `draft_probs` (k, V) are the distributions the tokens were (or would be)
    sampled from, after temperature, top-k and top-p."""
    out = []
    for i, token in enumerate(drafted):
        p, q = target_probs[i, token], draft_probs[i, token]
        u = torch.rand((), generator=generator, device=target_probs.device)
        if u * q < p:  # kept with probability min(1, p / q); q > 0, since the draft drew this token
            out.append(token)
            continue
        residual = (target_probs[i] - draft_probs[i]).clamp(min=0)
        if residual.sum() <= 0:  # p == q up to rounding: the rejection had probability ~0; p itself is right
            residual = target_probs[i]
        out.append(int(torch.multinomial(residual, 1, generator=generator)))
        return out
    out.append(int(torch.multinomial(target_probs[len(drafted)], 1, generator=generator)))
    return out


def accept_greedy(target_logits: torch.Tensor, drafted: list[int]) -> list[int]:
    """Greedy: the drafted tokens that match the target's argmax, then the target's argmax where they stop."""
    best = target_logits.argmax(dim=-1).tolist()
    out = []
    for token, want in zip(drafted, best):
        if token != want:
            break
        out.append(token)
    out.append(best[len(out)])
    return out
