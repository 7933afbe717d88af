"""The engine's batched sampler: each row's distribution against a float64 reference of temperature, top-k and
top-p, the exponential race's draws against that distribution (chi-square), greedy rows, seeded rows, and the
counter-based noise: its hash bit for bit, Exp(1) in distribution, independent across keys and positions."""

import math

import numpy as np
import pytest
import torch

from kiln.model.generate import batched_probs
from kiln.pipeline.serve.request import SamplingParams
from kiln.pipeline.serve.sampler import exponentials, mix, sample


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


def settings(params: list[SamplingParams], vocab: int, keys: list[int] | None = None,
             position: int = 0) -> dict[str, np.ndarray]:
    """The rows' settings as the runner keeps them on the host; row i's key keys[i] (default i)."""
    return {"temperature": np.array([p.temperature for p in params], dtype=np.float32),
            "top_k": np.array([p.top_k or vocab for p in params], dtype=np.int64),
            "top_p": np.array([1.0 if p.top_p is None else p.top_p for p in params], dtype=np.float32),
            "sample_keys": np.array(keys if keys is not None else range(len(params)), dtype=np.int64),
            "sample_positions": np.full(len(params), position, dtype=np.int64)}


def drawn(logits: torch.Tensor, host: dict[str, np.ndarray]) -> torch.Tensor:
    """`sample` as the runner calls it: the host's settings, and the same arrays as tensors on the device."""
    return sample(logits, host, {name: torch.from_numpy(a) for name, a in host.items()})


@pytest.mark.parametrize(("top_k", "top_p"), [(8, 0.95), (None, None)])
def test_draws_follow_the_distribution_and_greedy_rows_take_the_argmax(top_k, top_p):
    torch.manual_seed(0)
    vocab, n = 12, 40_000
    row = torch.randn(vocab) * 2
    want = reference_probs(row, 0.8, top_k, top_p)
    params = [SamplingParams(1, 0.8, top_k, top_p)] * n + [SamplingParams(1)]  # the last row greedy
    logits = row.expand(n + 1, vocab).clone()
    tokens = drawn(logits, settings(params, vocab))  # n keys: n independent draws
    assert tokens[-1].item() == row.argmax().item()
    counts = np.bincount(tokens[:-1].numpy(), minlength=vocab)
    support = want.numpy() > 0
    assert counts[~support].sum() == 0, "a token outside top-k/top-p was drawn"
    expected = want.numpy()[support] * n
    statistic = float(((counts[support] - expected) ** 2 / expected).sum())
    df = int(support.sum()) - 1
    # the chi-square survival function: a correct sampler fails one seed in a thousand
    assert torch.special.gammaincc(torch.tensor(df / 2), torch.tensor(statistic / 2)).item() > 1e-3, statistic


def test_a_row_draws_the_same_whatever_shares_its_batch():
    torch.manual_seed(1)
    row = torch.randn(1, 30)

    def draw(batch: int, others_seed: int, position: int = 5) -> int:
        torch.manual_seed(others_seed)
        logits = torch.cat([row, torch.randn(batch - 1, 30)])
        params = [SamplingParams(1, 1.0)] * batch
        keys = [7] + torch.randint(-2**62, 2**62, (batch - 1,)).tolist()
        return drawn(logits, settings(params, 30, keys, position))[0].item()

    assert len({draw(b, s) for b, s in [(1, 0), (4, 1), (9, 2)]}) == 1
    assert len({draw(1, 0, position) for position in range(40)}) > 3  # a new position, a new draw


def test_an_all_greedy_step_is_the_argmax():
    logits = torch.randn(5, 11)
    assert sample(logits, None, {}).tolist() == logits.argmax(-1).tolist()


def splitmix64_finalizer(x: int) -> int:
    """Vigna's reference, in Python's unbounded integers masked to 64 bits."""
    m = (1 << 64) - 1
    x &= m
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & m
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & m
    return x ^ (x >> 31)


