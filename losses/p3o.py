"""P3O: a policy gradient whose trust region adapts to the effective sample size of the importance weights.

With ``r_t = pi(x_t) / pi_old(x_t)`` (see :mod:`off_policy`) over the valid tokens ``V`` of the batch:

    ESS = (sum_{t in V} r_t)^2 / (|V| sum_{t in V} r_t^2)         (no gradient; 1 when pi = pi_old)
    rho_t = clip(r_t, 0, ESS)
    l_t = -w_t sg(rho_t) A_t log pi(x_t) + kl_coef k3(pi || ref)_t + (1 - ESS) k3(pi || pi_old)_t

When the data is nearly on-policy (ESS close to 1) the update is a plain policy gradient with weights up to 1;
as the batch goes off-policy, the weights are truncated harder and the KL pull towards ``pi_old`` grows.

Over which tokens ESS is computed, and why: over all valid tokens (``loss_mask == 1``) of the batch passed to
the loss, pooled across sequences. Tokens are the actions whose ratios weight the surrogate, so they are the
samples of the importance-sampling estimator, as the minibatch of actions is in the paper; prompt and padding
tokens are excluded because their ratio is 1 by construction and would inflate ESS towards 1; pooling over the
batch (rather than per sequence) keeps ESS stable for short responses. Consequence: ESS depends on how the
batch is cut into micro-batches (each micro-batch computes its own ESS), so P3O's gradient accumulation is exact
only for unsplit batches; packing and padding do not change it.

Departures from the paper (Fakoor et al. 2019, a discrete-control actor-critic): token-level ratios with the
stop-gradient REINFORCE form (as in CISPO) instead of an on-policy plus an off-policy term with a critic; the
KL to the old policy is estimated with k3. Aggregation: ``token_mean``.

References:
    Fakoor, Chaudhari, Smola 2019, "P3O: Policy-on Policy-off Policy Optimization", arXiv:1905.01756.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from feynrl_jax.losses import aggregation, kl, off_policy
from feynrl_jax.losses import metrics as metrics_lib
from feynrl_jax.losses.batch import TrainBatch, check_inputs


def p3o_loss(
    logprobs: jax.Array,
    batch: TrainBatch,
    *,
    entropy: jax.Array | None = None,
    values: jax.Array | None = None,
    kl_coef: float = 0.0,
    loss_agg: str = "token_mean",
    max_tokens: float | None = None,
    tis_cap: float | None = None,
    decoupled: bool = False,
) -> tuple[aggregation.LossSum, dict[str, metrics_lib.Metric]]:
    """P3O loss.

    Args:
        logprobs: [B, T] f32 current-policy log-probabilities.
        batch: the batch; needs ``ref_logprobs`` when ``kl_coef > 0``.
        entropy: optional [B, T] entropy, only reported.
        values: unused (no critic).
        kl_coef: weight of the k3 KL-to-reference term.
        loss_agg: aggregation mode (see :mod:`aggregation`).
        max_tokens: normaliser of ``seq_mean_token_sum``.
        tis_cap: truncated importance weight cap (see :mod:`off_policy`).
        decoupled: decoupled objective with a proximal policy (see :mod:`off_policy`).

    Returns:
        (LossSum, metrics including ``loss/ess``).
    """
    del values
    check_inputs("p3o_loss", logprobs, batch, required=("ref_logprobs",) if kl_coef > 0 else ())
    mask, advantages = batch.loss_mask, batch.advantages
    log_ratio, weight, metrics = off_policy.policy_ratio(
        logprobs, batch, tis_cap=tis_cap, decoupled=decoupled, loss_name="p3o_loss"
    )
    ratio = jax.lax.stop_gradient(jnp.exp(log_ratio))
    ess = off_policy.effective_sample_size(ratio, mask)
    rho = jnp.clip(ratio, 0.0, ess)
    policy = -weight * rho * advantages * logprobs
    kl_old = kl.k3(logprobs, batch.old_logprobs)
    per_token = policy + (1.0 - ess) * kl_old
    metrics["loss/ess"] = metrics_lib.scalar_metric(ess, jnp.sum(mask))
    metrics["loss/clip_frac"] = metrics_lib.mean_metric((ratio > ess).astype(ratio.dtype), mask)
    metrics["loss/policy"] = metrics_lib.mean_metric(policy, mask)
    metrics["loss/kl_old"] = metrics_lib.mean_metric(kl_old, mask)

    if kl_coef > 0:
        kl_term = kl.k3(logprobs, batch.ref_logprobs)
        per_token = per_token + kl_coef * kl_term
        metrics["loss/kl"] = metrics_lib.mean_metric(kl_term, mask)
    if entropy is not None:
        metrics["loss/entropy"] = metrics_lib.mean_metric(entropy, mask)

    loss = aggregation.aggregate(per_token, mask, batch.segment_ids, mode=loss_agg, max_tokens=max_tokens)
    return loss, metrics
