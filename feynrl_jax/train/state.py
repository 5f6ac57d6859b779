"""The train state: a small frozen pytree that the jitted step takes, donates and returns."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import optax


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TrainState:
    """Everything one optimisation step reads and writes.

    Attributes:
        params: the model params pytree, in the dtypes of the step's ``ParamsSpec``: the model's ``param_dtype``, or
            float32 master weights (``model.master_dtype``) that consumers round to ``param_dtype``
            (``feynrl_jax.models.as_param_dtype``; docs/DTYPES.md).
        opt_state: the optax state (mirrors the trained part of ``params``, dtypes included, for Adam's moments:
            all of them, or the LoRA adapters alone; ``ParamsSpec.trainable``).
        step: int32 scalar, the number of updates applied (skipped non-finite steps do not count).
        nonfinite_streak: int32 scalar, consecutive steps skipped for a non-finite gradient or loss (or, in a step
            that tests them, updated params or optimizer state; 0 after any applied step).
        nonfinite_total: int32 scalar, skipped steps since the start of the run (``step + nonfinite_total`` steps
            ran; ``step == 0`` after a run means every one was skipped).
    """

    params: Any
    opt_state: Any
    step: jax.Array
    nonfinite_streak: jax.Array
    nonfinite_total: jax.Array


def create_train_state(params: Any, optimizer: optax.GradientTransformation, *, trained: Any = None) -> TrainState:
    """A fresh state: ``optimizer.init(trained)`` (``trained``: the part of ``params`` that trains, default all of
    them) and zero counters. Jit it with ``out_shardings`` to place it."""
    zero = jnp.zeros((), jnp.int32)
    return TrainState(params, optimizer.init(params if trained is None else trained), zero, zero, zero)
