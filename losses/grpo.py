"""GRPO: the PPO clipped surrogate on group-relative advantages, with a KL-to-reference loss term.

With ``r_t = pi(x_t) / pi_old(x_t)`` (see :mod:`off_policy`) and group advantages ``A`` broadcast over the
completion (:func:`advantages.group_zscore`), the per-token loss is

    l_t = -w_t min(r_t A_t, clip(r_t, 1 - clip_low, 1 + clip_high) A_t) + kl_coef k(pi || ref)_t

The gradient flows through the ratio; a token whose clip is active gets no gradient (it is "clipped out").
Aggregation: ``seq_mean_token_mean`` as in the paper (mean over each response's tokens, then over
responses); Dr. GRPO and DAPO are the same loss with other aggregation (see the registry).
KL: ``k3`` by default (the paper's unbiased, non-negative estimator), ``kl_coef = 0.04`` as in the paper;
``kl_coef = 0`` drops the term and the need for a reference model.

Departure from the paper: separate ``clip_low``/``clip_high`` (equal by default, i.e. the paper's eps) and the
optional off-policy weight ``w_t`` (1 by default), applied to the policy term only.

References:
    Shao et al. 2024, "DeepSeekMath: Pushing the Limits of Mathematical Reasoning in Open Language Models",
    arXiv:2402.03300.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from feynrl_jax.losses import aggregation, kl, off_policy
from feynrl_jax.losses import metrics as metrics_lib
from feynrl_jax.losses.batch import TrainBatch, check_inputs


def grpo_loss(
    logprobs: jax.Array,
    batch: TrainBatch,
    *,
    entropy: jax.Array | None = None,
    values: jax.Array | None = None,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    kl_coef: float = 0.04,
    kl_estimator: str = "k3",
    loss_agg: str = "seq_mean_token_mean",
    max_tokens: float | None = None,
    tis_cap: float | None = None,
    decoupled: bool = False,
) -> tuple[aggregation.LossSum, dict[str, metrics_lib.Metric]]:
    """GRPO loss.

    Args:
        logprobs: [B, T] f32 current-policy log-probabilities.
        batch: the batch; needs ``ref_logprobs`` when ``kl_coef > 0``.
        entropy: optional [B, T] entropy, only reported.
        values: unused (no critic).
        clip_low: ratio lower bound ``1 - clip_low``.
        clip_high: ratio upper bound ``1 + clip_high``.
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
    check_inputs("grpo_loss", logprobs, batch, required=("ref_logprobs",) if kl_coef > 0 else ())
    mask, advantages = batch.loss_mask, batch.advantages
    log_ratio, weight, metrics = off_policy.policy_ratio(
        logprobs, batch, tis_cap=tis_cap, decoupled=decoupled, loss_name="grpo_loss"
    )
    ratio = jnp.exp(log_ratio)
    clipped_ratio = jnp.clip(ratio, 1.0 - clip_low, 1.0 + clip_high)
    policy = -weight * jnp.minimum(ratio * advantages, clipped_ratio * advantages)
    metrics["loss/clip_frac"] = off_policy.clip_fraction(ratio, 1.0 - clip_low, 1.0 + clip_high, advantages, mask)
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
