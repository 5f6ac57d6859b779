"""Attention in blocks (`feynrl_jax.models.block_attention`) against the dense packed mask.

Random packed rows (hypothesis): ordinary segments, continuation segments behind their root (near it and far
from it, seeing all of it or a part), padding between and after, under every `SegmentBounds` the rows satisfy.
The blocked attention must give every real token the dense attention's output. Both run in float64, the
model's float32 softmax included (`jnp.float32` pointed at float64, as `tests/test_shared_prefix.py` does):
they sum the same non-zero terms in another order, so they agree to float64 rounding (1e-12 against outputs of
order 1); a key missing from a block or counted twice moves an output by 1e-2 or more.
"""

from __future__ import annotations

import contextlib
import functools
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from feynrl_jax.models import block_attention
from feynrl_jax.models.attention import attend, packed_mask
from feynrl_jax.models.block_attention import SegmentBounds

HEADS, KV_HEADS, HEAD_DIM = 4, 2, 3
TOL = 1e-12


def _row(rng: np.random.Generator, width: int, segment: int, prefix: int) -> tuple[np.ndarray, np.ndarray]:
    """One packed row of `width` columns whose segments keep to `SegmentBounds(segment, prefix)`: roots (starting
    at position 0, up to `segment` long) with continuations behind them that see all of the root or a part (at
    most `prefix` tokens), padding between, and sometimes a continuation with no root before it."""
    positions, ids = np.zeros(width, np.int32), np.zeros(width, np.int32)
    column, next_id = int(rng.integers(0, 3)), 1

    def write(length: int, first_position: int) -> int:
        nonlocal column, next_id
        n = min(length, width - column)
        ids[column : column + n], positions[column : column + n] = next_id, first_position + np.arange(n)
        column, next_id = column + n, next_id + 1
        return n

    if prefix and rng.random() < 0.2:  # a continuation whose root is not in the row
        write(int(rng.integers(1, segment + 1)), int(rng.integers(1, prefix + 1)))
    while column < width:
        if rng.random() < 0.15:  # padding between segments
            column += int(rng.integers(1, 4))
            continue
        root = int(rng.integers(1, segment + 1))
        written = write(root, 0)
        seen = min(written, prefix)
        for _ in range(int(rng.integers(0, 6)) if seen else 0):
            if column >= width:
                break
            first = seen if rng.random() < 0.7 else int(rng.integers(1, seen + 1))  # all it may see, or a part
            write(int(rng.integers(1, segment + 1)), first)
    return positions, ids


def _attention(positions, segment_ids, bounds: SegmentBounds | None, window, rng) -> np.ndarray:
    """Attention outputs `[B, T, H, Dh]` of random q, k, v: dense (`bounds` None) or in blocks."""
    b, t = segment_ids.shape
    q = rng.normal(size=(b, t, HEADS, HEAD_DIM))
    k, v = (rng.normal(size=(b, t, KV_HEADS, HEAD_DIM)) for _ in range(2))
    return np.asarray(_attend(q, k, v, positions, segment_ids, bounds, window))


@functools.partial(jax.jit, static_argnums=(5, 6), compiler_options={"xla_backend_optimization_level": 0})
def _attend(q, k, v, positions, segment_ids, bounds: SegmentBounds | None, window: int | None) -> jax.Array:
    # XLA's backend optimisation level 0 halves the compile time of these small programs; the arithmetic compared is
    # the same.
    window = None if window is None else jnp.asarray(window)
    if bounds is None:
        mask = packed_mask(positions, segment_ids, window)
        return attend(q, k.transpose(0, 2, 3, 1), v.transpose(0, 2, 1, 3), mask)
    blocks = block_attention.block_structure(positions, segment_ids, bounds)
    return block_attention.attend_in_blocks(q, k, v, blocks, window)


@contextlib.contextmanager
def float64():
    """Every float of the attention in float64, its float32 softmax included."""
    with jax.enable_x64(True), mock.patch.object(jnp, "float32", jnp.float64):
        yield


