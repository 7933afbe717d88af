"""pass@k against its closed form, 1 - C(n - c, k) / C(n, k) (Chen et al. 2021, eq. 1), in exact fractions."""

from fractions import Fraction
from itertools import combinations
from math import comb

import pytest

from kiln.pipeline.evaluate.pass_at_k import pass_at_k


def closed_form(n: int, c: int, k: int) -> Fraction:
    return 1 - Fraction(comb(n - c, k), comb(n, k))


@pytest.mark.parametrize("n", [1, 2, 5, 16, 200])
def test_pass_at_k_is_the_closed_form(n):
    for c in range(n + 1):
        for k in sorted({1, min(2, n), max(n // 2, 1), max(n - 1, 1), n}):
            assert pass_at_k(n, c, k) == pytest.approx(float(closed_form(n, c, k)), abs=1e-12), (n, c, k)


def test_pass_at_k_averages_every_subset_of_k_samples():
    """The definition the estimator stands for: the share of k-subsets of the n samples holding a right one."""
    samples = [1, 0, 0, 1, 0, 0, 0]  # n = 7, c = 2
    for k in range(1, 8):
        subsets = list(combinations(samples, k))
        assert pass_at_k(7, 2, k) == pytest.approx(sum(any(s) for s in subsets) / len(subsets), abs=1e-12)


def test_pass_at_1_is_the_share_right_and_edges():
    assert pass_at_k(10, 3, 1) == pytest.approx(0.3)
    assert pass_at_k(10, 0, 10) == 0.0 and pass_at_k(10, 1, 10) == 1.0 and pass_at_k(10, 8, 3) == 1.0
    assert pass_at_k(1000, 1, 1) == pytest.approx(1e-3)  # binomials this large overflow a float; the product does not
    for n, c, k in [(5, 6, 1), (5, -1, 1), (5, 2, 0), (5, 2, 6)]:
        with pytest.raises(ValueError, match="pass@k"):
            pass_at_k(n, c, k)
