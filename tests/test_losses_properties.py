"""Property tests (hypothesis) for the losses: reductions to REINFORCE, ESS, DPO at equal log-ratios, and exact
micro-batch accumulation for every aggregation mode.

The reduction to REINFORCE runs the public kit's ``ratio_one`` check (``feynrl_jax.testing.check_loss``); exact
micro-batch accumulation of every registered loss is a check of the contract table (tests/test_losses_contract.py).

Shapes are drawn from small pools and the functions under test are jitted, so each shape compiles once and
the examples stay within the test-time budget; values, masks, segmentations and splits are drawn freely.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from feynrl_jax.losses import (
    AGGREGATIONS,
    ALGORITHMS,
    TrainBatch,
    aggregate,
    compute_metrics,
    dpo_loss,
    ipo_loss,
    off_policy,
)
from feynrl_jax.testing import check_loss

SETTINGS = settings(max_examples=25, deadline=None)


@st.composite
def token_batches(draw, shapes=((3, 7), (6, 5)), packed=True):
    """A random batch: prompt prefix + completion + right padding per sequence, optionally packed rows."""
    b, t = draw(st.sampled_from(shapes))
    seed = draw(st.integers(0, 2**31 - 1))
    rng = np.random.default_rng(seed)
    segment_ids = np.zeros((b, t), np.int32)
    mask = np.zeros((b, t), np.float32)
    for row in range(b):
        start, segment = 0, 1
        n_segments = draw(st.integers(1, 3)) if packed else 1
        for _ in range(n_segments):
            if start >= t:
                break
            length = int(rng.integers(1, t - start + 1))
            segment_ids[row, start : start + length] = segment
            prompt = int(rng.integers(1, length + 1))  # at least the first token is not predicted
            mask[row, start + prompt : start + length] = 1.0
            start += length
            segment += 1
    logprobs = -rng.uniform(0.05, 3.0, (b, t)).astype(np.float32)
    adv = rng.normal(size=(b, t)).astype(np.float32)
    return {
        "segment_ids": segment_ids,
        "loss_mask": mask,
        "logprobs": logprobs,
        "advantages": adv,
        "old_logprobs": (logprobs + 0.2 * rng.normal(size=(b, t))).astype(np.float32),
        "ref_logprobs": (logprobs + 0.2 * rng.normal(size=(b, t))).astype(np.float32),
        "values": rng.normal(size=(b, t)).astype(np.float32),
        "returns": rng.normal(size=(b, t)).astype(np.float32),
        "critic": rng.normal(size=(b, t)).astype(np.float32),
        "entropy": rng.uniform(0, 2, (b, t)).astype(np.float32),
    }


def make_batch(arrays, rows=slice(None), **overrides) -> TrainBatch:
    a = {k: np.asarray(v)[rows] for k, v in {**arrays, **overrides}.items()}
    positions = np.zeros_like(a["segment_ids"])
    return TrainBatch(
        tokens=jnp.ones_like(jnp.asarray(a["segment_ids"])),
        positions=jnp.asarray(positions),
        segment_ids=jnp.asarray(a["segment_ids"]),
        loss_mask=jnp.asarray(a["loss_mask"]),
        advantages=jnp.asarray(a["advantages"]),
        old_logprobs=jnp.asarray(a["old_logprobs"]),
        ref_logprobs=jnp.asarray(a["ref_logprobs"]),
        values=jnp.asarray(a["values"]),
        returns=jnp.asarray(a["returns"]),
    )


# --- At ratio 1 with no clipping active, the policy gradient is the REINFORCE gradient (the kit's `ratio_one`). ----

# Hyperparameters that leave only the policy term's gradient wrt logprobs (no KL to the reference).
PG_CASES = {
    "ppo": dict(vf_coef=0.0, entropy_coef=0.0, dual_clip=3.0),
    "grpo": dict(kl_coef=0.0),
    "dr_grpo": dict(max_tokens=9.0),
    "dapo": {},
    "cispo": dict(clip_low=0.2),
    "p3o": {},
    "gspo": {},
}


@pytest.mark.parametrize("name", sorted(PG_CASES))
def test_policy_gradient_at_ratio_one_is_reinforce(name):
    hp = ALGORITHMS[name].hyperparameters | PG_CASES[name]
    report = check_loss(
        ALGORITHMS[name].make_loss(**PG_CASES[name]),
        ratio_one=hp["loss_agg"],
        max_tokens=hp["max_tokens"],
        checks=["ratio_one"],
        max_examples=5,
    )
    assert "ratio_one" in report.passed


# --- P3O: identical policies have ESS = 1; otherwise ESS <= 1. ------------------------------------------------


@functools.cache
def _p3o_metrics():
    loss_fn = ALGORITHMS["p3o"].make_loss()
    return jax.jit(lambda logprobs, batch: compute_metrics(loss_fn(logprobs, batch)[1]))


@SETTINGS
@given(token_batches(), st.floats(0.0, 2.0))
def test_p3o_ess(arrays, spread):
    identical = _p3o_metrics()(jnp.asarray(arrays["logprobs"]), make_batch(arrays, old_logprobs=arrays["logprobs"]))
    if not arrays["loss_mask"].any():
        # No token counts: the ESS itself is 1 by definition, and its metric has weight 0 (so it reads 0 and adds
        # nothing when micro-batches are combined).
        assert float(off_policy.effective_sample_size(jnp.ones((2, 3)), jnp.zeros((2, 3)))) == 1.0
        assert float(identical["loss/ess"]) == 0.0
        return
    np.testing.assert_allclose(float(identical["loss/ess"]), 1.0, rtol=1e-6)
    assert float(identical["loss/clip_frac"]) == 0.0
    shifted = arrays["logprobs"] + spread * np.random.default_rng(0).normal(size=arrays["logprobs"].shape)
    other = _p3o_metrics()(jnp.asarray(arrays["logprobs"]), make_batch(arrays, old_logprobs=shifted))
    assert 0.0 < float(other["loss/ess"]) <= 1.0 + 1e-6


# --- DPO with equal chosen/rejected log-ratios gives log 2. ------------------------------------------------------


_dpo = jax.jit(dpo_loss, static_argnames=("length_normalize",))  # beta, label_smoothing are traced
_ipo = jax.jit(ipo_loss, static_argnames=("length_normalize",))


@SETTINGS
@given(
    st.sampled_from([1, 3]),
    st.floats(0.01, 1.0),
    st.floats(0.0, 0.5),
    st.booleans(),
    st.integers(0, 2**31 - 1),
)
def test_dpo_equal_log_ratios_give_log_two(pairs, beta, label_smoothing, length_normalize, seed):
    rng = np.random.default_rng(seed)
    t = 6
    chosen = {
        "loss_mask": (np.arange(t) >= rng.integers(1, t, pairs)[:, None]).astype(np.float32),
        "logprobs": -rng.uniform(0, 5, (pairs, t)).astype(np.float32),
        "ref_logprobs": -rng.uniform(0, 5, (pairs, t)).astype(np.float32),
    }
    # The rejected response of each pair is an exact copy of the chosen one: equal log-ratios, any values.
    arrays = {k: np.repeat(v, 2, axis=0) for k, v in chosen.items()}
    zeros = np.zeros((2 * pairs, t), np.float32)
    arrays |= {"segment_ids": np.ones((2 * pairs, t), np.int32), "advantages": zeros, "old_logprobs": zeros}
    arrays |= {"values": zeros, "returns": zeros}
    batch = make_batch(arrays)
    logprobs = jnp.asarray(arrays["logprobs"])
    loss, metrics = _dpo(logprobs, batch, beta=beta, label_smoothing=label_smoothing, length_normalize=length_normalize)
    np.testing.assert_allclose(float(loss.value), np.log(2.0), rtol=1e-6)
    assert float(loss.denom) == pairs
    assert float(compute_metrics(metrics)["loss/reward_accuracy"]) == 0.0
    ipo, _ = _ipo(logprobs, batch, beta=beta, length_normalize=length_normalize)
    np.testing.assert_allclose(float(ipo.value), (1.0 / (2.0 * beta)) ** 2, rtol=1e-5)


# --- Micro-batches: combining (sum, denominator) pairs gives the one-batch loss and gradient. -------------------


@functools.cache
def _aggregate_fn(mode: str):
    max_tokens = 7.0 if mode == "seq_mean_token_sum" else None

    def loss_sum(logprobs, advantages, mask, segment_ids):
        # A generic differentiable per-token loss; the property is about the reduction.
        per_token = -advantages * logprobs + 0.5 * jnp.square(logprobs)
        return aggregate(per_token, mask, segment_ids, mode=mode, max_tokens=max_tokens)

    def total_and_grad(logprobs, advantages, mask, segment_ids):
        loss, grad = jax.value_and_grad(lambda x: loss_sum(x, advantages, mask, segment_ids).total)(logprobs)
        return loss_sum(logprobs, advantages, mask, segment_ids), grad

    return jax.jit(total_and_grad)


def _row_split(b: int, cuts: list[int]) -> list[slice]:
    bounds = [0, *sorted(set(c for c in cuts if 0 < c < b)), b]
    return [slice(lo, hi) for lo, hi in zip(bounds[:-1], bounds[1:])]


@SETTINGS
@given(token_batches(shapes=((4, 6),)), st.sampled_from(sorted(AGGREGATIONS)), st.lists(st.integers(1, 3)))
def test_micro_batches_combine_exactly_for_every_aggregation_mode(arrays, mode, cuts):
    fn = _aggregate_fn(mode)
    cols = ("logprobs", "advantages", "loss_mask", "segment_ids")
    full, full_grad = fn(*(jnp.asarray(arrays[c]) for c in cols))
    parts = [fn(*(jnp.asarray(arrays[c][rows]) for c in cols)) for rows in _row_split(4, cuts)]
    total = sum(float(p.total) for p, _ in parts)
    denom = sum(float(p.denom) for p, _ in parts)
    np.testing.assert_allclose(total, float(full.total), rtol=1e-5, atol=1e-6)
    assert denom == float(full.denom)
    # Denominators do not depend on the parameters, so the gradient is sum(grad total_k) / sum(denom_k).
    grad = np.concatenate([np.asarray(g) for _, g in parts]) / max(denom, 1.0)
    np.testing.assert_allclose(grad, np.asarray(full_grad) / max(float(full.denom), 1.0), rtol=1e-5, atol=1e-7)
