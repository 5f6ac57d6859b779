"""The unbiased pass@k estimator.

Chen et al., 2021, "Evaluating Large Language Models Trained on Code" (Codex), eq. 1: with ``n`` samples of a
problem of which ``c`` are correct, the probability that at least one of ``k`` samples drawn without
replacement is correct is

    pass@k = 1 - C(n - c, k) / C(n, k) = 1 - prod_{i = n - c + 1}^{n} (1 - k / i),

the product form avoiding the huge binomials (and their overflow in floating point). It is 1 when
``n - c < k`` (every k-subset holds a correct sample). The benchmark score is the mean over problems.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one problem.

    Args:
        n: samples drawn for the problem (>= 1).
        c: correct samples among them (0 <= c <= n).
        k: the k of pass@k (1 <= k <= n).

    Returns:
        ``1 - C(n - c, k) / C(n, k)`` in [0, 1].

    Raises:
        ValueError: the counts are inconsistent (naming them).
    """
    n, c, k = int(n), int(c), int(k)
    if n < 1 or not 0 <= c <= n:
        raise ValueError(f"pass@k needs n >= 1 and 0 <= c <= n, got n={n}, c={c}")
    if not 1 <= k <= n:
        raise ValueError(f"pass@k needs 1 <= k <= n, got k={k}, n={n}")
    if n - c < k:
        return 1.0
    terms = 1.0 - k / np.arange(n - c + 1, n + 1, dtype=np.float64)
    return float(1.0 - np.prod(terms))


def mean_pass_at_k(num_samples: Sequence[int] | int, num_correct: Sequence[int], k: int) -> float:
    """pass@k averaged over problems.

    Args:
        num_samples: ``n`` per problem, or one ``n`` shared by all problems.
        num_correct: ``c`` per problem.
        k: the k of pass@k; must not exceed any problem's ``n``.

    Returns:
        The mean of :func:`pass_at_k` over the problems.
    """
    correct = list(num_correct)
    if not correct:
        raise ValueError("mean_pass_at_k needs at least one problem")
    samples = [num_samples] * len(correct) if isinstance(num_samples, int | np.integer) else list(num_samples)
    if len(samples) != len(correct):
        raise ValueError(f"num_samples has {len(samples)} entries but num_correct has {len(correct)}")
    return float(np.mean([pass_at_k(n, c, k) for n, c in zip(samples, correct)]))
