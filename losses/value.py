"""PPO's clipped value loss, per token: the one definition behind ``ppo_loss``'s value term and the critic's loss.

With ``V`` the current critic predictions, ``V^old`` = ``batch.values`` (the critic at rollout time) and ``R`` =
``batch.returns`` (e.g. GAE targets, :func:`advantages.gae`):

``l^V_t = 0.5 max((V_t - R_t)^2, (V^old_t + clip(V_t - V^old_t, -c, c) - R_t)^2)``,

and ``l^V_t = 0.5 (V_t - R_t)^2`` without clipping. The clipped form is not in the PPO paper (whose eq. 9 has the
plain squared error) but in its reference implementation, OpenAI baselines' ``ppo2``; it is pessimistic, like
the policy's surrogate: an update that moves ``V`` more than ``c`` from ``V^old`` is charged for the clipped
prediction whenever that one is further from the return.

The caller weighs and aggregates ``l^V``: ``ppo_loss`` adds ``vf_coef l^V_t`` to the policy's per-token loss; the
separate critic (``feynrl_jax.train.critic.value_loss``) takes its token mean.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from feynrl_jax.losses import metrics as metrics_lib
from feynrl_jax.losses.batch import TrainBatch, check_per_token


def clipped_value_error(
    values: jax.Array,
    batch: TrainBatch,
    *,
    value_clip: float | None,
    loss_name: str = "clipped_value_error",
) -> tuple[jax.Array, dict[str, metrics_lib.Metric]]:
    """PPO's per-token (clipped) value loss and its metrics.

    Args:
        values: [B, T] current critic predictions ``V``.
        batch: the batch; reads ``returns`` ([B, T] targets ``R``), ``values`` ([B, T] rollout-time predictions
            ``V^old``, only when clipping) and ``loss_mask`` (for the metrics).
        value_clip: clip range ``c`` of the update around ``batch.values``; None for the plain squared error.
        loss_name: name of the calling loss, used in error messages.

    Returns:
        ``(per_token, metrics)``: per_token [B, T] is ``0.5 max((V - R)^2, (V^old + clip(V - V^old, -c, c) - R)^2)``
        (``0.5 (V - R)^2`` when ``value_clip`` is None), not masked and not reduced: the caller weighs it and
        aggregates it over ``batch.loss_mask``. ``metrics`` holds the mask-weighted means ``loss/value``
        (of ``per_token``), ``loss/value_pred_mean`` (of ``V``), ``loss/value_error_abs`` (of ``|V - R|``) and,
        when clipping, ``loss/value_clip_frac`` (the fraction of tokens where the clipped branch is the larger).

    Raises:
        ValueError: when ``values`` is not [B, T] like ``batch.tokens``, or ``batch.returns`` (or, when clipping,
            ``batch.values``) is missing.

    References:
        Schulman et al. 2017, "Proximal Policy Optimization Algorithms", arXiv:1707.06347 (eq. 9); the clipped
        variant is OpenAI baselines' ``ppo2`` (Dhariwal et al. 2017, https://github.com/openai/baselines).
    """
    values = check_per_token(loss_name, "values", values, batch.tokens.shape)
    required = ("returns", "values") if value_clip is not None else ("returns",)
    for name in required:
        if getattr(batch, name) is None:
            raise ValueError(f"{loss_name}: batch.{name} is required but is None")
    mask, returns = batch.loss_mask, batch.returns
    metrics = {
        "loss/value_pred_mean": metrics_lib.mean_metric(values, mask),
        "loss/value_error_abs": metrics_lib.mean_metric(jnp.abs(values - returns), mask),
    }
    error = jnp.square(values - returns)
    if value_clip is not None:
        clipped = batch.values + jnp.clip(values - batch.values, -value_clip, value_clip)
        clipped_error = jnp.square(clipped - returns)
        metrics["loss/value_clip_frac"] = metrics_lib.mean_metric((clipped_error > error).astype(error.dtype), mask)
        error = jnp.maximum(error, clipped_error)
    per_token = 0.5 * error
    metrics["loss/value"] = metrics_lib.mean_metric(per_token, mask)
    return per_token, metrics
