"""The model size `kiln scaling size` chose, as `kiln pretrain` reads it with `model.size: auto`, and the parameter
count both sides agree on."""

from __future__ import annotations

import json
from pathlib import Path

from kiln.model.config import ModelConfig
from kiln.pipeline.errors import UserError

SHAPE_KEYS = ("n_layer", "d_model", "n_head", "n_kv_head", "d_ff")


def count_params(config: ModelConfig) -> tuple[int, int]:
    """(total, non-embedding) parameters, from the shape alone: sizes too large for this machine count too."""
    return config.num_params(), config.num_params(embeddings=False)


def read_json(path: Path, what: str, hint: str) -> dict:
    if not path.is_file():
        raise UserError(f"{path}: no {what} ({hint})")
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise UserError(f"{path}: not valid JSON ({e.msg} at line {e.lineno})") from None
    except (UnicodeDecodeError, ValueError, RecursionError) as e:  # not UTF-8, a 5,000-digit number, [[[[...
        raise UserError(f"{path}: not usable JSON ({type(e).__name__}: {str(e)[:80]})") from None
    if not isinstance(value, dict):
        raise UserError(f"{path}: expected a JSON object")
    return value


def describe(choice: dict) -> str:
    return (f"model.size auto: C = {choice['target_flops']:.3g} FLOPs -> N_opt {choice['n_opt']:.4g} "
            f"({choice['approach']}); depth {choice['n_layer']} (d_model {choice['d_model']}, {choice['n_head']} "
            f"heads) has N = {choice['params']:,}, trained on D = {choice['tokens']:,} tokens, predicted loss "
            f"{choice['predicted_loss']:.4f}")


def auto_size(path: Path) -> dict:
    """The choice `kiln scaling size` wrote, for `kiln train` with `model.size: auto`."""
    choice = read_json(path, "model size", "run `kiln scaling size` with model.size=auto first")
    if choice.get("size") != "auto":
        raise UserError(f"{path}: written with model.size=fixed; run `kiln scaling size` with model.size=auto")
    missing = [k for k in (*SHAPE_KEYS, "tokens") if not isinstance(choice.get(k), int)]
    if missing:
        raise UserError(f"{path}: lacks {', '.join(missing)} (expected the output of `kiln scaling size`)")
    return choice