def fmix32(x: int) -> int:
    """murmur3's 32-bit finalizer, in Python's integers masked to 32 bits."""
    m = (1 << 32) - 1
    x &= m
    x = ((x ^ (x >> 16)) * 0x85EBCA6B) & m
    x = ((x ^ (x >> 13)) * 0xC2B2AE35) & m
    return x ^ (x >> 16)


def test_the_noise_is_its_hash_bit_for_bit():
    """Each exponential is -log(u) for u the top 23 bits of fmix32(row + fmix32((v + 1) * golden32)), row the low
    32 bits of splitmix64(key + position * golden64): recomputed in Python's unbounded integers, so a wrap or a
    shift the tensors got wrong (int64 to int32, arithmetic shifts) shows."""
    keys, positions, vocab = [0, 7, -3, (1 << 63) - 1, -(1 << 63)], [0, 5, 1 << 20, 3, 9], 37
    got = exponentials(torch.tensor(keys), torch.tensor(positions), vocab)
    for r, (key, position) in enumerate(zip(keys, positions)):
        row = splitmix64_finalizer(key + position * 0x9E3779B97F4A7C15) & 0xFFFFFFFF
        for v in range(vocab):
            u = ((fmix32(row + fmix32((v + 1) * 0x9E3779B9)) >> 9) + 0.5) * 2.0 ** -23
            assert got[r, v].item() == pytest.approx(-math.log(u), rel=1e-6), (r, v)


def test_the_mixer_is_splitmix64_bit_for_bit():
    values = [0, 1, 2, 3, -1, 1 << 40, -(1 << 63), (1 << 63) - 1, 0x1234_5678_9ABC_DEF0, -0x0FED_CBA9_8765_4321]
    got = mix(torch.tensor(values, dtype=torch.int64)).tolist()
    assert [g & ((1 << 64) - 1) for g in got] == [splitmix64_finalizer(v) for v in values]


def test_the_noise_is_exponential_and_independent_across_keys_positions_and_tokens():
    vocab = 4096
    noise = exponentials(torch.tensor([0, 1, 0, -5]), torch.tensor([0, 0, 1, 0]), vocab).double()
    assert noise.min() > 0 and torch.isfinite(noise).all()
    # Exp(1): mean 1 and variance 1, each row alone (4,096 draws: standard errors 0.016 and 0.04)
    assert (noise.mean(1) - 1).abs().max() < 0.07 and (noise.var(1) - 1).abs().max() < 0.25
    # Kolmogorov-Smirnov against Exp(1) over all 16,384 draws: 1.63 / sqrt(n) is the 1 % critical value
    values = noise.flatten().sort().values
    cdf = 1 - torch.exp(-values)
    n = len(values)
    ks = torch.maximum(torch.arange(1, n + 1) / n - cdf, cdf - torch.arange(n) / n).max()
    assert ks < 1.63 / n ** 0.5, ks
    # rows of other keys or positions are not shifted copies: their correlation is noise-sized (1 / sqrt(4096))
    centred = noise - noise.mean(1, keepdim=True)
    correlation = (centred @ centred.T) / (centred.norm(dim=1)[:, None] * centred.norm(dim=1)[None, :])
    assert (correlation - torch.eye(4)).abs().max() < 0.07


@pytest.mark.parametrize("top_p", [1e-300, 1e-45, 1e-30])
def test_a_top_p_that_underflows_float32_keeps_the_top_token(top_p):
    """`top_p: 1e-300` (the server) and `--top-p 1e-300` (generate) gave empty completions: in float32 it is 0,
    every token was dropped and nothing was left to sample. The top token always stays: the draw is the argmax."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(4, 33, generator=g) * 2
    got = batched_probs(logits, torch.ones(4), torch.full((4,), 33), torch.full((4,), top_p))
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, torch.nn.functional.one_hot(logits.argmax(-1), 33).float())
    for i in range(4):
        torch.testing.assert_close(got[i].double(), reference_probs(logits[i], 1.0, None, top_p))
    assert torch.equal(drawn(logits, settings([SamplingParams(4, 1.0, top_p=top_p)] * 4, 33)), logits.argmax(-1))
