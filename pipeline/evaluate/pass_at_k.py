"""pass@k: the chance that at least one of k samples of a prompt is right, estimated from n >= k samples.

Drawing only k samples and counting a hit is a high-variance estimate; Chen et al. 2021 ("Evaluating Large
Language Models Trained on Code", eq. 1) draw n >= k, count the c right ones, and average over every k-subset:
pass@k = 1 - C(n - c, k) / C(n, k), which is unbiased. The binomials overflow floats for n in the hundreds, so
the ratio is taken as the product prod_{i = n - c + 1}^{n} (1 - k / i), which is equal and stays in [0, 1].
"""

from __future__ import annotations

import numpy as np


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one prompt with c right answers among n samples."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:  # every k-subset holds a right answer
        return 1.0
    return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))

