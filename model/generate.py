"""Autoregressive sampling with a preallocated KV cache: prefill the prompts once, then feed one token per step.

Prompts of different lengths share one batch by left padding: each row's prompt ends in the same cache slot,
so every step feeds one token per row at one slot index, and the model's `pad` argument gives each row its
own positions and hides its padding from attention. A row then computes exactly what it would alone.

`cache=False` recomputes the whole sequence at every step instead (the same tokens, greedily): the reference
the cache is tested against and the baseline `kiln bench generate` measures it against.

Stop tokens are kept: a row that stopped ends with its stop id, so the caller can tell "stopped" from
"ran out of max_new_tokens" and strip it if unwanted.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

import torch

from kiln.model.gpt import GPT, KVCache
from kiln.model.modes import evaluating


def sample_next(logits: torch.Tensor, temperature: float = 1.0, top_k: int | None = None,
                top_p: float | None = None, generator: torch.Generator | None = None) -> torch.Tensor:
    """One token id per row of logits (B, V): greedy at temperature 0, else drawn from `sampling_probs`."""
    if temperature == 0:
        return logits.argmax(dim=-1)
    probs = sampling_probs(logits, temperature, top_k, top_p)
    return torch.multinomial(probs, num_samples=1, generator=generator).squeeze(-1)


def sampling_probs(logits: torch.Tensor, temperature: float, top_k: int | None = None,
                   top_p: float | None = None) -> torch.Tensor:
    """The distribution a row of logits (B, V) is sampled from at temperature > 0: the softmax of
    logits/temperature restricted to the top_k tokens, then to the smallest set holding top_p of the mass."""
    rows, vocab = logits.shape
    if (top_k is None or top_k >= vocab) and (top_p is None or top_p >= 1.0):  # nothing to cut: no sort
        return (logits.float() / temperature).softmax(dim=-1)
    return batched_probs(logits, torch.full((rows,), float(temperature), device=logits.device),
                         torch.full((rows,), top_k or vocab, device=logits.device),
                         torch.full((rows,), 1.0 if top_p is None else float(top_p), device=logits.device))


def batched_probs(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                  top_p: torch.Tensor) -> torch.Tensor:
    """The distribution of each row (R, V): temperature (R,) > 0; top_k (R,) of at least 1, the vocabulary meaning
    no cut; top_p (R,) in (0, 1], 1 meaning no cut."""
    logits = logits.float() / temperature[:, None]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    vocab = logits.size(-1)
    # top_k: keep what is at least the k-th largest, ties with it included (as torch.topk's threshold would)
    kth = sorted_logits.gather(-1, (top_k.clamp(1, vocab) - 1)[:, None])
    sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    # top_p: drop a token once the tokens ranked above it already hold top_p. The top token (0 above it) always
    # stays, also when top_p underflows to 0 in float32: a top_p of 1e-300 once emptied every row
    floor = torch.finfo(torch.float32).tiny
    drop = (probs.cumsum(dim=-1) - probs >= top_p.clamp_min(floor)[:, None]) & (top_p < 1)[:, None]
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits).softmax(dim=-1)


def generate(model: GPT, prompt_ids: Sequence[Sequence[int]], max_new_tokens: int, *, temperature: float = 1.0,
             top_k: int | None = None, top_p: float | None = None, stop_ids: Iterable[int] = (),
             seed: int | None = None, cache: bool = True) -> list[list[int]]:
    """The new tokens for each prompt (at most max_new_tokens, ending early after a stop id, which is kept).

    `seed` makes a call reproducible (same prompts, same arguments, same device); a row's draws depend on the
    batch it is in, so sampled output is not the same as one call per prompt. Greedy output is. The model is
    put in eval mode for the call and restored after. Prompt plus new tokens, less the last one (which is
    never fed back), must fit in max_seq_len.
    """
    stop_ids = sorted(set(stop_ids))
    _check_args(model.config, prompt_ids, max_new_tokens, temperature, top_k, top_p, stop_ids)
    if max_new_tokens == 0:
        return [[] for _ in prompt_ids]
    generator = _generator(model, seed)
    prompts, pad = left_pad(prompt_ids, next(model.parameters()).device)
    # no_grad, not inference_mode: an FSDP model gathers its weights into buffers it reuses outside the call
    with evaluating(model), torch.no_grad():
        steps = decode_steps(model, prompts, pad, max_new_tokens, temperature, top_k, top_p, stop_ids, generator,
                             cache)
        rows = torch.stack(list(steps), dim=1).tolist()
    stops = set(stop_ids)
    return [tokens[:next((j + 1 for j, t in enumerate(tokens) if t in stops), len(tokens))] for tokens in rows]


def left_pad(prompt_ids: Sequence[Sequence[int]], device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Prompts as one (B, L) tensor, each right-aligned, and the padding of each row (None when there is none:
    the model then takes its plain causal path)."""
    L = max(map(len, prompt_ids))
    pad = [L - len(p) for p in prompt_ids]
    # The pad value is never attended to; 0 is just a valid id for the embedding lookup.
    prompts = torch.tensor([[0] * n + list(p) for n, p in zip(pad, prompt_ids)], dtype=torch.long, device=device)
    return prompts, torch.tensor(pad, device=device) if any(pad) else None


