"""The PPO critic: a scalar value head on a copy of the policy's backbone, trained with its own optimizer.

Params: ``{"backbone": <a policy params pytree>, "value_head": {"kernel": [D], "bias": []}}``. The backbone
starts as a copy of the policy (so the critic reads the same features), the head at zero (every value starts at
0, the return of an untrained critic). The critic never uses the backbone's output projection.

Alignment (docs/CONTRACTS.md): ``values[b, t]`` is the value of the state *before* token ``t`` was generated,
``V(tokens[b, :t])``, read from the hidden state of token ``t - 1``; so ``values`` lines up with ``logprobs``
and ``loss_mask`` and GAE (``feynrl_jax.losses.advantages.gae``) consumes it directly. Entry 0 holds 0.

The value loss is PPO's clipped squared error (Schulman et al. 2017, "Proximal Policy Optimization
Algorithms", arXiv:1707.06347, eq. 9 and the clipped variant of the OpenAI baselines):
``0.5 max((V - R)^2, (V_old + clip(V - V_old, -c, c) - R)^2)``, token-mean over the completion, times
``vf_coef``. It is ``feynrl_jax.losses.value.clipped_value_error``, the function behind ``ppo_loss``'s value term
too, so the two cannot drift apart. The policy's ``ppo_loss`` runs with its own ``vf_coef = 0``: the actor and
the critic are separate models with separate optimizers, as in verl and OpenRLHF, rather than one network with a
shared loss.

The critic step reuses ``make_train_step``: its "per-token prediction" function returns values instead of
log-probabilities, and the loss below reads them; sharding, gradient accumulation (with the backbone's layer
gradients added into the accumulator in place where the policy's are: ``step.layer_sink_path``) and the non-finite
guard are the policy step's (an update whose gradient, loss, new params or new optimizer state is not finite is
skipped; ``RLTrainer`` checks the critic's streak with its own ``NonFiniteGuard``).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh

from feynrl_jax.losses import LossSum, TrainBatch, aggregation
from feynrl_jax.losses import metrics as metrics_lib
from feynrl_jax.losses.value import clipped_value_error
from feynrl_jax.models import ModelConfig, SegmentBounds, forward, init_params, logical_axes, predecessor_hidden
from feynrl_jax.sharding.rules import Rules
from feynrl_jax.train.step import ParamsSpec, TrainStep, layer_sink_path, make_train_step


def init_critic_params(policy_params: Any, config: ModelConfig) -> dict[str, Any]:
    """A critic whose backbone is a copy of ``policy_params`` and whose value head is zero.

    Args:
        policy_params: the policy's params (any placement; the leaves are copied).
        config: the model config.

    Returns:
        ``{"backbone": ..., "value_head": {"kernel": [D] f32 zeros, "bias": [] f32 zero}}``.
    """
    return {
        "backbone": jax.tree.map(jnp.copy, policy_params),
        "value_head": {
            "kernel": jnp.zeros((config.hidden_size,), jnp.float32),
            "bias": jnp.zeros((), jnp.float32),
        },
    }


def critic_logical_axes(config: ModelConfig) -> dict[str, Any]:
    """Logical axes of the critic params: the backbone's, plus ``("embed",)`` for the head's kernel."""
    return {"backbone": logical_axes(config), "value_head": {"kernel": ("embed",), "bias": ()}}


def critic_params_shape(config: ModelConfig) -> dict[str, Any]:
    """The critic params as ``jax.ShapeDtypeStruct`` leaves (no allocation)."""
    backbone = jax.eval_shape(functools.partial(init_params, config), jax.random.key(0))
    return {
        "backbone": backbone,
        "value_head": {
            "kernel": jax.ShapeDtypeStruct((config.hidden_size,), jnp.float32),
            "bias": jax.ShapeDtypeStruct((), jnp.float32),
        },
    }


def critic_params_spec(config: ModelConfig) -> ParamsSpec:
    """The critic params' logical axes and shapes (``.with_master_dtype("float32")`` for float32 masters)."""
    return ParamsSpec(critic_logical_axes(config), critic_params_shape(config))


def critic_values(
    params: dict[str, Any],
    tokens: jax.Array,
    positions: jax.Array,
    segment_ids: jax.Array,
    *,
    config: ModelConfig,
    remat: str | None = None,
    segment_bounds: SegmentBounds | None = None,
    grad_sink: Any | None = None,
) -> jax.Array:
    """Per-token values ``[B, T]`` f32, aligned like log-probabilities (``values[:, t] = V(tokens[:, :t])``).

    Args:
        params: critic params.
        tokens: ``[B, T]`` int32.
        positions: ``[B, T]`` int32.
        segment_ids: ``[B, T]`` int32 (0 = padding).
        config: the backbone's model config.
        remat: rematerialisation policy of the backbone (None: ``config.remat``).
        segment_bounds: static bounds on the rows' segments (``models.SegmentBounds``: attention in blocks), or
            None.
        grad_sink: under ``jax.grad``, an accumulator of ``params["backbone"]["layers"]`` the backbone's layer
            gradients are added into in place (``models.forward``), or None.
    """
    hidden, _ = forward(
        params["backbone"],
        tokens,
        positions,
        config=config,
        segment_ids=segment_ids,
        remat=remat,
        segment_bounds=segment_bounds,
        grad_sink=grad_sink,
    )
    head = params["value_head"]
    # The state before token t is the one that predicts it (a shared-prefix continuation's first token: its
    # prefix's last state); the first token of an ordinary segment has none inside its segment.
    source, valid = predecessor_hidden(hidden, positions, segment_ids)
    values = jnp.einsum("btd,d->bt", source.astype(jnp.float32), head["kernel"]) + head["bias"]
    return jnp.concatenate([jnp.zeros_like(values[:, :1]), jnp.where(valid, values, 0.0)], axis=1)


