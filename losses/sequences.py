"""Finding the sequences of a (possibly packed) batch and reducing per sequence.

A sequence is a maximal run of equal, non-zero ``segment_ids`` inside one row. Sequences are numbered in
row-major order, so an unpacked batch numbers its rows and a packed row contributes one number per segment.
Identifying a sequence by (row, run) rather than by the raw id value means the ids of one row need not be
distinct from those of another row (every unpacked row uses id 1).

Per-sequence reductions use ``jax.ops.segment_sum`` with ``B * T`` buckets (the most sequences ``[B, T]`` can
hold) plus one bucket that collects padding, so memory stays ``O(B * T)``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def sequence_index(segment_ids: jax.Array) -> jax.Array:
    """Numbers the sequences of a batch in row-major order.

    Args:
        segment_ids: [B, T] int; 0 marks padding.

    Returns:
        [B, T] int32: the ordinal of each token's sequence in ``[0, B * T)``; padding tokens get ``B * T``.
    """
    b, t = segment_ids.shape
    previous = jnp.pad(segment_ids[:, :-1], ((0, 0), (1, 0)), constant_values=0)
    starts = (segment_ids != previous) & (segment_ids != 0)
    ordinal = jnp.cumsum(starts.reshape(-1).astype(jnp.int32)).reshape(b, t) - 1
    return jnp.where(segment_ids != 0, ordinal, b * t).astype(jnp.int32)


def sequence_sum(values: jax.Array, index: jax.Array) -> jax.Array:
    """Sums ``values`` over the tokens of each sequence.

    Args:
        values: [B, T] per-token values (mask them first).
        index: [B, T] from :func:`sequence_index`.

    Returns:
        [B * T] per-sequence sums (unused slots hold 0).
    """
    slots = values.size
    sums = jax.ops.segment_sum(values.reshape(-1), index.reshape(-1), num_segments=slots + 1)
    return sums[:slots]


def broadcast_to_tokens(per_sequence: jax.Array, index: jax.Array) -> jax.Array:
    """Gives every token the value of its sequence; padding tokens get 0.

    Args:
        per_sequence: [B * T] per-sequence values.
        index: [B, T] from :func:`sequence_index`.

    Returns:
        [B, T].
    """
    padded = jnp.concatenate([per_sequence, jnp.zeros((1,), per_sequence.dtype)])
    return padded[index]


def safe_divide(numerator: jax.Array, denominator: jax.Array) -> jax.Array:
    """``numerator / denominator`` where the denominator is non-zero, else 0, with finite gradients."""
    nonzero = denominator != 0
    return jnp.where(nonzero, numerator / jnp.where(nonzero, denominator, 1), 0)
