"""Every request's next token from one batch of logits, on the device, each with its own sampling.

A row is greedy (temperature 0: the argmax) or sampled from the softmax of logits / temperature, restricted to its
top_k tokens and then to the smallest set holding top_p of the mass (`model.generate.batched_probs`, with a
temperature, top_k and top_p per row). A sampled row draws by the exponential race: with
E_v ~ Exp(1) independent, argmax_v p_v / E_v is distributed as p (vLLM's sampler does the same), so no
multinomial call and no host round trip per row.

The exponentials are counter-based: E for (key, position, token) is a hash of the three (splitmix64's mixer)
turned into a uniform, the way vLLM's newer model runner seeds its Gumbel noise per request. A row's draw so
depends on its own key (its seed, or a random one given to an unseeded request once), the position it draws
for and its logits, never on which requests share its step, and a whole batch's noise is one set of tensor
ops rather than a generator call per seeded row.
"""

from __future__ import annotations

import torch

from kiln.model.generate import batched_probs
from kiln.pipeline.serve.request import SamplingParams


def _int64(value: int) -> int:
    """An unsigned 64-bit constant as the int64 with the same bits."""
    return value - (1 << 64) if value >= 1 << 63 else value


# splitmix64 (Steele, Lea and Flood 2014; Vigna's constants): the golden-ratio increment and the two multipliers
GOLDEN, MIX1, MIX2 = _int64(0x9E3779B97F4A7C15), _int64(0xBF58476D1CE4E5B9), _int64(0x94D049BB133111EB)
UNIFORM_BITS = 23  # bits + 0.5 is then exact in float32's 24-bit significand: u is never 0 or 1


def _shift(x: torch.Tensor, bits: int) -> torch.Tensor:
    """x >> bits on the 64 bits as unsigned (torch shifts int64 arithmetically)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def mix(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finalizer on int64 tensors (products wrap modulo 2^64, as the unsigned ones do)."""
    x = (x ^ _shift(x, 30)) * MIX1
    x = (x ^ _shift(x, 27)) * MIX2
    return x ^ _shift(x, 31)


def exponentials(keys: torch.Tensor, positions: torch.Tensor, vocab: int) -> torch.Tensor:
    """(R, vocab) float32 Exp(1) draws, row r's from (keys[r], positions[r]) alone: token v's is -log(u) for u the
    top 23 bits of mix(mix(key + GOLDEN * position) + GOLDEN * (v + 1)), as a uniform in (0, 1)."""
    row = mix(keys + positions * GOLDEN)
    tokens = torch.arange(1, vocab + 1, device=keys.device, dtype=torch.int64) * GOLDEN
    bits = _shift(mix(row[:, None] + tokens), 64 - UNIFORM_BITS)
    return -torch.log((bits.float() + 0.5) * 2.0 ** -UNIFORM_BITS)


def sample(logits: torch.Tensor, params: list[SamplingParams], on_device: dict[str, torch.Tensor]) -> torch.Tensor:
    """The next token of each row (R,), int64 on the logits' device: the argmax where temperature is 0, a draw
    from `batched_probs` elsewhere. `params` are the rows' settings as the host has them, which spare device work
    (no sort without a top-k or top-p cut); `on_device` holds them as tensors when some row samples (temperature,
    top_k with the vocabulary for none, top_p with 1 for none) and each row's key and the position it draws for
    (`sample_keys`, `sample_positions`, int64)."""
    greedy = logits.argmax(dim=-1)
    sampled_rows = [i for i, p in enumerate(params) if p.temperature > 0]
    if not sampled_rows:
        return greedy
    vocab = logits.size(-1)
    sampled = on_device["temperature"] > 0
    temperature = torch.where(sampled, on_device["temperature"], torch.ones_like(on_device["temperature"]))
    if any((params[i].top_k or vocab) < vocab or (params[i].top_p or 1.0) < 1 for i in sampled_rows):
        probs = batched_probs(logits, temperature, on_device["top_k"], on_device["top_p"])
    else:
        probs = (logits.float() / temperature[:, None]).softmax(dim=-1)
    race = exponentials(on_device["sample_keys"], on_device["sample_positions"], vocab)
    return torch.where(sampled, (probs / race).argmax(dim=-1), greedy)
