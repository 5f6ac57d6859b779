"""AdamW with a linear warm-up, a cosine or constant schedule and global-norm clipping.

Built from plain arguments (the config is unpacked by the caller). Weight decay applies to matrices
(``kernel``, ``embedding``) and not to norm scales or biases, the usual choice for transformers.

References:
    Loshchilov & Hutter, "Decoupled Weight Decay Regularization", 2019 (AdamW).
    Loshchilov & Hutter, "SGDR: Stochastic Gradient Descent with Warm Restarts", 2017 (cosine schedule).
    Pascanu et al., "On the difficulty of training recurrent neural networks", 2013 (norm clipping).
"""

from __future__ import annotations

import math
from typing import Any

import jax
import numpy as np
import optax

SCHEDULES = ("cosine", "constant")
DECAYED_LEAF_NAMES = ("kernel", "embedding", "lora_a", "lora_b")


def learning_rate_schedule(
    learning_rate: float,
    *,
    warmup_steps: int = 0,
    total_steps: int | None = None,
    schedule: str = "cosine",
    final_learning_rate_ratio: float = 0.0,
) -> optax.Schedule:
    """Linear warm-up from 0 to ``learning_rate`` over ``warmup_steps``, then cosine decay or constant.

    Args:
        learning_rate: the peak learning rate.
        warmup_steps: steps of linear warm-up (0: start at the peak).
        total_steps: total steps, warm-up included; required for ``"cosine"``.
        schedule: ``"cosine"`` (decay to ``final_learning_rate_ratio * learning_rate`` at ``total_steps``) or
            ``"constant"``.
        final_learning_rate_ratio: the cosine schedule's final value as a fraction of the peak.

    Returns:
        An optax schedule ``step -> learning rate``.

    Raises:
        ValueError: naming the argument that is out of range.
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
    if not 0 < learning_rate < math.inf:
        raise ValueError(f"learning_rate must be positive and finite, got {learning_rate}")
    if warmup_steps < 0:
        raise ValueError(f"warmup_steps must be >= 0, got {warmup_steps}")
    if not 0.0 <= final_learning_rate_ratio <= 1.0:
        raise ValueError(f"final_learning_rate_ratio must be in [0, 1], got {final_learning_rate_ratio}")
    if schedule == "constant":
        main = optax.constant_schedule(learning_rate)
    else:
        if total_steps is None or total_steps <= warmup_steps:
            raise ValueError(
                f"the cosine schedule needs total_steps > warmup_steps, got total_steps={total_steps}, "
                f"warmup_steps={warmup_steps}"
            )
        main = optax.cosine_decay_schedule(learning_rate, total_steps - warmup_steps, alpha=final_learning_rate_ratio)
    if warmup_steps == 0:
        return main
    warmup = optax.linear_schedule(0.0, learning_rate, warmup_steps)
    return optax.join_schedules([warmup, main], [warmup_steps])


def weight_decay_mask(params: Any) -> Any:
    """``True`` for the leaves that weight decay applies to (matrices: ``kernel``, ``embedding``)."""

    def decayed(path: tuple, _leaf: Any) -> bool:
        last = path[-1]
        return getattr(last, "key", getattr(last, "name", None)) in DECAYED_LEAF_NAMES

    return jax.tree_util.tree_map_with_path(decayed, params)


def make_optimizer(
    learning_rate: float,
    *,
    warmup_steps: int = 0,
    total_steps: int | None = None,
    schedule: str = "cosine",
    final_learning_rate_ratio: float = 0.0,
    weight_decay: float = 0.0,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    max_grad_norm: float | None = 1.0,
) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """AdamW with warm-up, schedule and clipping.

    Finite in, finite out: a finite gradient (of a finite norm), params and optimizer state give finite new ones,
    short of an update ``lr * (step + weight_decay * |w|)`` beyond float32's range. The learning rate and weight
    decay are finite; ``eps`` is a normal float32 (a weight whose gradient has always been 0 has a second moment of
    0, and ``0 / (0 + eps)`` is 0); ``b1`` and ``b2`` stay below 1 in float32, so the bias corrections ``1 - b**t``
    are not 0; the gradient's squares are finite wherever its norm is; and Adam's step is bounded (by a constant,
    Kingma & Ba, "Adam: A Method for Stochastic Optimization", 2015, section 2.1, or by ``|m| / eps`` where the
    second moment is flushed to 0: below float32's range for a normal ``eps``). So a train step on it skips an
    update for a non-finite gradient norm or loss alone (``make_train_step(check_updated=False)``) and writes the
    update in place; the step still reads the written state (``train/nonfinite_state``) and the run stops should
    one turn out non-finite.

    Args:
        learning_rate: peak learning rate.
        warmup_steps: linear warm-up steps.
        total_steps: total steps (for the cosine schedule).
        schedule: ``"cosine"`` or ``"constant"``.
        final_learning_rate_ratio: cosine floor as a fraction of the peak.
        weight_decay: decoupled weight decay coefficient (matrices only, see ``weight_decay_mask``).
        b1: Adam's first-moment decay.
        b2: Adam's second-moment decay.
        eps: Adam's epsilon.
        max_grad_norm: clip the gradient to this global norm; ``None`` disables clipping.

    Returns:
        ``(optimizer, schedule)``; the schedule maps the step count to the learning rate (for logging).
    """
    for name, value in (("weight_decay", weight_decay), ("eps", eps)):
        if not math.isfinite(value):
            raise ValueError(f"{name} must be finite, got {value}")
    # In float32 (the optimizer state's dtype; bfloat16 has its exponent range), `sqrt(v) + eps` and the bias
    # corrections `1 - b**t` must not be 0.
    if not eps >= np.finfo(np.float32).tiny:
        raise ValueError(f"eps must be at least float32's smallest normal number, got {eps}")
    if not (0 <= b1 and 0 <= b2 and np.float32(b1) < 1 and np.float32(b2) < 1):
        raise ValueError(f"b1 and b2 must be in [0, 1), also in float32, got {b1} and {b2}")
    if max_grad_norm is not None and not max_grad_norm > 0:
        raise ValueError(f"max_grad_norm must be positive or None, got {max_grad_norm}")
    if weight_decay < 0:
        raise ValueError(f"weight_decay must be >= 0, got {weight_decay}")
    lr = learning_rate_schedule(
        learning_rate,
        warmup_steps=warmup_steps,
        total_steps=total_steps,
        schedule=schedule,
        final_learning_rate_ratio=final_learning_rate_ratio,
    )
    adamw = optax.adamw(lr, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay, mask=weight_decay_mask)
    if max_grad_norm is None:
        return adamw, lr
    return optax.chain(optax.clip_by_global_norm(max_grad_norm), adamw), lr
