"""Off-policy corrections shared by every policy-gradient loss.

Three policies can be involved: the current policy ``pi`` (``logprobs``), the policy the ratio is taken against
(``batch.old_logprobs``) and the behaviour policy that actually sampled the tokens (``batch.behavior_logprobs``,
the rollout engine's exact sampling distribution).

Every policy-gradient loss takes two keywords and calls :func:`policy_ratio`:

* ``decoupled=False, tis_cap=None`` (default, on-policy PPO): ratio ``r = pi / pi_old``; no weight. The
  behaviour log-probabilities are not read.
* ``tis_cap=C`` (truncated importance sampling of the trainer/rollout mismatch; Yao et al. 2025, "Your
  Efficient RL Framework Secretly Brings You Off-Policy RL Training"): ``old_logprobs`` are the trainer's
  recomputation under the same weights that sampled the batch, ``behavior_logprobs`` the engine's; every
  per-token policy loss is multiplied by ``w = min(pi_old / pi_behavior, C)`` (no gradient).
* ``decoupled=True`` (the decoupled objective with a proximal policy; Hilton et al. 2022, "Batch
  size-invariance for policy optimization", used for asynchronous RL by AReaL, Fu et al. 2025):
  ``old_logprobs`` are a *proximal* policy (recent weights, recomputed by the trainer), ``behavior_logprobs``
  come from an older policy version. The trust region (clipping) is around the proximal policy,
  ``r = pi / pi_prox``, and the per-token loss is multiplied by ``w = min(pi_prox / pi_behavior, C)`` with
  ``C = tis_cap`` (``tis_cap=None``: untruncated).

Both corrections use the same weight formula; they differ in what ``old_logprobs`` means and therefore in how
far ``pi_old`` and ``pi_behavior`` may be apart (numerical mismatch vs several policy versions). Log-ratios are
clamped to ``[-20, 20]`` before ``exp`` (see ``kl.LOG_RATIO_CLAMP``).

Metrics: ``loss/ratio_mean``, ``loss/ratio_max``, ``loss/ratio_min``; with a weight also
``loss/is_weight_mean``, ``loss/is_weight_max``, ``loss/is_weight_capped_frac`` and ``loss/is_ess`` (the
normalised effective sample size of the weights over valid tokens).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from feynrl_jax.losses import metrics as metrics_lib
from feynrl_jax.losses.batch import TrainBatch
from feynrl_jax.losses.kl import LOG_RATIO_CLAMP


def clamped_log_ratio(numerator: jax.Array, denominator: jax.Array) -> jax.Array:
    """``numerator - denominator`` in float32 or wider, clamped to ``[-20, 20]``. Args/Returns: [B, T]."""
    dtype = jnp.promote_types(jnp.result_type(numerator, denominator), jnp.float32)
    return jnp.clip(numerator.astype(dtype) - denominator.astype(dtype), -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


def effective_sample_size(weights: jax.Array, mask: jax.Array) -> jax.Array:
    """Normalised effective sample size ``(sum w)^2 / (n sum w^2)`` over entries where ``mask`` is 1.

    Args:
        weights: [B, T] non-negative importance weights.
        mask: [B, T] 1 on the entries that count.

    Returns:
        [] ESS in ``(0, 1]``; 1 when all weights are equal, and 1 when no entry counts. No gradient.

    References:
        Kong 1992; normalised as in Fakoor et al. 2019, "P3O: Policy-on Policy-off Policy Optimization".
    """
    weights = jax.lax.stop_gradient(weights) * mask
    n = jnp.sum(mask)
    sum_w = jnp.sum(weights)
    denominator = n * jnp.sum(jnp.square(weights))
    ess = jnp.square(sum_w) / jnp.where(denominator > 0, denominator, 1)
    # <= 1 by Cauchy-Schwarz; float32 rounding of equal weights can land one ulp above it.
    return jnp.where(denominator > 0, jnp.minimum(ess, 1.0), 1.0)


def policy_ratio(
    logprobs: jax.Array,
    batch: TrainBatch,
    *,
    tis_cap: float | None = None,
    decoupled: bool = False,
    loss_name: str = "loss",
) -> tuple[jax.Array, jax.Array, dict[str, metrics_lib.Metric]]:
    """The log importance ratio of a policy-gradient loss and its off-policy weight.

    Args:
        logprobs: [B, T] current-policy log-probabilities.
        batch: the batch; ``old_logprobs`` is the ratio's denominator, ``behavior_logprobs`` is read only
            when a correction is on.
        tis_cap: cap ``C`` of the truncated weight ``min(pi_old / pi_behavior, C)``; None for no cap.
        decoupled: use the decoupled objective (weight on even without a cap).
        loss_name: the calling loss, for error messages.

    Returns:
        (log_ratio [B, T] = clamp(log pi - log pi_old), weight [B, T] without gradient (ones when no
        correction is on), metrics).

    Raises:
        ValueError: when a correction is on and ``batch.behavior_logprobs`` is None, or ``tis_cap <= 0``.
    """
    mask = batch.loss_mask
    log_ratio = clamped_log_ratio(logprobs, batch.old_logprobs)
    ratio = jnp.exp(log_ratio)
    out = {
        "loss/ratio_mean": metrics_lib.mean_metric(ratio, mask),
        "loss/ratio_max": metrics_lib.max_metric(ratio, mask),
        "loss/ratio_min": metrics_lib.min_metric(ratio, mask),
    }
    if tis_cap is None and not decoupled:
        return log_ratio, jnp.ones_like(log_ratio), out
    if tis_cap is not None and tis_cap <= 0:
        raise ValueError(f"{loss_name}: tis_cap must be positive, got {tis_cap}")
    if batch.behavior_logprobs is None:
        raise ValueError(f"{loss_name}: tis_cap/decoupled need batch.behavior_logprobs, which is None")
    weight = jnp.exp(clamped_log_ratio(batch.old_logprobs, batch.behavior_logprobs))
    capped = jnp.zeros_like(weight) if tis_cap is None else (weight > tis_cap).astype(weight.dtype)
    if tis_cap is not None:
        weight = jnp.minimum(weight, tis_cap)
    weight = jax.lax.stop_gradient(weight)
    out |= {
        "loss/is_weight_mean": metrics_lib.mean_metric(weight, mask),
        "loss/is_weight_max": metrics_lib.max_metric(weight, mask),
        "loss/is_weight_capped_frac": metrics_lib.mean_metric(capped, mask),
        "loss/is_ess": metrics_lib.scalar_metric(effective_sample_size(weight, mask), jnp.sum(mask)),
    }
    return log_ratio, weight, out


def clip_fraction(
    ratio: jax.Array, low: float, high: float, advantages: jax.Array, mask: jax.Array
) -> metrics_lib.Metric:
    """Fraction of valid tokens whose PPO-style clip is active (the clipped term is the smaller one).

    Args:
        ratio: [B, T] importance ratios.
        low: lower ratio bound (``1 - clip_low``).
        high: upper ratio bound (``1 + clip_high``).
        advantages: [B, T] advantages.
        mask: [B, T] loss mask.

    Returns:
        A "mean" Metric.
    """
    active = ((ratio > high) & (advantages > 0)) | ((ratio < low) & (advantages < 0))
    return metrics_lib.mean_metric(active.astype(ratio.dtype), mask)
