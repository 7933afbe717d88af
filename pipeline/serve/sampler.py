"""Every request's next token from one batch of logits, on the device, each with its own sampling.

A row is greedy (temperature 0: the argmax) or sampled from the softmax of logits / temperature, restricted to its
top_k tokens and then to the smallest set holding top_p of the mass (`model.generate.batched_probs`, with a
temperature, top_k and top_p per row). A sampled row draws by the exponential race: with
E_v ~ Exp(1) independent, argmax_v p_v / E_v is distributed as p (vLLM's sampler does the same), so no
multinomial call and no host round trip per row. A request with a seed owns a generator that fills its row of
exponentials alone, so what it draws depends on its own logits and seed, never on which requests share its step.
"""

from __future__ import annotations

import torch

from kiln.model.generate import batched_probs
from kiln.pipeline.serve.request import SamplingParams


def sample(logits: torch.Tensor, params: list[SamplingParams], on_device: dict[str, torch.Tensor],
           generators: list[torch.Generator | None]) -> torch.Tensor:
    """The next token of each row (R,), int64 on the logits' device: the argmax where temperature is 0, a draw
    from `batched_probs` elsewhere, row i's exponentials from generators[i] when it has one. `params` are the
    rows' settings as the host has them, which spare device work (no sort without a top-k or top-p cut, no
    shared draws when every sampled row has its own generator); `on_device` holds them as tensors
    (temperature, top_k with the vocabulary for none, top_p with 1 for none) when some row samples."""
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
    race = torch.empty_like(probs)
    if any(generators[i] is None for i in sampled_rows):
        race.exponential_()
    for i in sampled_rows:
        if generators[i] is not None:
            race[i].exponential_(generator=generators[i])
    # an exponential of exactly 0 would make 0 / 0 = NaN, which argmax takes for the largest
    race.clamp_(min=torch.finfo(race.dtype).tiny)
    return torch.where(sampled, (probs / race).argmax(dim=-1), greedy)
