"""GSPO: a sequence-level importance ratio with sequence-level clipping.

For sequence ``i`` with valid tokens ``V_i`` and sequence advantage ``A_i`` (broadcast over its tokens):

    s_i = exp( (1 / |V_i|) sum_{t in V_i} (log pi(x_t) - log pi_old(x_t)) )     (geometric mean of token ratios)
    J_i = min(s_i A_i, clip(s_i, 1 - clip_low, 1 + clip_high) A_i)

averaged over sequences. Implemented in the GSPO-token form of the paper: every token carries
``s_{i,t} = sg(s_i) pi(x_t) / sg(pi(x_t))``, whose value is ``s_i`` (so the clip decision is per sequence) and
whose gradient is ``s_i grad log pi(x_t)``; with ``seq_mean_token_mean`` aggregation (the default) the gradient
is exactly the paper's ``s_i A_i (1/|V_i|) sum_t grad log pi(x_t)``. Sequences are found by ``segment_ids``,
so packed rows work. Clip ranges default to the paper's ``3e-4`` / ``4e-4`` (a sequence ratio is a geometric
mean, so it moves far less than token ratios).

Departure from the paper: the optional KL term (off by default) and the off-policy weight ``w_t`` (1 by
default) is applied per token, not per sequence.

References:
    Zheng et al. 2025, "Group Sequence Policy Optimization", arXiv:2507.18071.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from feynrl_jax.losses import aggregation, kl, off_policy, sequences
from feynrl_jax.losses import metrics as metrics_lib
from feynrl_jax.losses.batch import TrainBatch, check_inputs


def gspo_loss(
    logprobs: jax.Array,
    batch: TrainBatch,
    *,
    entropy: jax.Array | None = None,
    values: jax.Array | None = None,
    clip_low: float = 3e-4,
    clip_high: float = 4e-4,
    kl_coef: float = 0.0,
    kl_estimator: str = "k3",
    loss_agg: str = "seq_mean_token_mean",
    max_tokens: float | None = None,
    tis_cap: float | None = None,
    decoupled: bool = False,
) -> tuple[aggregation.LossSum, dict[str, metrics_lib.Metric]]:
    """GSPO loss (GSPO-token form).

    Args:
        logprobs: [B, T] f32 current-policy log-probabilities.
        batch: the batch; needs ``ref_logprobs`` when ``kl_coef > 0``.
        entropy: optional [B, T] entropy, only reported.
        values: unused (no critic).
        clip_low: sequence-ratio lower bound ``1 - clip_low``.
        clip_high: sequence-ratio upper bound ``1 + clip_high``.
        kl_coef: weight of the KL-to-reference term.
        kl_estimator: "k1", "k2" or "k3" (see :mod:`kl`).
        loss_agg: aggregation mode (see :mod:`aggregation`).
        max_tokens: normaliser of ``seq_mean_token_sum``.
        tis_cap: truncated importance weight cap (see :mod:`off_policy`).
        decoupled: decoupled objective with a proximal policy (see :mod:`off_policy`).

    Returns:
        (LossSum, metrics including ``loss/seq_ratio_mean``).
    """
    del values
    check_inputs("gspo_loss", logprobs, batch, required=("ref_logprobs",) if kl_coef > 0 else ())
    mask, advantages = batch.loss_mask, batch.advantages
    log_ratio, weight, metrics = off_policy.policy_ratio(
        logprobs, batch, tis_cap=tis_cap, decoupled=decoupled, loss_name="gspo_loss"
    )
    index = sequences.sequence_index(batch.segment_ids)
    counts = sequences.sequence_sum(mask, index)
    mean_log_ratio = sequences.safe_divide(sequences.sequence_sum(log_ratio * mask, index), counts)
    sequence_log_ratio = jax.lax.stop_gradient(sequences.broadcast_to_tokens(mean_log_ratio, index))
    ratio = jnp.exp(sequence_log_ratio + logprobs - jax.lax.stop_gradient(logprobs))
    clipped_ratio = jnp.clip(ratio, 1.0 - clip_low, 1.0 + clip_high)
    policy = -weight * jnp.minimum(ratio * advantages, clipped_ratio * advantages)
    sequence_valid = (counts > 0).astype(ratio.dtype)
    metrics["loss/seq_ratio_mean"] = metrics_lib.mean_metric(jnp.exp(mean_log_ratio), sequence_valid)
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
