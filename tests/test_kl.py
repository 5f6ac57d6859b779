"""KL estimators: exact zero at identical policies, non-negativity, unbiasedness, clamp, dtype."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from feynrl_jax.losses import kl

SETTINGS = settings(max_examples=30, deadline=None)
# Shapes come from a small pool so eager op compilation is shared between examples (test-time budget).
SHAPES = st.sampled_from([(1, 1), (2, 7), (4, 16)])
logprob_arrays = hnp.arrays(np.float32, SHAPES, elements=st.floats(-60.0, 0.0, width=32))


@SETTINGS
@given(logprob_arrays)
def test_kl_of_identical_policies_is_exactly_zero(logprobs):
    x = jnp.asarray(logprobs)
    for name, estimator in kl.KL_ESTIMATORS.items():
        np.testing.assert_array_equal(np.asarray(estimator(x, x)), 0.0, err_msg=name)


@SETTINGS
@given(st.data())
def test_k3_and_k2_never_negative(data):
    logprobs = data.draw(logprob_arrays)
    ref = data.draw(hnp.arrays(np.float32, logprobs.shape, elements=st.floats(-60.0, 0.0, width=32)))
    # Also tiny differences, where k3 = expm1(x) - x suffers most from rounding.
    ref_close = logprobs + data.draw(
        hnp.arrays(np.float32, logprobs.shape, elements=st.floats(-(0.5**20), 0.5**20, width=32))
    )
    for r in (ref, ref_close):
        assert np.all(np.asarray(kl.k3(jnp.asarray(logprobs), jnp.asarray(r))) >= 0.0)
        assert np.all(np.asarray(kl.k2(jnp.asarray(logprobs), jnp.asarray(r))) >= 0.0)


def test_k1_and_k3_are_unbiased_for_the_exact_kl():
    rng = np.random.default_rng(0)
    p = rng.dirichlet(np.ones(7))
    q = rng.dirichlet(np.ones(7))
    exact = float(np.sum(p * (np.log(p) - np.log(q))))
    logp, logq = jnp.asarray(np.log(p), jnp.float32), jnp.asarray(np.log(q), jnp.float32)
    for estimator in (kl.k1, kl.k3):
        expectation = float(jnp.sum(jnp.asarray(p, jnp.float32) * estimator(logp[None], logq[None])[0]))
        np.testing.assert_allclose(expectation, exact, rtol=1e-5)
    # k2 is biased but agrees to second order for close distributions.
    q_close = p * np.exp(1e-2 * rng.normal(size=7))
    q_close /= q_close.sum()
    exact_close = float(np.sum(p * (np.log(p) - np.log(q_close))))
    k2_close = float(jnp.sum(p * kl.k2(jnp.log(p)[None], jnp.log(q_close)[None])[0]))
    np.testing.assert_allclose(k2_close, exact_close, rtol=0.05)


def test_log_ratio_clamp_bounds_values_and_gradients():
    logprobs = jnp.array([[-200.0, 0.0, -1.0]])
    ref = jnp.array([[0.0, -200.0, -1.5]])
    bound = kl.LOG_RATIO_CLAMP
    values = kl.k3(logprobs, ref)
    np.testing.assert_allclose(values[0, 0], np.expm1(bound) - bound, rtol=1e-6)
    np.testing.assert_allclose(values[0, 1], np.expm1(-bound) + bound, rtol=1e-6)
    for estimator in kl.KL_ESTIMATORS.values():
        grads = jax.grad(lambda x, e=estimator: jnp.sum(e(x, ref)))(logprobs)
        assert np.all(np.isfinite(np.asarray(grads)))
        # Beyond the clamp the estimator is constant: zero gradient; inside it is not.
        assert grads[0, 0] == 0.0 and grads[0, 1] == 0.0 and grads[0, 2] != 0.0


def test_estimators_compute_in_float32_from_bfloat16():
    x = jnp.array([[-1.0, -2.0]], jnp.bfloat16)
    y = jnp.array([[-1.5, -0.5]], jnp.bfloat16)
    for estimator in kl.KL_ESTIMATORS.values():
        assert estimator(x, y).dtype == jnp.float32


def test_reward_penalty_is_masked_scaled_and_has_no_gradient():
    logprobs = jnp.array([[-1.0, -2.0, -0.5]])
    ref = jnp.array([[-1.5, -1.0, -0.7]])
    mask = jnp.array([[0.0, 1.0, 1.0]])
    penalty = kl.kl_reward_penalty(logprobs, ref, mask, kl_coef=0.1, estimator="k1")
    np.testing.assert_allclose(penalty, [[0.0, 0.1 * -1.0, 0.1 * 0.2]], rtol=1e-6)
    grad = jax.grad(lambda x: jnp.sum(kl.kl_reward_penalty(x, ref, mask, kl_coef=0.1)))(logprobs)
    np.testing.assert_array_equal(grad, 0.0)
    with pytest.raises(ValueError, match="k4"):
        kl.kl_estimate(logprobs, ref, estimator="k4")
