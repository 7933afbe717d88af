"""What names an adapter, without torch: the kinds, the projections LoRA can target, and the check of a spec as a
model folder's config.json records it. Params validation and `kiln --help` read these before torch is loaded;
model/lora.py builds the adapters.
"""

from __future__ import annotations

import math

__all__ = ["ADAPTERS", "TARGETS", "TOKEN_ROWS", "spec_problem"]

ADAPTERS = ("full", "lora", "qlora")
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# an adapter file's trained token rows (under tok_emb.) and the start's values of those rows
TOKEN_ROWS = ("trainable_tokens_delta", "trainable_tokens_original")


def spec_problem(spec: object) -> str | None:
    """None, or what is wrong with an adapter spec as config.json records it ({adapter, rank, alpha, dropout,
    targets, and trainable_tokens where rows were trained}): the checks params get, for a file that may have been
    edited since."""
    if not isinstance(spec, dict):
        return f"expected an object, got {type(spec).__name__}"

    def number(key: str) -> bool:
        value = spec.get(key)
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if spec.get("adapter") not in ADAPTERS[1:]:
        return f"adapter={spec.get('adapter')!r:.40}: expected {' or '.join(ADAPTERS[1:])}"
    if not (isinstance(spec.get("rank"), int) and not isinstance(spec.get("rank"), bool) and spec["rank"] >= 1):
        return f"rank={spec.get('rank')!r:.40}: expected a positive integer"
    if not (number("alpha") and spec["alpha"] > 0):
        return f"alpha={spec.get('alpha')!r:.40}: expected a positive number (the update is scaled by alpha / rank)"
    if not (number("dropout") and 0 <= spec["dropout"] < 1):
        return f"dropout={spec.get('dropout')!r:.40}: expected a number in [0, 1)"
    targets = spec.get("targets")
    if not (isinstance(targets, list) and targets and all(t in TARGETS for t in targets)):
        return f"targets={targets!r:.80}: expected a list of names among {', '.join(TARGETS)}"
    tokens = spec.get("trainable_tokens")
    if "trainable_tokens" in spec and not (
            isinstance(tokens, list) and tokens and len(set(tokens)) == len(tokens)
            and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in tokens)):
        return f"trainable_tokens={tokens!r:.80}: expected a list of distinct token ids"
    return None
