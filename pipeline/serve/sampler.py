"""Every request's next token from one batch of logits, on the device, each with its own sampling.

A row is greedy (temperature 0: the argmax) or sampled from the softmax of logits / temperature, restricted to its
top_k tokens and then to the smallest set holding top_p of the mass: what `model.generate.sampling_probs` gives
one row, here with a temperature, top_k and top_p per row. A sampled row draws by the exponential race: with
E_v ~ Exp(1) independent, argmax_v p_v / E_v is distributed as p (vLLM's sampler does the same), so no
multinomial call and no host round trip per row. A request with a seed owns a generator that fills its row of
exponentials alone, so what it draws depends on its own logits and seed, never on which requests share its step.
"""

from __future__ import annotations

import torch


def batched_probs(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                  top_p: torch.Tensor) -> torch.Tensor:
    """The distribution of each row (R, V): temperature (R,) > 0; top_k (R,) of at least 1, the vocabulary meaning
    no cut; top_p (R,) in (0, 1], 1 meaning no cut."""
    logits = logits.float() / temperature[:, None]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    vocab = logits.size(-1)
    # top_k: keep what is at least the k-th largest, ties with it included (as sampling_probs' topk threshold)
    kth = sorted_logits.gather(-1, (top_k.clamp(1, vocab) - 1)[:, None])
    sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    # top_p: drop a token once the tokens ranked above it already hold top_p; the top token always stays
    drop = (probs.cumsum(dim=-1) - probs >= top_p[:, None]) & (top_p < 1)[:, None]
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits).softmax(dim=-1)


def sample(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
           generators: list[torch.Generator | None], any_sampled: bool) -> torch.Tensor:
    """The next token of each row (R,), int64 on the logits' device: the argmax where temperature is 0, a draw
    from `batched_probs` elsewhere, row i's exponentials from generators[i] when it has one. `any_sampled`, known
    on the host, skips the sampling arithmetic for an all-greedy step."""
    greedy = logits.argmax(dim=-1)
    if not any_sampled:
        return greedy
    sampled = temperature > 0
    probs = batched_probs(logits, torch.where(sampled, temperature, torch.ones_like(temperature)), top_k, top_p)
    race = torch.empty_like(probs).exponential_()
    for i, generator in enumerate(generators):
        if generator is not None:
            race[i].exponential_(generator=generator)
    # an exponential of exactly 0 would make 0 / 0 = NaN, which argmax takes for the largest
    race.clamp_(min=torch.finfo(race.dtype).tiny)
    return torch.where(sampled, (probs / race).argmax(dim=-1), greedy)
