"""CISPO: clip the importance-sampling weight, not the update, and keep every token's gradient.

With ``r_t = pi(x_t) / pi_old(x_t)`` (see :mod:`off_policy`) and group advantages ``A`` broadcast over the
completion (:func:`advantages.group_zscore`), the per-token loss is

    l_t = -w_t sg(clip(r_t, 1 - clip_low, 1 + clip_high)) A_t log pi(x_t) + kl_coef k(pi || ref)_t

The clipped ratio is a stop-gradient coefficient of a REINFORCE term, so a token whose ratio leaves the
trust region still gets a (down-weighted) gradient instead of being clipped out as in PPO/GRPO: rare
"fork" tokens (e.g. "However", "Recheck") keep contributing.
Aggregation: ``token_mean`` over the batch, as in the paper. No KL in the paper (``kl_coef = 0``).
Bounds: the paper's default is upper-only (``clip_low=None``: no lower bound on the weight; its
``eps_low`` is set "to a large value"); a number gives the two-sided clip.

Departure from the paper: the optional KL term (off by default) and off-policy weight ``w_t`` (1 by default),
for parity with :mod:`grpo`; the paper's token mask generalisation (recovering PPO's dropping) is not included.

References:
    MiniMax 2025, "MiniMax-M1: Scaling Test-Time Compute Efficiently with Lightning Attention",
    arXiv:2506.13585.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from feynrl_jax.losses import aggregation, kl, off_policy
from feynrl_jax.losses import metrics as metrics_lib
from feynrl_jax.losses.batch import TrainBatch, check_inputs


def cispo_loss(
    logprobs: jax.Array,
    batch: TrainBatch,
    *,
    entropy: jax.Array | None = None,
    values: jax.Array | None = None,
    clip_low: float | None = None,
    clip_high: float = 0.28,
    kl_coef: float = 0.0,
    kl_estimator: str = "k3",
    loss_agg: str = "token_mean",
    max_tokens: float | None = None,
    tis_cap: float | None = None,
    decoupled: bool = False,
) -> tuple[aggregation.LossSum, dict[str, metrics_lib.Metric]]:
    """CISPO loss.

    Args:
        logprobs: [B, T] f32 current-policy log-probabilities.
        batch: the batch; needs ``ref_logprobs`` when ``kl_coef > 0``.
        entropy: optional [B, T] entropy, only reported.
        values: unused (no critic).
        clip_low: weight lower bound ``1 - clip_low``, or None for no lower bound (the paper's default).
        clip_high: weight upper bound ``1 + clip_high``.
        kl_coef: weight of the KL-to-reference term.
        kl_estimator: "k1", "k2" or "k3" (see :mod:`kl`).
        loss_agg: aggregation mode (see :mod:`aggregation`).
        max_tokens: normaliser of ``seq_mean_token_sum``.
        tis_cap: truncated importance weight cap (see :mod:`off_policy`).
        decoupled: decoupled objective with a proximal policy (see :mod:`off_policy`).

    Returns:
        (LossSum, metrics).
    """
    del values
    check_inputs("cispo_loss", logprobs, batch, required=("ref_logprobs",) if kl_coef > 0 else ())
    mask, advantages = batch.loss_mask, batch.advantages
    log_ratio, weight, metrics = off_policy.policy_ratio(
        logprobs, batch, tis_cap=tis_cap, decoupled=decoupled, loss_name="cispo_loss"
    )
    ratio = jnp.exp(log_ratio)
    lower = 0.0 if clip_low is None else 1.0 - clip_low
    clipped_ratio = jax.lax.stop_gradient(jnp.clip(ratio, lower, 1.0 + clip_high))
    policy = -weight * clipped_ratio * advantages * logprobs
    truncated = (ratio > 1.0 + clip_high) | (ratio < lower)
    metrics["loss/clip_frac"] = metrics_lib.mean_metric(truncated.astype(ratio.dtype), mask)
    metrics["loss/policy"] = metrics_lib.mean_metric(policy, mask)
    per_token = policy

    if kl_coef > 0:
        kl_term = kl.kl_estimate(logprobs, batch.ref_logprobs, estimator=kl_estimator)
        per_token = per_token + kl_coef * kl_term
        metrics["loss/kl"] = metrics_lib.mean_metric(kl_term, mask)
    if entropy is not None:
        metrics["loss/entropy"] = metrics_lib.mean_metric(entropy, mask)

    loss = aggregation.aggregate(per_token, mask, batch.segment_ids, mode=loss_agg, max_tokens=max_tokens)
    return loss, metrics
