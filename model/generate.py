"""Autoregressive sampling with a KV cache: prefill the prompt once, then feed one token per step.

Prompts are batched by length: prompts of the same length share every position, so one scalar `pos` and
the model's plain causal masks are exactly right, with no left-padding, per-row positions or padding masks
to get subtly wrong. Prompts of different lengths run as separate batches (a loop over lengths), which
costs speed only when a call mixes many lengths.

Stop tokens are kept: a row that stopped ends with its stop id, so the caller can tell "stopped" from
"ran out of max_new_tokens" and strip it if unwanted.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

import torch

from model.gpt import GPT, KVCache


def sample_next(logits: torch.Tensor, temperature: float = 1.0, top_k: int | None = None,
                top_p: float | None = None, generator: torch.Generator | None = None) -> torch.Tensor:
    """One token id per row of logits (B, V): greedy at temperature 0, else sampled from the softmax of
    logits/temperature restricted to the top_k tokens, then to the smallest set holding top_p of the mass."""
    if temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits.float() / temperature
    if top_k is not None and top_k < logits.size(-1):
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        # Drop a token once the tokens ranked above it already hold top_p; the top token always stays.
        drop = probs.cumsum(dim=-1) - probs >= top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    probs = logits.softmax(dim=-1)
    return torch.multinomial(probs, num_samples=1, generator=generator).squeeze(-1)


def generate(model: GPT, prompt_ids: Sequence[Sequence[int]], max_new_tokens: int, *, temperature: float = 1.0,
             top_k: int | None = None, top_p: float | None = None, stop_ids: Iterable[int] = (),
             seed: int | None = None) -> list[list[int]]:
    """The new tokens for each prompt (at most max_new_tokens, ending early after a stop id, which is kept).

    `seed` makes a call reproducible (same prompts, same arguments, same device); the draws depend on how
    prompts group by length, so sampled output is not the same as one call per prompt. Greedy output is.
    The model is put in eval mode for the call and restored after. Prompt plus new tokens, less the last
    one (which is never fed back), must fit in max_seq_len.
    """
    config = model.config
    stop_ids = sorted(set(stop_ids))
    _check_args(config, prompt_ids, max_new_tokens, temperature, top_k, top_p, stop_ids)
    param = next(model.parameters())
    generator = None
    if seed is not None:
        generator = torch.Generator(device=param.device).manual_seed(seed)

    by_length: dict[int, list[int]] = {}
    for i, prompt in enumerate(prompt_ids):
        by_length.setdefault(len(prompt), []).append(i)
    out: list[list[int]] = [[] for _ in prompt_ids]
    was_training = model.training
    model.eval()
    try:
        with torch.inference_mode():
            for rows in by_length.values():
                prompts = torch.tensor([list(prompt_ids[i]) for i in rows], dtype=torch.long, device=param.device)
                new = _generate_batch(model, prompts, max_new_tokens, temperature, top_k, top_p, stop_ids,
                                      generator, param.dtype)
                for i, tokens in zip(rows, new):
                    out[i] = tokens
    finally:
        model.train(was_training)
    return out


def _generate_batch(model, prompts, max_new_tokens, temperature, top_k, top_p, stop_ids, generator, dtype):
    """Prompts (B, L) of one length -> list of B token lists."""
    if max_new_tokens == 0:
        return [[] for _ in range(len(prompts))]
    steps = _decode(model, prompts, max_new_tokens, temperature, top_k, top_p, stop_ids, generator, dtype)
    rows = torch.stack(list(steps), dim=1).tolist()
    stops = set(stop_ids)
    for r, tokens in enumerate(rows):
        end = next((j + 1 for j, t in enumerate(tokens) if t in stops), len(tokens))
        rows[r] = tokens[:end]
    return rows


def _decode(model, prompts, max_new_tokens, temperature, top_k, top_p, stop_ids, generator,
            dtype) -> Iterator[torch.Tensor]:
    """Prefill prompts (B, L), then yield one new token per row (B,) per step until every row has stopped."""
    B, L = prompts.shape
    cache = KVCache(model.config, B, L + max_new_tokens - 1, prompts.device, dtype)
    stop = torch.tensor(stop_ids, dtype=torch.long, device=prompts.device)
    done = torch.zeros(B, dtype=torch.bool, device=prompts.device)
    logits = model(prompts, cache=cache, pos=0)[:, -1]
    for step in range(max_new_tokens):
        token = sample_next(logits, temperature, top_k, top_p, generator)
        yield token
        done |= torch.isin(token, stop)
        if step == max_new_tokens - 1 or bool(done.all()):
            return
        # Rows that already stopped keep decoding (their extra tokens are cut by the caller): the batch stays whole.
        logits = model(token[:, None], cache=cache, pos=L + step)[:, -1]


@torch.inference_mode()
def stream(model: GPT, prompt_ids: Sequence[int], max_new_tokens: int, *, temperature: float = 1.0,
           top_k: int | None = None, top_p: float | None = None, stop_ids: Iterable[int] = (),
           seed: int | None = None) -> Iterator[int]:
    """The new tokens of one prompt as they are sampled (for a chat that prints as it goes); the same tokens
    as `generate` for that prompt alone. The model must be in eval mode."""
    stop_ids = sorted(set(stop_ids))
    _check_args(model.config, [prompt_ids], max_new_tokens, temperature, top_k, top_p, stop_ids)
    param = next(model.parameters())
    generator = None if seed is None else torch.Generator(device=param.device).manual_seed(seed)
    prompt = torch.tensor([list(prompt_ids)], dtype=torch.long, device=param.device)
    if max_new_tokens == 0:
        return
    for token in _decode(model, prompt, max_new_tokens, temperature, top_k, top_p, stop_ids, generator, param.dtype):
        yield int(token[0])


def _check_args(config, prompt_ids, max_new_tokens, temperature, top_k, top_p, stop_ids) -> None:
    if not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens: must be an int >= 0, got {max_new_tokens!r}")
    if not temperature >= 0:
        raise ValueError(f"temperature: must be >= 0, got {temperature!r}")
    if top_k is not None and (not isinstance(top_k, int) or top_k < 1):
        raise ValueError(f"top_k: must be None or an int >= 1, got {top_k!r}")
    if top_p is not None and not 0 < top_p <= 1:
        raise ValueError(f"top_p: must be None or in (0, 1], got {top_p!r}")
    if any(not 0 <= t < config.vocab_size for t in stop_ids):
        raise ValueError(f"stop_ids: {stop_ids} has ids outside [0, vocab_size={config.vocab_size})")
    if len(prompt_ids) == 0:
        raise ValueError("prompt_ids: no prompts")
    for i, prompt in enumerate(prompt_ids):
        if len(prompt) == 0:
            raise ValueError(f"prompt_ids[{i}]: empty prompt")
        if any(not 0 <= t < config.vocab_size for t in prompt):
            raise ValueError(f"prompt_ids[{i}]: ids outside [0, vocab_size={config.vocab_size})")
        if len(prompt) + max_new_tokens - 1 > config.max_seq_len:
            raise ValueError(f"prompt_ids[{i}]: {len(prompt)} prompt tokens + max_new_tokens={max_new_tokens} - 1 "
                             f"(the last new token is never fed back) exceed max_seq_len={config.max_seq_len}")
