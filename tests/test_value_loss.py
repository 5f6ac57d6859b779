"""The one clipped value loss (``losses/value.py``) against NumPy float64, and its two callers.

* ``clipped_value_error`` (per-token loss, its gradient and its metrics) equals an independent NumPy float64
  reference of ``0.5 max((V - R)^2, (V_old + clip(V - V_old, -c, c) - R)^2)`` on random inputs;
* ``ppo_loss`` with ``vf_coef = c`` is its policy part (``vf_coef = 0``) plus ``c`` times the shared value loss
  aggregated the same way, in value and gradient, for every aggregation mode;
* the critic's ``value_loss(..., vf_coef=c)`` is ``c`` times the token mean of the shared loss (gradient too),
  with unscaled metrics.

Everything runs in float64 inside ``jax.enable_x64(True)`` (a context manager, so x64 never leaks into other
tests); shapes come from a small pool and the functions are jitted, so each shape compiles once.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from feynrl_jax.losses import AGGREGATIONS, TrainBatch, aggregate, clipped_value_error, compute_metrics, ppo_loss
from feynrl_jax.train.critic import value_loss

SETTINGS = settings(max_examples=25, deadline=None)
VALUE_CLIPS = (None, 0.05, 0.2, 1.0)


@st.composite
def value_batches(draw, shapes=((3, 7), (6, 5))):
    """Random float64 arrays: packed rows of right-padded sequences, critic values near and far from V_old."""
    b, t = draw(st.sampled_from(shapes))
    rng = np.random.default_rng(draw(st.integers(0, 2**31 - 1)))
    segment_ids = np.zeros((b, t), np.int32)
    mask = np.zeros((b, t))
    for row in range(b):
        start = 0
        for segment in range(1, draw(st.integers(1, 3)) + 1):
            if start >= t:
                break
            length = int(rng.integers(1, t - start + 1))
            segment_ids[row, start : start + length] = segment
            mask[row, start + int(rng.integers(1, length + 1)) : start + length] = 1.0
            start += length
    old_values = rng.normal(size=(b, t))
    logprobs = -rng.uniform(0.05, 3.0, (b, t))
    return {
        "segment_ids": segment_ids,
        "mask": mask,
        "old_values": old_values,
        # Steps of a few tenths around V_old: some inside every clip range, some outside.
        "values": old_values + 0.5 * rng.normal(size=(b, t)),
        "returns": rng.normal(size=(b, t)),
        "logprobs": logprobs,
        "old_logprobs": logprobs + 0.2 * rng.normal(size=(b, t)),
        "advantages": rng.normal(size=(b, t)),
    }


def make_batch(x) -> TrainBatch:
    return TrainBatch(
        tokens=jnp.ones(x["mask"].shape, jnp.int32),
        positions=jnp.zeros(x["mask"].shape, jnp.int32),
        segment_ids=jnp.asarray(x["segment_ids"]),
        loss_mask=jnp.asarray(x["mask"]),
        advantages=jnp.asarray(x["advantages"]),
        old_logprobs=jnp.asarray(x["old_logprobs"]),
        values=jnp.asarray(x["old_values"]),
        returns=jnp.asarray(x["returns"]),
    )


def np_value_loss(x, value_clip):
    """Per-token loss, d(masked sum)/dV and metrics, from the formula with NumPy float64."""
    v, v_old, ret, mask = x["values"], x["old_values"], x["returns"], x["mask"]
    error = (v - ret) ** 2
    grad = v - ret
    metrics = {"loss/value_pred_mean": v, "loss/value_error_abs": np.abs(v - ret)}
    if value_clip is not None:
        clipped = v_old + np.clip(v - v_old, -value_clip, value_clip)
        clipped_error = (clipped - ret) ** 2
        # Outside the clip range the clipped prediction does not move with V; inside it equals V.
        inside = np.abs(v - v_old) < value_clip
        grad = np.where((clipped_error > error) & ~inside, 0.0, grad)
        metrics["loss/value_clip_frac"] = (clipped_error > error).astype(np.float64)
        error = np.maximum(error, clipped_error)
    per_token = 0.5 * error
    metrics["loss/value"] = per_token
    n = mask.sum()
    means = {k: (np.sum(m * mask) / n if n > 0 else 0.0) for k, m in metrics.items()}
    return per_token, grad * mask, means


@functools.cache
def _shared(value_clip):
    def masked_sum(values, batch):
        per_token, metrics = clipped_value_error(values, batch, value_clip=value_clip)
        return jnp.sum(per_token * batch.loss_mask), (per_token, compute_metrics(metrics))

    return jax.jit(jax.value_and_grad(masked_sum, has_aux=True))


@SETTINGS
@given(value_batches(), st.sampled_from(VALUE_CLIPS))
def test_clipped_value_error_matches_numpy_float64(x, value_clip):
    with jax.enable_x64(True):
        (_, (per_token, metrics)), grad = _shared(value_clip)(jnp.asarray(x["values"]), make_batch(x))
        assert per_token.dtype == jnp.float64
    expected, expected_grad, expected_metrics = np_value_loss(x, value_clip)
    np.testing.assert_allclose(np.asarray(per_token), expected, rtol=1e-12, atol=1e-15)
    np.testing.assert_allclose(np.asarray(grad), expected_grad, rtol=1e-12, atol=1e-15)
    assert metrics.keys() == expected_metrics.keys()
    for name, value in expected_metrics.items():
        np.testing.assert_allclose(float(metrics[name]), value, rtol=1e-12, atol=1e-15, err_msg=name)


def _max_tokens(loss_agg):
    return 4.0 if loss_agg == "seq_mean_token_sum" else None


@functools.cache
def _ppo(vf_coef, value_clip, loss_agg):
    def loss(logprobs, values, batch):
        total, metrics = ppo_loss(
            logprobs,
            batch,
            values=values,
            vf_coef=vf_coef,
            value_clip=value_clip,
            loss_agg=loss_agg,
            max_tokens=_max_tokens(loss_agg),
        )
        return total.value, (total, compute_metrics(metrics))

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))


@functools.cache
def _aggregated_value(value_clip, loss_agg):
    def loss(values, batch):
        per_token, metrics = clipped_value_error(values, batch, value_clip=value_clip)
        total = aggregate(
            per_token, batch.loss_mask, batch.segment_ids, mode=loss_agg, max_tokens=_max_tokens(loss_agg)
        )
        return total.value, (total, compute_metrics(metrics))

    return jax.jit(jax.value_and_grad(loss, has_aux=True))


@SETTINGS
@given(
    value_batches(), st.sampled_from(VALUE_CLIPS), st.sampled_from(sorted(AGGREGATIONS)), st.sampled_from((0.1, 0.5))
)
def test_ppo_loss_is_policy_plus_vf_coef_times_the_shared_value_loss(x, value_clip, loss_agg, vf_coef):
    with jax.enable_x64(True):
        batch, logprobs, values = make_batch(x), jnp.asarray(x["logprobs"]), jnp.asarray(x["values"])
        (full, (full_sum, full_metrics)), (full_dlogp, full_dv) = _ppo(vf_coef, value_clip, loss_agg)(
            logprobs, values, batch
        )
        (policy, (policy_sum, _)), (policy_dlogp, policy_dv) = _ppo(0.0, value_clip, loss_agg)(logprobs, values, batch)
        (value, (value_sum, value_metrics)), value_dv = _aggregated_value(value_clip, loss_agg)(values, batch)
    np.testing.assert_allclose(float(full_sum.denom), float(policy_sum.denom))
    np.testing.assert_allclose(float(full_sum.denom), float(value_sum.denom))
    np.testing.assert_allclose(float(full), float(policy) + vf_coef * float(value), rtol=1e-12, atol=1e-15)
    np.testing.assert_allclose(np.asarray(full_dlogp), np.asarray(policy_dlogp), rtol=1e-12, atol=1e-15)
    assert not np.any(np.asarray(policy_dv))
    np.testing.assert_allclose(np.asarray(full_dv), vf_coef * np.asarray(value_dv), rtol=1e-12, atol=1e-15)
    for name, metric in value_metrics.items():
        assert float(full_metrics[name]) == float(metric), name


@functools.cache
def _critic(vf_coef, value_clip):
    def loss(values, batch):
        total, metrics = value_loss(values, batch, value_clip=value_clip, vf_coef=vf_coef)
        return total.value, (total, compute_metrics(metrics))

    return jax.jit(jax.value_and_grad(loss, has_aux=True))


@SETTINGS
@given(value_batches(), st.sampled_from(VALUE_CLIPS), st.sampled_from((0.25, 3.0)))
def test_critic_value_loss_scales_with_vf_coef(x, value_clip, vf_coef):
    with jax.enable_x64(True):
        batch, values = make_batch(x), jnp.asarray(x["values"])
        (one, (one_sum, one_metrics)), one_grad = _critic(1.0, value_clip)(values, batch)
        (scaled, (scaled_sum, scaled_metrics)), scaled_grad = _critic(vf_coef, value_clip)(values, batch)
        (shared, (shared_sum, _)), _ = _aggregated_value(value_clip, "token_mean")(values, batch)
    # vf_coef = 1 is the token mean of the shared loss; vf_coef = c scales the sum, never the denominator.
    assert float(one_sum.total) == float(shared_sum.total) and float(one_sum.denom) == float(shared_sum.denom)
    assert float(scaled_sum.denom) == float(one_sum.denom)
    np.testing.assert_allclose(float(scaled_sum.total), vf_coef * float(one_sum.total), rtol=1e-12, atol=1e-15)
    np.testing.assert_allclose(float(scaled), vf_coef * float(one), rtol=1e-12, atol=1e-15)
    np.testing.assert_allclose(np.asarray(scaled_grad), vf_coef * np.asarray(one_grad), rtol=1e-12, atol=1e-15)
    assert scaled_metrics.keys() == one_metrics.keys()
    for name, metric in one_metrics.items():
        assert float(scaled_metrics[name]) == float(metric), name  # metrics are not scaled by vf_coef


def _tiny_batch(**overrides) -> TrainBatch:
    x = jnp.zeros((1, 2))
    fields = dict(
        tokens=jnp.zeros((1, 2), jnp.int32),
        positions=jnp.zeros((1, 2), jnp.int32),
        segment_ids=jnp.ones((1, 2), jnp.int32),
        loss_mask=jnp.ones((1, 2)),
        advantages=x,
        old_logprobs=x,
        values=x,
        returns=jnp.ones((1, 2)),
    )
    return TrainBatch(**(fields | overrides))


def test_value_loss_input_checks():
    values = jnp.ones((1, 2))
    with pytest.raises(ValueError, match="vf_coef must be > 0"):
        value_loss(values, _tiny_batch(), vf_coef=0.0)
    with pytest.raises(ValueError, match=r"value_loss: batch.returns is required"):
        value_loss(values, _tiny_batch(returns=None))
    with pytest.raises(ValueError, match=r"value_loss: batch.values is required"):
        value_loss(values, _tiny_batch(values=None), value_clip=0.2)
    with pytest.raises(ValueError, match=r"ppo_loss: `values` has shape \(1, 3\)"):
        ppo_loss(jnp.zeros((1, 2)), _tiny_batch(), values=jnp.ones((1, 3)))
    # The plain squared error needs no rollout-time values.
    loss, metrics = value_loss(values, _tiny_batch(values=None), value_clip=None)
    assert float(loss.total) == 0.0 and "loss/value_clip_frac" not in metrics
