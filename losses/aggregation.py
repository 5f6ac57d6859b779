"""Loss aggregation: a weighted sum and its denominator, never a mean.

Every loss reduces its per-token values ``l[b, t]`` (already zero where ``loss_mask`` is 0) to a
:class:`LossSum` ``(total, denom)``. The loss is ``total / denom``; the ``LossSum`` of several micro-batches,
devices or hosts is the element-wise sum, so gradient accumulation equals one large batch exactly as long as
a sequence is never split between micro-batches. Denominators are counts, independent of the parameters, so
``grad(sum(total_k)) / sum(denom_k)`` is the one-batch gradient.

Modes (``m`` is ``loss_mask``, sequences are found by :mod:`sequences` from ``segment_ids``):

* ``token_mean``: ``total = sum_{b,t} m l``, ``denom = sum_{b,t} m``. Every valid token weighs the same
  (DAPO, Yu et al. 2025).
* ``seq_mean_token_mean``: ``total = sum_i (sum_{t in i} m l) / n_i``, ``denom`` = number of sequences with
  ``n_i > 0`` valid tokens. Every sequence weighs the same (GRPO, Shao et al. 2024).
* ``seq_mean_token_sum``: ``total = sum_i (sum_{t in i} m l) / C``, ``denom`` = number of sequences with a
  valid token, for a constant ``C`` (``max_tokens``, e.g. the maximum generation length). This removes the
  length bias of per-sequence means (Dr. GRPO, Liu et al. 2025, "Understanding R1-Zero-Like Training").

Sequences with no valid token are not counted, so rows of pure padding change nothing.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp

from feynrl_jax.losses import sequences


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LossSum:
    """A loss as a weighted sum and its denominator.

    Attributes:
        total: [] the weighted sum of per-token (or per-pair) losses.
        denom: [] the denominator; ``total / denom`` is the loss.
    """

    total: jax.Array
    denom: jax.Array

    def __add__(self, other: LossSum) -> LossSum:
        return LossSum(self.total + other.total, self.denom + other.denom)

    @property
    def value(self) -> jax.Array:
        """``total / denom``, and 0 when the denominator is 0 (an all-masked batch)."""
        return sequences.safe_divide(self.total, self.denom)


def token_mean(per_token: jax.Array, mask: jax.Array, segment_ids: jax.Array) -> LossSum:
    """Sum over valid tokens / number of valid tokens.

    Args:
        per_token: [B, T] per-token losses.
        mask: [B, T] loss mask.
        segment_ids: [B, T] (unused: every token weighs the same).

    Returns:
        LossSum(sum of masked losses, number of valid tokens).
    """
    del segment_ids
    return LossSum(jnp.sum(per_token * mask), jnp.sum(mask))


def seq_mean_token_mean(per_token: jax.Array, mask: jax.Array, segment_ids: jax.Array) -> LossSum:
    """Mean over the valid tokens of each sequence, then mean over sequences.

    Args:
        per_token: [B, T] per-token losses.
        mask: [B, T] loss mask.
        segment_ids: [B, T] segment ids; sequences are (row, run of equal non-zero id).

    Returns:
        LossSum(sum of per-sequence means, number of sequences with a valid token).
    """
    index = sequences.sequence_index(segment_ids)
    sums = sequences.sequence_sum(per_token * mask, index)
    counts = sequences.sequence_sum(mask, index)
    return LossSum(jnp.sum(sequences.safe_divide(sums, counts)), jnp.sum(counts > 0).astype(per_token.dtype))


def seq_mean_token_sum(per_token: jax.Array, mask: jax.Array, segment_ids: jax.Array, *, max_tokens: float) -> LossSum:
    """Sum over the valid tokens of each sequence divided by the constant ``max_tokens``, then mean over sequences.

    Args:
        per_token: [B, T] per-token losses.
        mask: [B, T] loss mask.
        segment_ids: [B, T] segment ids.
        max_tokens: the constant normaliser ``C`` (e.g. the maximum number of generated tokens).

    Returns:
        LossSum(sum of per-sequence sums / C, number of sequences with a valid token).
    """
    index = sequences.sequence_index(segment_ids)
    counts = sequences.sequence_sum(mask, index)
    return LossSum(jnp.sum(per_token * mask) / max_tokens, jnp.sum(counts > 0).astype(per_token.dtype))


AGGREGATIONS: dict[str, Callable[..., LossSum]] = {
    "token_mean": token_mean,
    "seq_mean_token_mean": seq_mean_token_mean,
    "seq_mean_token_sum": seq_mean_token_sum,
}


def aggregate(
    per_token: jax.Array,
    mask: jax.Array,
    segment_ids: jax.Array,
    *,
    mode: str,
    max_tokens: float | None = None,
) -> LossSum:
    """Reduces per-token losses with the named mode.

    Args:
        per_token: [B, T] per-token losses.
        mask: [B, T] loss mask.
        segment_ids: [B, T] segment ids.
        mode: one of ``AGGREGATIONS``.
        max_tokens: the constant normaliser of ``seq_mean_token_sum``; must be None for the other modes.

    Returns:
        The LossSum.

    Raises:
        ValueError: for an unknown mode, or ``max_tokens`` missing/unexpected for the mode.
    """
    if mode not in AGGREGATIONS:
        raise ValueError(f"loss_agg={mode!r} is not one of {sorted(AGGREGATIONS)}")
    if mode == "seq_mean_token_sum":
        if max_tokens is None or max_tokens <= 0:
            raise ValueError(f"loss_agg='seq_mean_token_sum' needs a positive max_tokens, got {max_tokens!r}")
        return seq_mean_token_sum(per_token, mask, segment_ids, max_tokens=max_tokens)
    if max_tokens is not None:
        raise ValueError(f"max_tokens={max_tokens!r} is only used by loss_agg='seq_mean_token_sum', not {mode!r}")
    return AGGREGATIONS[mode](per_token, mask, segment_ids)
