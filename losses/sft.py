"""Supervised fine-tuning: masked token cross-entropy.

``l_t = -log pi(x_t | x_<t)`` on tokens with ``loss_mask`` 1 (typically the assistant turns), aggregated with
``loss_agg`` (default ``token_mean``: every supervised token weighs the same across the whole batch, so
micro-batches and devices combine exactly; see :mod:`aggregation`).
"""

from __future__ import annotations

import jax

from feynrl_jax.losses import aggregation
from feynrl_jax.losses import metrics as metrics_lib
from feynrl_jax.losses.batch import TrainBatch, check_inputs


def sft_loss(
    logprobs: jax.Array,
    batch: TrainBatch,
    *,
    entropy: jax.Array | None = None,
    values: jax.Array | None = None,
    loss_agg: str = "token_mean",
    max_tokens: float | None = None,
) -> tuple[aggregation.LossSum, dict[str, metrics_lib.Metric]]:
    """Masked negative log-likelihood.

    Args:
        logprobs: [B, T] f32 log-probabilities of ``batch.tokens``.
        batch: the batch (``loss_mask`` selects the supervised tokens).
        entropy: optional [B, T] per-token entropy, only reported as ``loss/entropy``.
        values: unused (no critic).
        loss_agg: aggregation mode (see :mod:`aggregation`).
        max_tokens: normaliser of ``seq_mean_token_sum``.

    Returns:
        (LossSum, metrics ``loss/nll``, ``loss/entropy`` when given).
    """
    del values
    check_inputs("sft_loss", logprobs, batch)
    mask = batch.loss_mask
    nll = -logprobs
    loss = aggregation.aggregate(nll, mask, batch.segment_ids, mode=loss_agg, max_tokens=max_tokens)
    metrics = {"loss/nll": metrics_lib.mean_metric(nll, mask)}
    if entropy is not None:
        metrics["loss/entropy"] = metrics_lib.mean_metric(entropy, mask)
    return loss, metrics
