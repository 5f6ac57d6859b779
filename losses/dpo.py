"""Direct preference optimisation: sigmoid DPO, conservative DPO (label smoothing), IPO, length-normalised.

A batch holds pairs: sequence ``2i`` is the chosen response ``y_w`` and sequence ``2i + 1`` the rejected
response ``y_l`` of the same prompt (unpacked: rows ``2i`` and ``2i + 1``; packed: sequences counted in
row-major order, see :mod:`sequences`). With ``rho(y) = sum_t m_t (log pi(y_t) - log pi_ref(y_t))`` over the
response tokens (or its mean over those tokens when ``length_normalize``) and
``h = beta * (rho(y_w) - rho(y_l))``:

* sigmoid DPO (Rafailov et al. 2023, arXiv:2305.18290): ``l = -log sigmoid(h)``;
* conservative DPO (cDPO, Mitchell 2023, "A note on DPO with noisy preferences"): with label smoothing
  ``eps``, ``l = -(1 - eps) log sigmoid(h) - eps log sigmoid(-h)``;
* IPO (Azar et al. 2023, arXiv:2310.12036): ``l = (rho(y_w) - rho(y_l) - 1 / (2 beta))^2`` (``beta`` plays
  the paper's ``tau``);
* length-normalised (``length_normalize=True``): ``rho`` is the mean token log-ratio instead of the sum, which
  removes the preference for longer responses (as in SimPO, Meng et al. 2024, but keeping the reference).

Aggregation: one loss per pair; ``LossSum(sum over pairs, number of pairs)``. A pair counts when both of its
responses have at least one valid token, so padding rows and all-masked pairs change nothing. Micro-batches must
hold whole pairs (both sequences of a pair in the same micro-batch). Departure from
TRL's IPO: TRL always averages over tokens for IPO; here IPO follows ``length_normalize`` like DPO.

Metrics: ``loss/reward_accuracy`` (fraction of pairs with ``h > 0``), ``loss/reward_margin`` (mean ``h``),
``loss/reward_chosen`` and ``loss/reward_rejected`` (mean ``beta * rho``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from feynrl_jax.losses import aggregation, sequences
from feynrl_jax.losses import metrics as metrics_lib
from feynrl_jax.losses.batch import TrainBatch, check_inputs


def _pair_log_ratios(
    logprobs: jax.Array, batch: TrainBatch, *, length_normalize: bool
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Per-pair policy/reference log-ratios of the chosen and rejected responses and the pair validity.

    Returns:
        (rho_chosen [P], rho_rejected [P], valid [P]) with ``P = ceil(B * T / 2)`` pair slots.
    """
    mask = batch.loss_mask
    log_ratio = (logprobs - batch.ref_logprobs) * mask
    index = sequences.sequence_index(batch.segment_ids)
    sums = sequences.sequence_sum(log_ratio, index)
    counts = sequences.sequence_sum(mask, index)
    if sums.shape[0] % 2:
        sums = jnp.pad(sums, (0, 1))
        counts = jnp.pad(counts, (0, 1))
    rho = sequences.safe_divide(sums, counts) if length_normalize else sums
    rho, counts = rho.reshape(-1, 2), counts.reshape(-1, 2)
    valid = ((counts[:, 0] > 0) & (counts[:, 1] > 0)).astype(logprobs.dtype)
    return rho[:, 0], rho[:, 1], valid


def _pair_metrics(beta: float, chosen: jax.Array, rejected: jax.Array, valid: jax.Array):
    margin = beta * (chosen - rejected)
    return {
        "loss/reward_accuracy": metrics_lib.mean_metric((margin > 0).astype(margin.dtype), valid),
        "loss/reward_margin": metrics_lib.mean_metric(margin, valid),
        "loss/reward_chosen": metrics_lib.mean_metric(beta * chosen, valid),
        "loss/reward_rejected": metrics_lib.mean_metric(beta * rejected, valid),
    }


def dpo_loss(
    logprobs: jax.Array,
    batch: TrainBatch,
    *,
    entropy: jax.Array | None = None,
    values: jax.Array | None = None,
    beta: float = 0.1,
    label_smoothing: float = 0.0,
    length_normalize: bool = False,
) -> tuple[aggregation.LossSum, dict[str, metrics_lib.Metric]]:
    """Sigmoid DPO, with cDPO label smoothing.

    Args:
        logprobs: [B, T] f32 policy log-probabilities; pairs interleaved (chosen, rejected).
        batch: the batch; needs ``ref_logprobs``.
        entropy: unused.
        values: unused.
        beta: inverse temperature of the implicit reward.
        label_smoothing: probability ``eps`` that a preference label is flipped (0: plain DPO).
        length_normalize: use the mean instead of the sum of token log-ratios.

    Returns:
        (LossSum over pairs, metrics).

    References:
        Rafailov et al. 2023, "Direct Preference Optimization", arXiv:2305.18290.
    """
    del entropy, values
    check_inputs("dpo_loss", logprobs, batch, required=("ref_logprobs",))
    chosen, rejected, valid = _pair_log_ratios(logprobs, batch, length_normalize=length_normalize)
    h = beta * (chosen - rejected)
    per_pair = -(1.0 - label_smoothing) * jax.nn.log_sigmoid(h) - label_smoothing * jax.nn.log_sigmoid(-h)
    loss = aggregation.LossSum(jnp.sum(per_pair * valid), jnp.sum(valid))
    return loss, _pair_metrics(beta, chosen, rejected, valid)


def ipo_loss(
    logprobs: jax.Array,
    batch: TrainBatch,
    *,
    entropy: jax.Array | None = None,
    values: jax.Array | None = None,
    beta: float = 0.1,
    length_normalize: bool = False,
) -> tuple[aggregation.LossSum, dict[str, metrics_lib.Metric]]:
    """IPO: squared distance of the log-ratio margin to ``1 / (2 beta)``.

    Args:
        logprobs: [B, T] f32 policy log-probabilities; pairs interleaved (chosen, rejected).
        batch: the batch; needs ``ref_logprobs``.
        entropy: unused.
        values: unused.
        beta: the regularisation ``tau`` of the paper.
        length_normalize: use the mean instead of the sum of token log-ratios.

    Returns:
        (LossSum over pairs, metrics).

    References:
        Azar et al. 2023, "A General Theoretical Paradigm to Understand Learning from Human Preferences",
        arXiv:2310.12036.
    """
    del entropy, values
    check_inputs("ipo_loss", logprobs, batch, required=("ref_logprobs",))
    chosen, rejected, valid = _pair_log_ratios(logprobs, batch, length_normalize=length_normalize)
    per_pair = jnp.square(chosen - rejected - 1.0 / (2.0 * beta))
    loss = aggregation.LossSum(jnp.sum(per_pair * valid), jnp.sum(valid))
    return loss, _pair_metrics(beta, chosen, rejected, valid)