def _generator(model: GPT, seed: int | None) -> torch.Generator | None:
    if seed is None:
        return None
    return torch.Generator(device=next(model.parameters()).device).manual_seed(seed)


def decode_steps(model, prompts, pad, max_new_tokens, temperature, top_k, top_p, stop_ids, generator,
            use_cache=True) -> Iterator[torch.Tensor]:
    """Prefill prompts (B, L), then yield one new token per row (B,) per step until every row has stopped."""
    B, L = prompts.shape
    stop = torch.tensor(stop_ids, dtype=torch.long, device=prompts.device)
    done = torch.zeros(B, dtype=torch.bool, device=prompts.device)
    cache = None
    if use_cache:
        dtype = next(p.dtype for p in model.parameters() if p.is_floating_point())  # not QLoRA's 4-bit codes
        cache = KVCache(model.config, B, L + max_new_tokens - 1, prompts.device, dtype)
    seq = prompts
    logits = model(prompts, cache=cache, pos=0, pad=pad)[:, -1]
    for step in range(max_new_tokens):
        token = sample_next(logits, temperature, top_k, top_p, generator)
        yield token
        done |= torch.isin(token, stop)
        if step == max_new_tokens - 1 or bool(done.all()):
            return
        # Rows that already stopped keep decoding (their extra tokens are cut by the caller): the batch stays whole.
        if use_cache:
            logits = model(token[:, None], cache=cache, pos=L + step, pad=pad)[:, -1]
        else:
            seq = torch.cat([seq, token[:, None]], dim=1)
            logits = model(seq, pad=pad)[:, -1]


@torch.inference_mode()
def stream(model: GPT, prompt_ids: Sequence[int], max_new_tokens: int, *, temperature: float = 1.0,
           top_k: int | None = None, top_p: float | None = None, stop_ids: Iterable[int] = (),
           seed: int | None = None) -> Iterator[int]:
    """The new tokens of one prompt as they are sampled (for a chat that prints as it goes); the same tokens
    as `generate` for that prompt alone. The model must be in eval mode."""
    stop_ids = sorted(set(stop_ids))
    _check_args(model.config, [prompt_ids], max_new_tokens, temperature, top_k, top_p, stop_ids)
    if max_new_tokens == 0:
        return
    prompt = torch.tensor([list(prompt_ids)], dtype=torch.long, device=next(model.parameters()).device)
    for token in decode_steps(model, prompt, None, max_new_tokens, temperature, top_k, top_p, stop_ids,
                         _generator(model, seed)):
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
