"""What a request asks of its next token's logits before the sampler draws, each row its own values.

In vLLM's order: a grammar's allowed tokens (structured outputs, serve/grammar.py: every other token's logit to
-inf), the stop ids held back while the output is shorter than `min_tokens` (-inf), OpenAI's `logit_bias` (added
to the logits), then the penalties: vLLM's `repetition_penalty` over the tokens of the prompt and the output
(CTRL's rule: a positive logit divided by it, a negative one multiplied), OpenAI's `frequency_penalty` and
`presence_penalty` over the output's (the logit less frequency x the token's count, less presence where it
occurred). A grammar that allows only a stop id overrides min_tokens: a row is never left without a token.

The host gathers the arrays of the step's sampled rows that ask for any of it (`pack`, None when none does: a
step of plain requests pays nothing, not even a copy); they cross to the device with the step's other arrays,
and `process` works on those rows alone, in float32, returning new logits: the model's own stay as they were
for the log-probabilities a request asks for (OpenAI's and vLLM's are the model's distribution, not the
processed one).
"""

from __future__ import annotations

import numpy as np
import torch

from kiln.pipeline.serve.grammar import mask_words, masks
from kiln.pipeline.serve.request import Request


def pack(requests: list[Request], vocab_size: int) -> dict[str, np.ndarray] | None:
    """The arrays for the rows (sampled in this order) whose request asks for processing; None when none does."""
    rows = [j for j, r in enumerate(requests) if r.processed]
    if not rows:
        return None
    asked = [requests[j] for j in rows]
    out: dict[str, list] = {name: [] for name in ("ban", "bias", "seen", "counted")}
    grammar_rows = [k for k, r in enumerate(asked) if r.grammar is not None]
    for k, r in enumerate(asked):
        s = r.sampling
        if len(r.output) < s.min_tokens:
            out["ban"] += [(k, t) for t in s.stop_ids if t < vocab_size]
        out["bias"] += [(k, t, v) for t, v in s.logit_bias]
        if s.repetition_penalty != 1:
            out["seen"] += [(k, t) for t in set(r.prompt).union(r.output)]
        if s.frequency_penalty or s.presence_penalty:
            out["counted"] += [(k, t) for t in r.output]
    arrays = {"processed_rows": np.array(rows, np.int64),
              "presence": np.array([r.sampling.presence_penalty for r in asked], np.float32),
              "frequency": np.array([r.sampling.frequency_penalty for r in asked], np.float32),
              "repetition": np.array([r.sampling.repetition_penalty for r in asked], np.float32)}
    if grammar_rows:
        arrays["grammar_rows"] = np.array(grammar_rows, np.int64)
        words = masks([asked[k].grammar for k in grammar_rows], mask_words(vocab_size))
        arrays["grammar_mask"] = words.astype(np.int64)  # the int32 words, as the step's int64 copy holds them
    for name in ("ban", "seen", "counted"):
        if out[name]:
            arrays[f"{name}_rows"], arrays[f"{name}_tokens"] = np.array(out[name], np.int64).T.copy()
    if out["bias"]:
        bias = np.array(out["bias"], np.float64)
        arrays["bias_rows"], arrays["bias_tokens"] = bias[:, :2].T.astype(np.int64).copy()
        arrays["bias_values"] = bias[:, 2].astype(np.float32)
    return arrays


def allowed(mask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """(rows, vocab_size) bool from bitmasks of int32 words (held in int64): token t is bit t % 32 of word t // 32."""
    bits = torch.arange(32, device=mask.device, dtype=mask.dtype)
    return ((mask[:, :, None] >> bits) & 1).flatten(1)[:, :vocab_size].bool()


def process(logits: torch.Tensor, on_device: dict[str, torch.Tensor]) -> torch.Tensor:
    """The sampled rows' logits (R, vocab) with each processed row's asks applied (`pack`'s arrays on the device),
    in float32; a new tensor, `logits` untouched."""
    out = logits.float().clone()
    rows = on_device["processed_rows"]
    inf = torch.tensor(float("-inf"), device=out.device)
    if "grammar_rows" in on_device and "ban_rows" not in on_device:  # the common case: a mask alone
        g = rows[on_device["grammar_rows"]]
        out[g] = out[g].masked_fill(~allowed(on_device["grammar_mask"], out.size(-1)), inf)
        if not any(name in on_device for name in ("bias_rows", "seen_rows", "counted_rows")):
            return out
    x = out[rows]
    if "ban_rows" in on_device:
        grammar = None
        if "grammar_rows" in on_device:
            g = on_device["grammar_rows"]
            grammar = x[g].masked_fill(~allowed(on_device["grammar_mask"], x.size(-1)), inf)
        x[on_device["ban_rows"], on_device["ban_tokens"]] = inf
        if grammar is not None:
            # the grammar's mask over the ban; a row the two leave without a token keeps the grammar's alone
            both = torch.where(torch.isneginf(grammar), inf, x[g])
            x[g] = torch.where(torch.isneginf(both).all(-1, keepdim=True), grammar, both)
    if "bias_rows" in on_device:
        x.index_put_((on_device["bias_rows"], on_device["bias_tokens"]), on_device["bias_values"], accumulate=True)
    if "seen_rows" in on_device:
        r, t = on_device["seen_rows"], on_device["seen_tokens"]
        value, penalty = x[r, t], on_device["repetition"][r]
        x[r, t] = torch.where(value > 0, value / penalty, value * penalty)
    if "counted_rows" in on_device:
        counts = torch.zeros_like(x)
        counts.index_put_((on_device["counted_rows"], on_device["counted_tokens"]), torch.ones_like(
            on_device["counted_rows"], dtype=x.dtype), accumulate=True)
        x -= on_device["frequency"][:, None] * counts + on_device["presence"][:, None] * (counts > 0)
    out[rows] = x
    return out
