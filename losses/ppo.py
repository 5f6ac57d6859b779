"""PPO: clipped surrogate with asymmetric clip, optional dual clip, clipped value loss and entropy bonus.

With ``r_t = pi(x_t) / pi_old(x_t)`` (see :mod:`off_policy`) and advantages ``A_t`` (e.g. from GAE):

* policy: ``l^pi_t = -w_t min(r_t A_t, clip(r_t, 1 - clip_low, 1 + clip_high) A_t)`` (Schulman et al. 2017,
  arXiv:1707.06347; separate low/high bounds as DAPO's clip-higher, Yu et al. 2025);
* dual clip (Ye et al. 2020, "Mastering Complex Control in MOBA Games with Deep RL", arXiv:1912.09729): for
  ``A_t < 0`` the surrogate is bounded below by ``dual_clip * A_t`` (``dual_clip > 1``), so a huge ratio on a
  bad token cannot produce an unbounded update;
* value: ``l^V_t = 0.5 max((V_t - R_t)^2, (V^old_t + clip(V_t - V^old_t, -value_clip, value_clip) - R_t)^2)``
  with ``V`` the current critic predictions (``values``), ``V^old`` = ``batch.values`` and ``R`` =
  ``batch.returns`` (``value_clip=None``: plain squared error), from :func:`value.clipped_value_error`, the
  function the separate critic's loss uses too;
* entropy bonus: ``-entropy_coef * H_t`` with ``H_t`` the current policy's per-token entropy (``entropy``).

``l_t = l^pi_t + vf_coef l^V_t - entropy_coef H_t``, aggregated with ``loss_agg`` (default ``token_mean``).
``w_t`` is the optional off-policy weight (``tis_cap``/``decoupled``), applied to the policy term only.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from feynrl_jax.losses import aggregation, off_policy, value
from feynrl_jax.losses import metrics as metrics_lib
from feynrl_jax.losses.batch import TrainBatch, check_inputs, check_per_token


def ppo_loss(
    logprobs: jax.Array,
    batch: TrainBatch,
    *,
    entropy: jax.Array | None = None,
    values: jax.Array | None = None,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = None,
    vf_coef: float = 0.5,
    value_clip: float | None = 0.2,
    entropy_coef: float = 0.0,
    loss_agg: str = "token_mean",
    max_tokens: float | None = None,
    tis_cap: float | None = None,
    decoupled: bool = False,
) -> tuple[aggregation.LossSum, dict[str, metrics_lib.Metric]]:
    """PPO actor-critic loss.

    Args:
        logprobs: [B, T] f32 current-policy log-probabilities.
        batch: the batch; needs ``values`` and ``returns`` when ``vf_coef > 0``.
        entropy: [B, T] current-policy entropy; required when ``entropy_coef > 0``.
        values: [B, T] current critic predictions; required when ``vf_coef > 0``.
        clip_low: ratio lower bound ``1 - clip_low``.
        clip_high: ratio upper bound ``1 + clip_high``.
        dual_clip: constant ``c > 1`` of the dual clip, or None.
        vf_coef: weight of the value loss (0: no critic term).
        value_clip: clip range of the value update around ``batch.values``, or None.
        entropy_coef: weight of the entropy bonus.
        loss_agg: aggregation mode (see :mod:`aggregation`).
        max_tokens: normaliser of ``seq_mean_token_sum``.
        tis_cap: truncated importance weight cap (see :mod:`off_policy`).
        decoupled: decoupled objective with a proximal policy (see :mod:`off_policy`).

    Returns:
        (LossSum, metrics).

    References:
        Schulman et al. 2017, "Proximal Policy Optimization Algorithms", arXiv:1707.06347.
    """
    check_inputs("ppo_loss", logprobs, batch, required=("values", "returns") if vf_coef > 0 else ())
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"ppo_loss: dual_clip must be > 1, got {dual_clip}")
    mask, advantages = batch.loss_mask, batch.advantages
    log_ratio, weight, metrics = off_policy.policy_ratio(
        logprobs, batch, tis_cap=tis_cap, decoupled=decoupled, loss_name="ppo_loss"
    )
    ratio = jnp.exp(log_ratio)
    surrogate = jnp.minimum(ratio * advantages, jnp.clip(ratio, 1.0 - clip_low, 1.0 + clip_high) * advantages)
    if dual_clip is not None:
        dual_active = (advantages < 0) & (surrogate < dual_clip * advantages)
        surrogate = jnp.where(advantages < 0, jnp.maximum(surrogate, dual_clip * advantages), surrogate)
        metrics["loss/dual_clip_frac"] = metrics_lib.mean_metric(dual_active.astype(ratio.dtype), mask)
    policy = -weight * surrogate
    per_token = policy
    metrics["loss/policy"] = metrics_lib.mean_metric(policy, mask)
    metrics["loss/clip_frac"] = off_policy.clip_fraction(ratio, 1.0 - clip_low, 1.0 + clip_high, advantages, mask)

    if vf_coef > 0:
        value_per_token, value_metrics = value.clipped_value_error(
            values, batch, value_clip=value_clip, loss_name="ppo_loss"
        )
        per_token = per_token + vf_coef * value_per_token
        metrics.update(value_metrics)

    if entropy_coef > 0:
        entropy = check_per_token("ppo_loss", "entropy", entropy, logprobs.shape)
        per_token = per_token - entropy_coef * entropy
    if entropy is not None:
        metrics["loss/entropy"] = metrics_lib.mean_metric(entropy, mask)

    loss = aggregation.aggregate(per_token, mask, batch.segment_ids, mode=loss_agg, max_tokens=max_tokens)
    return loss, metrics
