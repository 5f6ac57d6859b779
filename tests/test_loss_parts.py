"""The wrappers of `feynrl_jax.train.loss_parts` do what they say, on random arrays under `jax.jit` (no model)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from feynrl_jax.losses import ALGORITHMS, TrainBatch, compute_metrics
from feynrl_jax.train.loss_parts import logprob_diagnostic_metrics, old_logprobs_from_current, with_logprob_diagnostics

B, T = 4, 12


def random_batch(seed: int, *, with_ref: bool = True) -> tuple[np.ndarray, np.ndarray, TrainBatch]:
    """`(logprobs, entropy, batch)`: right-padded rows, prompt of 3 tokens, behaviour near the current policy."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(6, T + 1, B)
    real = np.arange(T)[None, :] < lengths[:, None]
    mask = (real & (np.arange(T)[None, :] >= 3)).astype(np.float32)
    logprobs = (-2.0 + 0.5 * rng.standard_normal((B, T))).astype(np.float32) * mask
    entropy = rng.uniform(0.5, 3.0, (B, T)).astype(np.float32) * mask
    noisy = lambda scale: ((logprobs + scale * rng.standard_normal((B, T))) * mask).astype(np.float32)  # noqa: E731
    batch = TrainBatch(
        tokens=rng.integers(0, 50, (B, T)).astype(np.int32),
        positions=np.where(real, np.arange(T)[None, :], 0).astype(np.int32),
        segment_ids=real.astype(np.int32),
        loss_mask=mask,
        advantages=(rng.standard_normal((B, 1)) * mask).astype(np.float32),
        old_logprobs=noisy(0.2),
        ref_logprobs=noisy(0.3) if with_ref else None,
        behavior_logprobs=noisy(0.4),
    )
    return logprobs, entropy, batch


def reference_diagnostics(logprobs, entropy, batch) -> dict[str, float]:
    """The diagnostics in float64 NumPy, over the `loss_mask` tokens."""
    on = batch.loss_mask > 0
    c, b = logprobs[on].astype(np.float64), batch.behavior_logprobs[on].astype(np.float64)
    d = b - c
    w = np.exp(c - b)
    out = {
        "rollout/logprob_mismatch_kl": d.mean(),
        "rollout/logprob_mismatch_k3": (np.exp(-d) - 1 + d).mean(),
        "rollout/logprob_mismatch_max_abs": np.abs(d).max(),
        "rollout/behavior_ess": w.sum() ** 2 / (w.size * (w**2).sum()),
        "train/entropy": entropy[on].astype(np.float64).mean(),
    }
    if batch.ref_logprobs is not None:
        r = batch.ref_logprobs[on].astype(np.float64) - c
        out["train/kl_ref"] = (np.exp(r) - 1 - r).mean()
    return out


@pytest.mark.parametrize("with_ref", [True, False])
def test_diagnostic_metrics_match_numpy(with_ref):
    logprobs, entropy, batch = random_batch(0, with_ref=with_ref)
    got = compute_metrics(jax.jit(logprob_diagnostic_metrics)(logprobs, entropy, batch))
    want = reference_diagnostics(logprobs, entropy, batch)
    assert got.keys() == want.keys()
    for key, value in want.items():
        np.testing.assert_allclose(float(got[key]), value, rtol=2e-5, atol=1e-6, err_msg=key)
    assert 0.0 < float(got["rollout/behavior_ess"]) < 1.0


def test_behavior_ess_is_one_on_policy_and_weighted_by_tokens():
    logprobs, entropy, batch = random_batch(1)
    on_policy = dataclasses.replace(batch, behavior_logprobs=logprobs)
    ess = logprob_diagnostic_metrics(logprobs, entropy, on_policy)["rollout/behavior_ess"]
    assert float(ess.value) == pytest.approx(1.0, abs=1e-6)
    assert float(ess.weight) == float(batch.loss_mask.sum()) and ess.reduce == "mean"


def test_old_logprobs_from_current_equals_passing_the_current_logprobs():
    logprobs, _, batch = random_batch(2)
    loss = ALGORITHMS["grpo"].make_loss(kl_coef=0.05)
    wrapped = old_logprobs_from_current(loss)
    explicit = lambda lp, b: loss(lp, dataclasses.replace(b, old_logprobs=jax.lax.stop_gradient(lp) * b.loss_mask))  # noqa: E731

    def value_and_grad(fn):
        (total, metrics), grad = jax.jit(
            jax.value_and_grad(lambda lp: (fn(lp, batch)[0].total, fn(lp, batch)[1]), has_aux=True)
        )(logprobs)
        return float(total), {k: float(v) for k, v in compute_metrics(metrics).items()}, np.asarray(grad)

    got, want = value_and_grad(wrapped), value_and_grad(explicit)
    assert got[0] == want[0] and got[1] == want[1]
    np.testing.assert_array_equal(got[2], want[2])
    # ... which is the ratio-1 policy gradient, not the loss on the batch's own old_logprobs.
    assert got[1]["loss/ratio_mean"] == pytest.approx(1.0, abs=1e-6)
    assert got[0] != float(loss(logprobs, batch)[0].total)


@pytest.mark.parametrize("pass_entropy", [True, False])
def test_diagnostics_add_metrics_and_keep_the_loss(pass_entropy):
    logprobs, entropy, batch = random_batch(3)
    loss = ALGORITHMS["grpo"].make_loss(kl_coef=0.05)
    wrapped = with_logprob_diagnostics(loss, pass_entropy=pass_entropy)
    loss_sum, metrics = jax.jit(wrapped)(logprobs, batch, entropy=entropy)
    inner_sum, inner_metrics = jax.jit(loss)(logprobs, batch, **({"entropy": entropy} if pass_entropy else {}))
    assert float(loss_sum.total) == float(inner_sum.total) and float(loss_sum.denom) == float(inner_sum.denom)
    assert metrics.keys() == inner_metrics.keys() | reference_diagnostics(logprobs, entropy, batch).keys()
    assert ("loss/entropy" in metrics) == pass_entropy
    grad = jax.grad(lambda lp: wrapped(lp, batch, entropy=entropy)[0].total)(logprobs)
    np.testing.assert_allclose(grad, jax.grad(lambda lp: loss(lp, batch)[0].total)(logprobs), rtol=1e-6)


def test_diagnostics_need_the_entropy():
    logprobs, _, batch = random_batch(4)
    with pytest.raises(ValueError, match="with_entropy=True"):
        with_logprob_diagnostics(ALGORITHMS["sft"].make_loss())(jnp.asarray(logprobs), batch)
