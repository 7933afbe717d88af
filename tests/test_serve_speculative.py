"""Speculative sampling's acceptance rule keeps the target's distribution: a chi-square test on a 5-token
vocabulary, position by position; greedy acceptance is the target's argmax."""

from __future__ import annotations

import torch

from kiln.pipeline.serve.speculative import accept, accept_greedy

# chi-square critical value, 4 degrees of freedom, p = 0.001: a correct rule fails one seed in a thousand
CRITICAL = 18.467


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs.double() * counts.sum()
    return float(((counts.double() - expected) ** 2 / expected).sum())


def test_kept_and_replaced_tokens_follow_the_target_distribution():
    g = torch.Generator().manual_seed(0)
    V, k, trials = 5, 3, 20000
    # the draft favours what the target does not: many rejections, and a wrong replacement rule shows
    base = torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05])
    target = torch.stack([base.roll(i) for i in range(k + 1)])
    draft = torch.stack([base.flip(0).roll(i) for i in range(k)])
    counts = torch.zeros(k + 1, V)
    lengths = torch.zeros(k + 2)
    for _ in range(trials):
        drafted = [int(torch.multinomial(draft[i], 1, generator=g)) for i in range(k)]
        out = accept(target, draft, drafted, g)
        lengths[len(out)] += 1
        for position, token in enumerate(out):
            counts[position, token] += 1
    for position in range(k + 1):  # every position reached, whichever way its token came
        assert counts[position].sum() > 500
        assert chi_square(counts[position], target[position]) < CRITICAL, position
    # the rule did reject (so the residual path was tested) and did accept whole drafts (so was the bonus)
    assert lengths[1] > 1000 and lengths[k + 1] > 100


def test_a_draft_equal_to_the_target_is_always_kept():
    g = torch.Generator().manual_seed(1)
    probs = torch.softmax(torch.randn(4, 7, generator=g), dim=-1)
    for _ in range(200):
        drafted = [int(torch.multinomial(probs[i], 1, generator=g)) for i in range(3)]
        assert accept(probs, probs[:3], drafted, g)[:3] == drafted


def test_greedy_acceptance_is_the_target_argmax():
    logits = torch.tensor([[0.0, 5.0, 1.0], [3.0, 0.0, 1.0], [0.0, 0.0, 9.0], [2.0, 1.0, 0.0]])  # argmax 1,0,2,0
    assert accept_greedy(logits, [1, 0, 2]) == [1, 0, 2, 0]  # all kept, then the bonus
    assert accept_greedy(logits, [1, 2, 2]) == [1, 0]  # the second differs: the target's token instead
    assert accept_greedy(logits, [0, 0, 2]) == [1]
