"""Per-token KL estimators between the policy and a reference (Schulman, "Approximating KL Divergence", 2020).

Tokens are sampled from the policy ``pi``; with ``log_r = log pi_ref(x) - log pi(x)`` (clamped, see below):

* ``k1 = -log_r``: unbiased for KL(pi || ref), high variance, can be negative.
* ``k2 = 0.5 * log_r ** 2``: biased, low variance, never negative; its gradient is the gradient of the
  reverse KL's second-order expansion.
* ``k3 = exp(log_r) - 1 - log_r``: unbiased for KL(pi || ref), never negative (used by GRPO, Shao et al. 2024).
  Computed as ``expm1(log_r) - log_r`` (no cancellation near 0) and floored at 0 so rounding noise can never
  make it negative.

All three are exactly 0 where the two log-probabilities are equal.

Clamp: ``log_r`` is clamped to ``[-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP]`` = ``[-20, 20]`` before use, so
``exp(log_r) <= e**20 ~ 4.9e8`` stays finite in float32 (and its square in k3's gradient too). Beyond the bound
the estimator is constant and its gradient is 0; a token 20 nats away from the reference is a bug or a
numerical accident that should not blow up the update.

Estimators are computed in float32 or wider: bfloat16 inputs are upcast, float64 inputs stay float64. They are
usable as a loss term (``kl_coef * k(.)`` aggregated like the rest of the loss) or as a per-token reward
penalty (:func:`kl_reward_penalty`).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

LOG_RATIO_CLAMP = 20.0


def _log_ratio(logprobs: jax.Array, ref_logprobs: jax.Array) -> jax.Array:
    dtype = jnp.promote_types(jnp.result_type(logprobs, ref_logprobs), jnp.float32)
    log_r = ref_logprobs.astype(dtype) - logprobs.astype(dtype)
    return jnp.clip(log_r, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


def k1(logprobs: jax.Array, ref_logprobs: jax.Array) -> jax.Array:
    """k1 = log pi - log ref. Args: [B, T] each. Returns: [B, T]."""
    return -_log_ratio(logprobs, ref_logprobs)


def k2(logprobs: jax.Array, ref_logprobs: jax.Array) -> jax.Array:
    """k2 = 0.5 (log ref - log pi)^2. Args: [B, T] each. Returns: [B, T]."""
    return 0.5 * jnp.square(_log_ratio(logprobs, ref_logprobs))


def k3(logprobs: jax.Array, ref_logprobs: jax.Array) -> jax.Array:
    """k3 = ref/pi - 1 - log(ref/pi), never negative. Args: [B, T] each. Returns: [B, T]."""
    log_r = _log_ratio(logprobs, ref_logprobs)
    return jnp.maximum(jnp.expm1(log_r) - log_r, 0.0)


KL_ESTIMATORS: dict[str, Callable[[jax.Array, jax.Array], jax.Array]] = {"k1": k1, "k2": k2, "k3": k3}


def kl_estimate(logprobs: jax.Array, ref_logprobs: jax.Array, *, estimator: str) -> jax.Array:
    """Per-token KL(pi || ref) with the named estimator.

    Args:
        logprobs: [B, T] log-probabilities of the sampled tokens under the policy.
        ref_logprobs: [B, T] the same under the reference.
        estimator: "k1", "k2" or "k3".

    Returns:
        [B, T] per-token estimates (not masked).

    Raises:
        ValueError: for an unknown estimator.
    """
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"kl_estimator={estimator!r} is not one of {sorted(KL_ESTIMATORS)}")
    return KL_ESTIMATORS[estimator](logprobs, ref_logprobs)


def kl_reward_penalty(
    logprobs: jax.Array, ref_logprobs: jax.Array, mask: jax.Array, *, kl_coef: float, estimator: str = "k1"
) -> jax.Array:
    """A per-token reward penalty ``kl_coef * k(pi || ref)`` on valid tokens, with no gradient.

    Args:
        logprobs: [B, T] behaviour (or old-policy) log-probabilities of the sampled tokens.
        ref_logprobs: [B, T] reference log-probabilities.
        mask: [B, T] completion mask.
        kl_coef: penalty coefficient.
        estimator: "k1" (the classic RLHF reward penalty, Ouyang et al. 2022), "k2" or "k3".

    Returns:
        [B, T] penalties to subtract from per-token rewards (0 where ``mask`` is 0).
    """
    penalty = kl_coef * kl_estimate(logprobs, ref_logprobs, estimator=estimator) * mask
    return jax.lax.stop_gradient(penalty)
