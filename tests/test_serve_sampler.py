"""The engine's batched sampler: each row's distribution against a float64 reference of temperature, top-k and
top-p, the exponential race's draws against that distribution (chi-square), greedy rows, seeded rows."""

import numpy as np
import pytest
import torch

from kiln.model.generate import batched_probs
from kiln.pipeline.serve.request import SamplingParams
from kiln.pipeline.serve.sampler import sample


def reference_probs(row: torch.Tensor, temperature: float, top_k: int | None, top_p: float | None) -> torch.Tensor:
    """One row in float64, written out plainly: scale, keep the k largest (ties with the k-th kept), keep the
    smallest prefix of the sorted distribution holding top_p (the top token always), renormalise."""
    logits = row.double() / temperature
    keep = torch.ones_like(logits, dtype=torch.bool)
    if top_k is not None:
        kth = logits.sort(descending=True).values[min(top_k, len(logits)) - 1]
        keep &= logits >= kth
    probs = torch.where(keep, logits, torch.tensor(float("-inf"), dtype=torch.float64)).softmax(-1)
    if top_p is not None and top_p < 1:
        order = probs.argsort(descending=True)
        mass, kept = 0.0, torch.zeros_like(keep)
        for index in order.tolist():
            if mass >= top_p:
                break
            kept[index] = True
            mass += probs[index].item()
        probs = torch.where(kept, probs, torch.zeros_like(probs))
    return probs / probs.sum()


@pytest.mark.parametrize("vocab", [7, 50, 257])
def test_each_row_has_its_own_temperature_top_k_and_top_p(vocab):
    g = torch.Generator().manual_seed(vocab)
    rows = 9
    logits = torch.randn(rows, vocab, generator=g, dtype=torch.float64) * 3
    temperature = torch.rand(rows, generator=g) * 1.5 + 0.2
    top_k = [None, 1, 3, vocab, vocab + 5, None, 2, None, 5]
    top_p = [None, None, 0.5, 0.9, None, 0.99, 1.0, 0.3, 0.7]
    got = batched_probs(logits.float(), temperature, torch.tensor([k or vocab for k in top_k]),
                        torch.tensor([1.0 if p is None else p for p in top_p]))
    for i in range(rows):
        want = reference_probs(logits[i].float(), temperature[i].item(), top_k[i], top_p[i])
        torch.testing.assert_close(got[i].double(), want, atol=1e-6, rtol=1e-5)


def test_top_k_keeps_the_ties_of_its_kth_token():
    logits = torch.tensor([[3.0, 1.0, 2.0, 2.0, 0.0]])
    got = batched_probs(logits, torch.ones(1), torch.tensor([2]), torch.ones(1))[0]
    assert (got > 0).tolist() == [True, False, True, True, False]


def settings(params: list[SamplingParams], vocab: int) -> dict[str, torch.Tensor]:
    """The rows' settings as the runner sends them to the device."""
    return {"temperature": torch.tensor([p.temperature for p in params]),
            "top_k": torch.tensor([p.top_k or vocab for p in params]),
            "top_p": torch.tensor([1.0 if p.top_p is None else p.top_p for p in params])}


@pytest.mark.parametrize(("top_k", "top_p"), [(8, 0.95), (None, None)])
def test_draws_follow_the_distribution_and_greedy_rows_take_the_argmax(top_k, top_p):
    torch.manual_seed(0)
    vocab, n = 12, 40_000
    row = torch.randn(vocab) * 2
    want = reference_probs(row, 0.8, top_k, top_p)
    params = [SamplingParams(1, 0.8, top_k, top_p)] * n + [SamplingParams(1)]  # the last row greedy
    logits = row.expand(n + 1, vocab).clone()
    tokens = sample(logits, params, settings(params, vocab), [None] * (n + 1))
    assert tokens[-1].item() == row.argmax().item()
    counts = np.bincount(tokens[:-1].numpy(), minlength=vocab)
    support = want.numpy() > 0
    assert counts[~support].sum() == 0, "a token outside top-k/top-p was drawn"
    expected = want.numpy()[support] * n
    statistic = float(((counts[support] - expected) ** 2 / expected).sum())
    df = int(support.sum()) - 1
    # the chi-square survival function: a correct sampler fails one seed in a thousand
    assert torch.special.gammaincc(torch.tensor(df / 2), torch.tensor(statistic / 2)).item() > 1e-3, statistic


def test_a_seeded_row_draws_the_same_whatever_shares_its_batch():
    torch.manual_seed(1)
    row = torch.randn(1, 30)

    def draw(batch: int, others_seed: int) -> int:
        torch.manual_seed(others_seed)  # the unseeded rows' randomness
        logits = torch.cat([row, torch.randn(batch - 1, 30)])
        params = [SamplingParams(1, 1.0, seed=7)] + [SamplingParams(1, 1.0)] * (batch - 1)
        generators = [torch.Generator().manual_seed(7)] + [None] * (batch - 1)
        return sample(logits, params, settings(params, 30), generators)[0].item()

    assert len({draw(b, s) for b, s in [(1, 0), (4, 1), (9, 2)]}) == 1
    assert len({draw(1, 0) for _ in range(3)}) == 1


def test_an_all_greedy_step_is_the_argmax():
    logits = torch.randn(5, 11)
    assert sample(logits, [SamplingParams(1)] * 5, {}, [None] * 5).tolist() == logits.argmax(-1).tolist()
