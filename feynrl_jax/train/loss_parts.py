"""Parts that wrap a loss: each takes a loss with the contract signature and returns one.

A loss has the signature ``loss(logprobs [B, T], batch, *, entropy=None, values=None, **hyperparameters) ->
(LossSum, metrics)`` (``feynrl_jax.losses``); the train step calls it with the current policy's float32
log-probabilities and, when its ``predict`` part returns one, ``entropy=``. A feature of the RL step that needs
the current log-probabilities is a wrapper here, composed by the caller, not a flag of ``make_train_step``:

* :func:`old_logprobs_from_current`: the ratio's denominator is the current params' own log-probabilities;
* :func:`with_logprob_diagnostics`: adds the current policy's mismatch with the rollout engine, its entropy and
  its KL to the reference (:func:`logprob_diagnostic_metrics`).

Both compose in either order: ``with_logprob_diagnostics(old_logprobs_from_current(loss))``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from feynrl_jax.losses import LossSum, TrainBatch
from feynrl_jax.losses.metrics import Metric, max_metric, mean_metric, scalar_metric
from feynrl_jax.losses.off_policy import clamped_log_ratio, effective_sample_size

LossFn = Callable[..., tuple[LossSum, dict[str, Metric]]]
"""``loss(logprobs [B, T], batch, *, entropy=None, **hyperparameters) -> (LossSum, metrics)``."""


def logprob_diagnostic_metrics(logprobs: jax.Array, entropy: jax.Array, batch: TrainBatch) -> dict[str, Metric]:
    """The current policy against the rollout engine (and the reference) on the batch's ``loss_mask`` tokens.

    Args:
        logprobs: ``[B, T]`` current-policy log-probabilities.
        entropy: ``[B, T]`` entropy of each predictive distribution.
        batch: the batch; ``behavior_logprobs`` is required, ``ref_logprobs`` optional.

    Returns:
        ``rollout/logprob_mismatch_kl``: mean of ``behaviour - current`` (a k1 estimate of KL(behaviour ||
        current), the tokens being samples of the behaviour policy); ``rollout/logprob_mismatch_k3``: mean of
        ``exp(c - b) - 1 - (c - b)``; ``rollout/logprob_mismatch_max_abs``; ``rollout/behavior_ess``: the
        normalised effective sample size of the importance weights ``exp(current - behaviour)`` (log-ratio
        clamped to ``[-20, 20]``), the off-policy correction from the behaviour policy to the current (proximal)
        one, weighted by its number of tokens; ``train/entropy``; with a reference, ``train/kl_ref``, the k3
        estimate of KL(current || reference).
    """
    mask = batch.loss_mask
    diff = batch.behavior_logprobs - logprobs
    weights = jnp.exp(clamped_log_ratio(logprobs, batch.behavior_logprobs))
    out = {
        "rollout/logprob_mismatch_kl": mean_metric(diff, mask),
        "rollout/logprob_mismatch_k3": mean_metric(jnp.exp(-diff) - 1.0 + diff, mask),
        "rollout/logprob_mismatch_max_abs": max_metric(jnp.abs(diff), mask),
        "rollout/behavior_ess": scalar_metric(effective_sample_size(weights, mask), jnp.sum(mask)),
        "train/entropy": mean_metric(entropy, mask),
    }
    if batch.ref_logprobs is not None:
        log_ratio = batch.ref_logprobs - logprobs
        out["train/kl_ref"] = mean_metric(jnp.exp(log_ratio) - 1.0 - log_ratio, mask)
    return out


def old_logprobs_from_current(loss_fn: LossFn) -> LossFn:
    """The loss with ``batch.old_logprobs`` replaced by ``stop_gradient(logprobs) * loss_mask``.

    The ratio's denominator is then the current params' own log-probabilities (no gradient). With one update per
    batch these are the pre-update policy's, so an RL step needs no separate forward pass to recompute them.

    Args:
        loss_fn: a loss with the contract signature.

    Returns:
        A loss with the same signature; every keyword (``entropy=``, hyperparameters) is passed through.
    """

    def loss(logprobs: jax.Array, batch: TrainBatch, **kwargs: Any) -> tuple[LossSum, dict[str, Metric]]:
        old = jax.lax.stop_gradient(logprobs) * batch.loss_mask
        return loss_fn(logprobs, dataclasses.replace(batch, old_logprobs=old), **kwargs)

    return loss


def with_logprob_diagnostics(loss_fn: LossFn, *, pass_entropy: bool = True) -> LossFn:
    """The loss with ``logprob_diagnostic_metrics`` added to its metrics (same total and gradient).

    The diagnostics need the entropy: build the step's ``predict`` with ``with_entropy=True``.

    Args:
        loss_fn: a loss with the contract signature.
        pass_entropy: also hand ``entropy=`` to ``loss_fn``. False when the entropy is computed only for the
            diagnostics (the loss then runs as with a ``predict`` without entropy; e.g. GRPO does not report
            ``loss/entropy``); keep True for a loss that uses it (PPO's entropy bonus).

    Returns:
        A loss ``(logprobs, batch, *, entropy, **kwargs)``; ``batch.behavior_logprobs`` is required.

    Raises:
        ValueError: (when traced) the step passed no entropy.
    """

    def loss(
        logprobs: jax.Array, batch: TrainBatch, *, entropy: jax.Array | None = None, **kwargs: Any
    ) -> tuple[LossSum, dict[str, Metric]]:
        if entropy is None:
            raise ValueError("with_logprob_diagnostics needs the entropy: build predict with with_entropy=True")
        if pass_entropy:
            kwargs["entropy"] = entropy
        loss_sum, metrics = loss_fn(logprobs, batch, **kwargs)
        return loss_sum, {**metrics, **logprob_diagnostic_metrics(logprobs, entropy, batch)}

    return loss
