"""Stage `scaling_size`: the model shape and token budget the scaling fit gives for `scaling.target_flops`.

`kiln train` with `model.size: auto` takes its shape and token count from the file written here. That file,
not the fit, is the pretrain stage's dependency: with `model.size: fixed` it says only that, so a new sweep or
fit does not retrain the base model (DVC reruns a stage only when a dependency's content changes).

The compute-optimal N comes from the IsoFLOP power law N_opt = k_N C^a (approach 2, the direct fit of the
quantity wanted) or from L(N, D) (approach 3), by `scaling.approach`; the depth dial's model nearest to it in
log N is trained for D = C / (6 N) tokens of that model's own N.
"""

from __future__ import annotations

import math
from pathlib import Path

from kiln.pipeline import layout
from kiln.pipeline.errors import UserError
from kiln.pipeline.outputs import write_json
from kiln.pipeline.progress import console
from kiln.pipeline.scaling.laws import PARAM_NAMES, compute_optimal, has_optimum, predict
from kiln.pipeline.scaling.params import ScalingParams
from kiln.pipeline.train.params import ModelParams
from kiln.pipeline.train.size_choice import count_params, describe, read_json

MAX_DEPTH = 256


def is_finite_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def choose_size(fit: dict, fit_path: Path, scaling: ScalingParams, model: ModelParams, vocab_size: int) -> dict:
    missing = [k for k in (*PARAM_NAMES, "a", "k_n") if k not in fit]
    if missing:
        raise UserError(f"{fit_path}: lacks {', '.join(missing)} (expected the output of `kiln scaling fit`)")
    for key in (*PARAM_NAMES, "a", "k_n"):
        value = fit[key]
        if not (value is None and key in ("a", "k_n")) and not is_finite_number(value):
            raise UserError(f"{fit_path}: {key} is {value!r}, expected a finite number")
    if not has_optimum(fit):
        raise UserError(f"{fit_path}: the fitted law has no compute-optimal size (loss must fall with N and D)")
    if scaling.approach == "isoflop" and fit["a"] is None:
        why = fit.get("isoflop_unused") or "fewer than 2 budgets of the sweep form a valley"
        raise UserError(f"{fit_path}: no IsoFLOP exponents ({why}); set scaling.approach=parametric")
    c = scaling.target_flops
    n_param, d_param, _ = compute_optimal(fit, c)
    n_iso = fit["k_n"] * c ** fit["a"] if fit["a"] is not None else None
    n_opt = n_iso if scaling.approach == "isoflop" else n_param
    best = None
    for depth in range(1, MAX_DEPTH + 1):
        shape = scaling.shape(depth)
        n, _ = count_params(model.config(vocab_size, **shape))
        if best is None or abs(math.log(n / n_opt)) < abs(math.log(best[1] / n_opt)):
            best = (shape, n)
        if n > n_opt:  # N grows with depth: the nearest is this one or the one before
            break
    shape, n = best
    tokens = max(1, round(c / (6 * n)))
    return {"size": "auto", "target_flops": c, "approach": scaling.approach, "n_opt": n_opt,
            "d_opt": c / (6 * n_opt), "n_opt_parametric": n_param, "d_opt_parametric": d_param,
            "n_opt_isoflop": n_iso, **shape, "params": n, "tokens": tokens,
            "predicted_loss": float(predict(fit, n, tokens))}


def scaling_size(scaling: ScalingParams, model: ModelParams, fit_path: Path, tokenizer_path: Path,
                 out: Path = layout.SIZE) -> dict:
    if model.size == "fixed":
        choice = {"size": "fixed"}
        console.print("scaling size: model.size is fixed; the pretrain stage uses the model section as it is",
                      highlight=False)
    else:
        from kiln.pipeline.text.bpe import load_tokenizer

        fit = read_json(fit_path, "scaling fit", "run `kiln scaling fit` first")
        vocab_size = load_tokenizer(tokenizer_path).get_vocab_size()
        choice = choose_size(fit, fit_path, scaling, model, vocab_size)
        console.print(describe(choice), highlight=False)
    write_json(out, choice)
    return choice


