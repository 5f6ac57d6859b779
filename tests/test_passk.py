"""The unbiased pass@k estimator against brute-force enumeration of k-subsets."""

import itertools
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from feynrl_jax.eval.passk import mean_pass_at_k, pass_at_k


def brute_force(n: int, c: int, k: int) -> float:
    """The fraction of k-subsets of n samples (the first c correct) that hold at least one correct sample."""
    subsets = list(itertools.combinations(range(n), k))
    return sum(any(i < c for i in subset) for subset in subsets) / len(subsets)


@st.composite
def counts(draw):
    n = draw(st.integers(1, 12))
    return n, draw(st.integers(0, n)), draw(st.integers(1, n))


@settings(max_examples=150, deadline=None)
@given(counts())
def test_pass_at_k_matches_brute_force(nck):
    n, c, k = nck
    assert pass_at_k(n, c, k) == pytest.approx(brute_force(n, c, k), abs=1e-12)


@settings(max_examples=50, deadline=None)
@given(st.lists(counts(), min_size=1, max_size=5), st.integers(1, 12))
def test_mean_is_the_average_over_problems(problems, k):
    problems = [(n, c) for n, c, _ in problems if n >= k]
    if not problems:
        return
    expected = sum(brute_force(n, c, k) for n, c in problems) / len(problems)
    got = mean_pass_at_k([n for n, _ in problems], [c for _, c in problems], k)
    assert got == pytest.approx(expected, abs=1e-12)


def test_edge_cases_and_large_n_are_exact_and_finite():
    assert pass_at_k(5, 0, 3) == 0.0
    assert pass_at_k(5, 5, 1) == 1.0
    assert pass_at_k(10, 8, 3) == 1.0  # n - c < k: every 3-subset holds a correct sample
    assert pass_at_k(10, 3, 1) == pytest.approx(0.3)
    # Binomials of this size overflow float64; the product form does not.
    n, c, k = 5000, 7, 200
    exact = 1 - math.comb(n - c, k) / math.comb(n, k)
    assert math.comb(n, k) > 10**308 and pass_at_k(n, c, k) == pytest.approx(exact, rel=1e-12)
    assert mean_pass_at_k(4, [0, 4, 2], 1) == pytest.approx((0 + 1 + 0.5) / 3)


@pytest.mark.parametrize(
    "args,match", [((3, 4, 1), "0 <= c <= n"), ((3, 1, 4), "1 <= k <= n"), ((0, 0, 1), "n >= 1"), ((3, 1, 0), "1 <= k")]
)
def test_inconsistent_counts_are_rejected(args, match):
    with pytest.raises(ValueError, match=match):
        pass_at_k(*args)


def test_mean_rejects_mismatched_lengths():
    with pytest.raises(ValueError, match="entries"):
        mean_pass_at_k([4, 4], [1], 1)
    with pytest.raises(ValueError, match="at least one"):
        mean_pass_at_k(4, [], 1)