def value_loss(
    values: jax.Array, batch: TrainBatch, *, value_clip: float | None = 0.2, vf_coef: float = 1.0
) -> tuple[LossSum, dict[str, metrics_lib.Metric]]:
    """PPO's clipped value loss (``feynrl_jax.losses.value.clipped_value_error``), token-mean over ``loss_mask``.

    The loss is ``vf_coef * sum_t m_t l^V_t / sum_t m_t``. The critic is a separate model with its own AdamW, so
    ``vf_coef`` does not trade the value loss against the policy's: AdamW's update is invariant to the scale of
    the gradient, and ``vf_coef`` only acts through the global gradient-norm clip (a larger scale reaches the
    clip threshold sooner) and AdamW's ``eps`` (a smaller scale brings the gradient nearer ``eps``).

    Args:
        values: ``[B, T]`` current critic predictions.
        batch: needs ``returns`` (GAE targets) and, when clipping, ``values`` (the critic's predictions at
            rollout time).
        value_clip: clip range of the update around ``batch.values``; None for the plain squared error.
        vf_coef: scale of the loss (> 0).

    Returns:
        ``(LossSum, metrics)``: ``LossSum(vf_coef * sum of masked l^V, number of valid tokens)``; metrics
        ``loss/value`` (unscaled by ``vf_coef``), ``loss/value_clip_frac`` (when clipping),
        ``loss/value_pred_mean`` and ``loss/value_error_abs`` (mean ``|V - R|``).

    Raises:
        ValueError: when ``vf_coef <= 0``, ``values`` is mis-shaped, or ``batch.returns`` (or, when clipping,
            ``batch.values``) is missing.
    """
    if vf_coef <= 0:
        raise ValueError(f"value_loss: vf_coef must be > 0, got {vf_coef}")
    per_token, metrics = clipped_value_error(values, batch, value_clip=value_clip, loss_name="value_loss")
    loss = aggregation.aggregate(vf_coef * per_token, batch.loss_mask, batch.segment_ids, mode="token_mean")
    return loss, metrics


def make_critic_train_step(
    config: ModelConfig,
    optimizer: optax.GradientTransformation,
    mesh: Mesh,
    rules: Rules,
    *,
    value_clip: float | None,
    vf_coef: float = 1.0,
    grad_accum: int,
    remat: str | None = None,
    params_spec: ParamsSpec | None = None,
    segment_bounds: SegmentBounds | None = None,
    check_updated: bool = True,
) -> TrainStep:
    """The critic's jitted train step (``make_train_step`` with values in place of log-probabilities).

    Args:
        config: the backbone's model config.
        optimizer: the critic's own optimizer.
        mesh: the device mesh.
        rules: the logical-axis rules table.
        value_clip: see ``value_loss``.
        vf_coef: scale of the critic's loss (see ``value_loss``).
        grad_accum: micro-batches per update.
        remat: rematerialisation policy.
        params_spec: the state's params (None: ``critic_params_spec(config)``; float32 master weights:
            ``critic_params_spec(config).with_master_dtype("float32")``; the backbone is rounded to
            ``config.param_dtype`` in ``forward``).
        segment_bounds: static bounds on the batches' segments (``models.SegmentBounds``), or None.
        check_updated: see ``make_train_step`` (False for ``make_optimizer``'s AdamW).

    Returns:
        A ``TrainStep`` over the critic params; ``step.init_state(init_critic_params(...))`` starts it.
    """

    def predict(params: Any, batch: TrainBatch, grad_sink: Any | None = None) -> tuple[jax.Array, None]:
        values = critic_values(
            params,
            batch.tokens,
            batch.positions,
            batch.segment_ids,
            config=config,
            remat=remat,
            segment_bounds=segment_bounds,
            grad_sink=grad_sink,
        )
        return values, None

    # Accumulating micro-batches, the backbone's layer gradients go into the accumulator in place, as the policy's.
    predict.layer_sink = layer_sink_path(config, remat, ("backbone", "layers"))
    return make_train_step(
        functools.partial(value_loss, value_clip=value_clip, vf_coef=vf_coef),
        optimizer,
        mesh,
        rules,
        predict=predict,
        params_spec=critic_params_spec(config) if params_spec is None else params_spec,
        grad_accum=grad_accum,
        check_updated=check_updated,
    )
