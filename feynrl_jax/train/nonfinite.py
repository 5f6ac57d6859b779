"""Non-finite numbers in training: the in-step test, the host-side guard, and the check of a restored state.

The jitted step never applies a non-finite update: when the gradient's norm or the loss is NaN or infinite, or the
updated params or optimizer state hold a NaN or an infinity (``all_finite``; tested unless the step is built with
``check_updated=False``, ``train.step.make_train_step``, for an optimizer that keeps finite inputs finite), it keeps
the old params and optimizer state and counts the skip in ``TrainState.nonfinite_streak`` and ``nonfinite_total``,
reported as the metrics ``train/nonfinite_streak`` and ``train/nonfinite_total``. A few isolated skips are harmless
(a bad batch); a streak means the run has diverged, and a run whose updates were all skipped trained nothing:
``NonFiniteGuard`` stops the first with ``check`` and fails the second with ``finish``, rather than exit 0 with the
initial weights. A step built with ``check_updated=False`` reads its written state for NaN and infinities
(``train/nonfinite_state``); ``check`` stops the run at the first such step, before the loops save it.

A train state restored from an orbax checkpoint is checked once (``check_restored_state``): a checkpoint that
holds a NaN would otherwise skip every step of the resumed run.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp

from feynrl_jax.errors import InputError, RunFailed
from feynrl_jax.losses.metrics import Metric, combine_updates

STATE_METRIC = "train/nonfinite_state"
STREAK_METRIC = "train/nonfinite_streak"
TOTAL_METRIC = "train/nonfinite_total"
STEP_METRIC = "train/step"
LIMIT_KEY = "optim.max_consecutive_nonfinite"


class NonFiniteError(RunFailed):
    """Raised when updates were skipped (non-finite) for too many consecutive steps, or for the whole run, or when
    an applied update wrote a non-finite state (``train/nonfinite_state``)."""


def all_finite(*trees: Any) -> jax.Array:
    """Whether every floating-point leaf of ``trees`` is finite (traceable; use it inside ``jax.jit``).

    One fused ``isfinite``-and-reduce per leaf (XLA reads each leaf once, without a boolean temporary), the
    scalars AND-ed together; integer leaves (optimizer counters) are finite by construction and skipped.

    Returns:
        A boolean scalar.
    """
    checks = [jnp.isfinite(x).all() for x in jax.tree.leaves(trees) if jnp.issubdtype(x.dtype, jnp.inexact)]
    return jnp.stack(checks).all() if checks else jnp.asarray(True)


_all_finite_jit = jax.jit(all_finite)


def first_nonfinite_leaf(tree: Any) -> str | None:
    """The path (``jax.tree_util.keystr``) of the first leaf of ``tree`` holding a NaN or an infinity, else None.

    A single jitted reduction over the whole tree; the leaves are searched one by one only when it fails.
    """
    if bool(_all_finite_jit(tree)):
        return None
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        if not bool(all_finite(leaf)):
            return jax.tree_util.keystr(path)
    return "<unknown leaf>"  # the fused check and the per-leaf checks disagree: not expected


def check_restored_state(state: Any, where: str) -> None:
    """Raises ``InputError`` when the params or optimizer state of a restored ``TrainState`` are not finite.

    Args:
        state: the restored ``TrainState`` (device arrays, any sharding).
        where: the checkpoint step folder, for the message.

    Raises:
        InputError: naming ``where`` and the first non-finite leaf.
    """
    for name, tree in (("params", state.params), ("opt_state", state.opt_state)):
        leaf = first_nonfinite_leaf(tree)
        if leaf is not None:
            raise InputError(
                f"checkpoint {where}: {name}{leaf} holds NaN or infinite values; resume from an earlier checkpoint "
                "step (move this step folder away) or start the run again from its initial weights"
            )


class NonFiniteGuard:
    """Checks the step's metrics on the host: too long a streak of skipped updates, an applied update that wrote a
    non-finite state, or a run that skipped all.

    Args:
        max_consecutive: the most consecutive skipped updates tolerated (``optim.max_consecutive_nonfinite``);
            one more raises. 0 raises on the first.
        model: the trained model's name in messages ("critic" for PPO's critic), or None.
    """

    def __init__(self, max_consecutive: int, *, model: str | None = None) -> None:
        if max_consecutive < 0:
            raise ValueError(f"max_consecutive must be >= 0, got {max_consecutive}")
        self.max_consecutive = max_consecutive
        self.model = model
        self.checked = 0  # updates checked by this guard
        self.applied: int | None = None  # updates applied since the run began (``train/step``), resumes included
        self.skipped_total = 0

    def check(self, metrics: Mapping[str, Any], step: int | None = None) -> None:
        """Raises ``NonFiniteError`` when ``metrics["train/nonfinite_streak"]`` exceeds the limit, or at once when
        the step wrote a non-finite state (``metrics["train/nonfinite_state"]``: an update chosen before it was
        computed, ``make_train_step(check_updated=False)``, that gave NaN or infinite weights from a finite gradient
        and loss; the loops check before they save, so no checkpoint holds it).

        Args:
            metrics: one update's metrics (its ``Metric`` records, or device or host scalars); reading the streak
                waits for the step.
            step: the step number, for the message.
        """
        if STREAK_METRIC not in metrics:
            raise KeyError(f"metrics lack {STREAK_METRIC!r}; pass the metrics returned by the train step")
        streak = _count(metrics[STREAK_METRIC])
        total = _count(metrics[TOTAL_METRIC]) if TOTAL_METRIC in metrics else self.skipped_total + (streak > 0)
        if STEP_METRIC in metrics:
            self.applied = _count(metrics[STEP_METRIC])
        else:
            self.applied = (self.applied or 0) + (streak == 0)
        self.checked += 1
        self.skipped_total = total
        where = "" if step is None else f" at step {step}"
        if STATE_METRIC in metrics and _value(metrics[STATE_METRIC]) > 0:
            lr = "algo.critic_lr" if self.model == "critic" else "optim.lr"
            raise NonFiniteError(
                f"{self._prefix()}the update{where} wrote NaN or infinite weights or optimizer state from a finite "
                f"gradient and loss; nothing of it was saved. Check {lr}, optim.eps, optim.b1, optim.b2 and "
                "optim.weight_decay (or the model's dtypes), then resume from the last checkpoint"
            )
        if streak > self.max_consecutive:
            raise NonFiniteError(
                f"{self._prefix()}non-finite gradient, loss or updated weights for {streak} consecutive steps{where} "
                f"(limit {self.max_consecutive}, {total} skipped in total): the run has diverged; lower optim.lr, "
                f"check the data and the initial weights, or raise {LIMIT_KEY} (now {self.max_consecutive})"
            )

    def finish(self) -> None:
        """Raises ``NonFiniteError`` when the run skipped every update it ran (call it after the last step).

        The count of applied updates is the train state's (``train/step``), which checkpoints keep: a resumed
        run that applied updates before it stopped passes. A guard that checked nothing (a run resumed at its
        last step) passes.
        """
        if self.checked and not self.applied:
            raise NonFiniteError(
                f"{self._prefix()}every update of the run was skipped ({self.skipped_total} skipped: non-finite "
                "gradient, loss or updated weights), so the weights never changed; check optim.lr and its schedule, "
                "the data and the initial weights"
            )

    def _prefix(self) -> str:
        return "" if self.model is None else f"{self.model}: "


def _count(value: Any) -> int:
    """A counter of the step's metrics, given as its "last" ``Metric`` or as a scalar."""
    return int(_value(value))


def _value(value: Any) -> float:
    """A metric's value, given as its ``Metric`` or as a scalar; read on the host (``combine_updates``:
    ``Metric.value`` would compile and run a JAX program of its own for it)."""
    return combine_updates([{"value": value}])["value"] if isinstance(value, Metric) else float(value)