# Shapes are drawn from a few values each: every new (width, block, window) shape compiles both attentions again.
@settings(max_examples=60, deadline=None)
@given(
    segment=st.sampled_from([1, 5, 9, 12]),  # blocks of 8, 8, 8 and 16 queries
    prefix=st.sampled_from([0, 5, 9, 30]),  # far windows of 0, 8, 16 and 32 keys (wider than two blocks of 8)
    width=st.sampled_from([30, 45, 72]),
    window=st.sampled_from([None, 3]),
    seed=st.integers(0, 2**31 - 1),
)
def test_blocks_give_every_real_token_the_dense_output(segment, prefix, width, window, seed):
    rng = np.random.default_rng(seed)
    rows = [_row(rng, width, segment, prefix) for _ in range(3)]
    positions, ids = np.stack([r[0] for r in rows]), np.stack([r[1] for r in rows])
    bounds = SegmentBounds(segment, prefix)
    bounds.check(positions, ids)
    draw = int(rng.integers(2**31))
    with float64():
        dense = _attention(positions, ids, None, window, np.random.default_rng(draw))
        blocked = _attention(positions, ids, bounds, window, np.random.default_rng(draw))
    real = ids != 0
    np.testing.assert_allclose(blocked[real], dense[real], rtol=0, atol=TOL)


def test_far_roots_are_exercised():
    """A row where continuations sit several blocks behind their prompt: the far window is what they see it by."""
    bounds = SegmentBounds(segment=8, prefix=5)  # blocks of 8 queries, a far window of 8 keys
    ids = np.asarray([[1] * 5 + [k for k in range(2, 10) for _ in range(6)] + [0] * 3], np.int32)
    positions = np.asarray([list(range(5)) + [5 + i for _ in range(8) for i in range(6)] + [0] * 3], np.int32)
    bounds.check(positions, ids)
    with float64():
        blocks = block_attention.block_structure(jnp.asarray(positions), jnp.asarray(ids), bounds)
        dense = _attention(positions, ids, None, None, np.random.default_rng(1))
        blocked = _attention(positions, ids, bounds, None, np.random.default_rng(1))
    far_open = np.asarray(blocks.mask)[:, :, 2 * bounds.block :].any(axis=(1, 2))
    assert far_open[2:].all() and not far_open[:2].any()  # blocks 2-6 see the prompt through the far window
    real = ids != 0
    np.testing.assert_allclose(blocked[real], dense[real], rtol=0, atol=TOL)
    assert np.abs(dense[real]).max() > 0.1


def test_bounds_check_names_the_row_and_segment():
    bounds = SegmentBounds(segment=3, prefix=2)
    bounds.check(np.asarray([[0, 1, 2, 2, 3, 0]]), np.asarray([[1, 1, 1, 2, 2, 0]]))
    with pytest.raises(ValueError, match=r"row 1: segment 4 at columns 0\.\.3"):
        bounds.check(np.zeros((2, 4), np.int32) + np.arange(4), np.asarray([[1, 1, 0, 0], [4, 4, 4, 4]]))
    with pytest.raises(ValueError, match="first position 3"):
        bounds.check(np.asarray([[0, 1, 3, 4]]), np.asarray([[1, 1, 2, 2]]))
    with pytest.raises(ValueError, match="segment 1 at columns 3..3: the id is used by an earlier run"):
        bounds.check(np.asarray([[0, 1, 0, 0]]), np.asarray([[1, 1, 2, 1]]))
    with pytest.raises(ValueError, match="segment 1 at columns 0..2: positions do not run on by one"):
        bounds.check(np.asarray([[0, 1, 1]]), np.asarray([[1, 1, 1]]))
    with pytest.raises(ValueError, match="segment >= 1"):
        SegmentBounds(segment=0, prefix=0)


def test_blocks_are_used_only_where_they_cost_less():
    bounds = SegmentBounds(segment=128, prefix=64)  # a shared-prefix row: 64-token prompts, 128-token completions
    assert (bounds.block, bounds.window, bounds.far_blocks) == (128, 64, 2)
    # 1,088 columns: 9 blocks x 128 queries x 320 keys, plus the far windows' selection (SmolLM2: 3 of 9 heads).
    selection = (2 * 9 * 128 + 64 * 2 * 128) * 9
    assert bounds.blocked_pairs(1088, kv_share=1 / 3) == 9 * 128 * 320 + selection // 3
    assert bounds.pays(64 + 8 * 128, kv_share=1 / 3)
    assert not bounds.pays(192)  # one prompt and one completion: dense is cheaper
    assert SegmentBounds(segment=128, prefix=0).blocked_pairs(1088) == 9 * 128 * 256  # no far windows
