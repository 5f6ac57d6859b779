"""Advantage estimators against Python loops, with hypothesis-drawn groups, masks and values."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from feynrl_jax.losses import advantages

SETTINGS = settings(max_examples=30, deadline=None)
# Jitted once per shape (shapes come from small pools): far cheaper than eager op-by-op compilation.
_group_zscore = jax.jit(advantages.group_zscore)
_group_mean = jax.jit(advantages.group_mean)
_rloo = jax.jit(advantages.rloo)
_reinforce_pp = jax.jit(advantages.reinforce_pp)


@st.composite
def grouped_rewards(draw):
    """Rewards [N], consecutive group ids [N] with random group sizes, completion mask [N, C].

    N and C come from small pools so compiled programs are shared between examples (test-time budget); the
    group sizes are random cuts of N.
    """
    n = draw(st.sampled_from([4, 9, 16]))
    cuts = sorted(draw(st.sets(st.integers(1, n - 1), max_size=6)))
    sizes = list(np.diff([0, *cuts, n]))
    group_id = np.repeat(np.arange(len(sizes)) * 3 + 7, sizes).astype(np.int32)
    discrete = draw(st.booleans())
    elements = st.sampled_from([0.0, 1.0]) if discrete else st.floats(-5, 5, width=32)
    rewards = np.array(draw(st.lists(elements, min_size=n, max_size=n)), np.float32)
    width = draw(st.sampled_from([1, 6]))
    lengths = draw(st.lists(st.integers(0, width), min_size=n, max_size=n))
    mask = (np.arange(width)[None, :] < np.array(lengths)[:, None]).astype(np.float32)
    return rewards, group_id, mask, sizes


def _groups(sizes):
    start = 0
    for size in sizes:
        yield slice(start, start + size)
        start += size


@SETTINGS
@given(grouped_rewards())
def test_group_zscore_has_zero_mean_and_unit_std_per_group(inputs):
    rewards, group_id, mask, sizes = inputs
    adv = np.asarray(_group_zscore(jnp.asarray(rewards), jnp.asarray(group_id), jnp.ones((len(rewards), 1))))
    for group in _groups(sizes):
        a, r = adv[group, 0], rewards[group].astype(np.float64)
        np.testing.assert_allclose(a.mean(), 0.0, atol=1e-5)
        if len(r) > 1 and r.std(ddof=1) > 1e-3:
            np.testing.assert_allclose(a.std(ddof=1), 1.0, rtol=1e-3)
            np.testing.assert_allclose(a, (r - r.mean()) / (r.std(ddof=1) + 1e-6), rtol=1e-4, atol=1e-5)
        if len(r) == 1:
            assert a[0] == 0.0


@SETTINGS
@given(grouped_rewards())
def test_sequence_estimators_match_loops_and_broadcast_over_the_mask(inputs):
    rewards, group_id, mask, sizes = inputs
    expected_mean, expected_rloo = np.zeros(len(rewards)), np.zeros(len(rewards))
    for group in _groups(sizes):
        r = rewards[group].astype(np.float64)
        n = len(r)
        if n > 1:
            expected_mean[group] = r - r.mean()
            expected_rloo[group] = [r[i] - (r.sum() - r[i]) / (n - 1) for i in range(n)]
    args = (jnp.asarray(rewards), jnp.asarray(group_id), jnp.asarray(mask))
    for fn, expected in ((_group_mean, expected_mean), (_rloo, expected_rloo)):
        out = np.asarray(fn(*args))
        np.testing.assert_allclose(out, expected[:, None] * mask, rtol=1e-5, atol=1e-5, err_msg=str(fn))
    zscore = np.asarray(_group_zscore(*args))
    np.testing.assert_array_equal(zscore[mask == 0], 0.0)


@SETTINGS
@given(grouped_rewards(), st.booleans())
def test_reinforce_pp_whitens_returns_over_valid_tokens(inputs, with_penalty):
    rewards, group_id, mask, _ = inputs
    rng = np.random.default_rng(len(rewards))
    penalty = rng.uniform(0, 0.5, mask.shape).astype(np.float32) if with_penalty else None
    out = np.asarray(
        _reinforce_pp(
            jnp.asarray(rewards),
            jnp.asarray(group_id),
            jnp.asarray(mask),
            token_penalty=None if penalty is None else jnp.asarray(penalty),
        )
    )
    returns = []
    for i in range(len(rewards)):
        for t in range(mask.shape[1]):
            if mask[i, t]:
                future = 0.0 if penalty is None else sum(penalty[i, s] * mask[i, s] for s in range(t, mask.shape[1]))
                returns.append(rewards[i] - future)
    returns = np.array(returns, np.float64)
    np.testing.assert_array_equal(out[mask == 0], 0.0)
    if len(returns) > 1 and returns.std(ddof=1) > 1e-3:
        expected = (returns - returns.mean()) / (returns.std(ddof=1) + 1e-6)
        np.testing.assert_allclose(out[mask > 0], expected, rtol=1e-4, atol=1e-4)


def _gae_loop(rewards, values, mask, done, gamma, lam):
    """Reference GAE: a plain Python loop over the valid tokens of each row."""
    adv = np.zeros_like(rewards, dtype=np.float64)
    for b in range(rewards.shape[0]):
        idx = [t for t in range(rewards.shape[1]) if mask[b, t] > 0]
        next_adv = 0.0
        for k in reversed(range(len(idx))):
            t = idx[k]
            if k + 1 < len(idx):
                next_value = values[b, idx[k + 1]]
            else:
                next_value = 0.0 if done[b] else values[b, t]
                next_adv = 0.0
            delta = rewards[b, t] + gamma * next_value - values[b, t]
            next_adv = delta + gamma * lam * next_adv
            adv[b, t] = next_adv
    return adv, (adv + values) * mask


_gae = jax.jit(advantages.gae)  # gamma and lam are traced: one compile per shape


@SETTINGS
@given(
    st.sampled_from([1, 3]),
    st.sampled_from([1, 6, 11]),
    st.floats(0.5, 1.0),
    st.floats(0.0, 1.0),
    st.integers(0, 2**31 - 1),
)
def test_scan_gae_equals_python_loop_gae(batch, length, gamma, lam, seed):
    rng = np.random.default_rng(seed)
    rewards = rng.normal(size=(batch, length)).astype(np.float32)
    values = rng.normal(size=(batch, length)).astype(np.float32)
    # Prompt offset, completion and right padding, plus occasional masked holes (e.g. tool outputs).
    mask = np.zeros((batch, length), np.float32)
    for b in range(batch):
        start, stop = sorted(rng.integers(0, length + 1, 2))
        mask[b, start:stop] = 1.0
        mask[b] *= rng.random(length) > 0.15
    done = rng.random(batch) > 0.5
    adv, ret = _gae(
        jnp.asarray(rewards), jnp.asarray(values), jnp.asarray(mask), jnp.asarray(done), gamma=gamma, lam=lam
    )
    expected_adv, expected_ret = _gae_loop(rewards, values, mask, done, gamma, lam)
    np.testing.assert_allclose(np.asarray(adv), expected_adv, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(np.asarray(ret), expected_ret, rtol=1e-4, atol=1e-4)


def test_gae_truncated_response_bootstraps_from_its_last_value():
    rewards = jnp.array([[0.0, 1.0], [0.0, 1.0]])
    values = jnp.array([[0.5, 2.0], [0.5, 2.0]])
    mask = jnp.array([[0.0, 1.0], [0.0, 1.0]])
    adv, ret = advantages.gae(rewards, values, mask, jnp.array([True, False]), gamma=0.9, lam=1.0)
    np.testing.assert_allclose(adv, [[0.0, 1.0 - 2.0], [0.0, 1.0 + 0.9 * 2.0 - 2.0]], rtol=1e-6)
    np.testing.assert_allclose(ret, [[0.0, 1.0], [0.0, 1.0 + 0.9 * 2.0]], rtol=1e-6)


def test_bad_shapes_name_the_argument():
    with pytest.raises(ValueError, match="group_id"):
        advantages.group_zscore(jnp.zeros(4), jnp.zeros(3, jnp.int32), jnp.ones((4, 2)))
    with pytest.raises(ValueError, match="completion_mask"):
        advantages.rloo(jnp.zeros(4), jnp.zeros(4, jnp.int32), jnp.ones((3, 2)))
    with pytest.raises(ValueError, match="done"):
        advantages.gae(jnp.zeros((2, 3)), jnp.zeros((2, 3)), jnp.ones((2, 3)), jnp.zeros(3, bool))
