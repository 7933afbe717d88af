"""Chinchilla's parametric loss L(N, D) = E + A / N^alpha + B / D^beta and the compute-optimal split it implies:
the formulas the fit estimates (scaling/fit.py) and the size choice evaluates (scaling/size.py)."""

from __future__ import annotations

import math

import numpy as np

PARAM_NAMES = ("E", "A", "B", "alpha", "beta")


def has_optimum(p: dict[str, float]) -> bool:
    """Whether L(N, C/6N) has a minimum: only when the loss falls with both N and D (A, B, alpha, beta > 0)."""
    return all(math.isfinite(p[k]) and p[k] > 0 for k in ("A", "B", "alpha", "beta")) and math.isfinite(p["E"])


def compute_optimal(p: dict[str, float], flops: float) -> tuple[float, float, float]:
    """argmin over N of L(N, C/6N): setting the derivative to zero gives N_opt = G (C/6)^(beta/(alpha+beta)).
    Meaningful only where `has_optimum(p)`."""
    s = p["alpha"] + p["beta"]
    g = (p["alpha"] * p["A"] / (p["beta"] * p["B"])) ** (1 / s)
    n_opt = g * (flops / 6) ** (p["beta"] / s)
    d_opt = (flops / 6) ** (p["alpha"] / s) / g
    return n_opt, d_opt, predict(p, n_opt, d_opt)


def predict(p: dict[str, float], n, d):
    return p["E"] + p["A"] / np.power(n, p["alpha"]) + p["B"] / np.power(d, p["beta"])
