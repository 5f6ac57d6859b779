"""Host-side guard that stops a run after too many consecutive skipped (non-finite) steps.

The jitted step never applies a non-finite gradient: it keeps the old params and optimizer state and counts the
skip in ``TrainState.nonfinite_streak``, reported as the metric ``train/nonfinite_streak``. A few isolated skips
are harmless (a bad batch); a streak means the run has diverged, and the loop should stop with a clear error
rather than spin.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from feynrl_jax.errors import RunFailed
from feynrl_jax.losses.metrics import Metric

STREAK_METRIC = "train/nonfinite_streak"
TOTAL_METRIC = "train/nonfinite_total"


class NonFiniteError(RunFailed):
    """Raised when the gradient or loss was non-finite for too many consecutive steps."""


class NonFiniteGuard:
    """Checks the step's metrics on the host.

    Args:
        max_consecutive: the most consecutive skipped steps tolerated; one more raises. 0 raises on the first.
    """

    def __init__(self, max_consecutive: int) -> None:
        if max_consecutive < 0:
            raise ValueError(f"max_consecutive must be >= 0, got {max_consecutive}")
        self.max_consecutive = max_consecutive

    def check(self, metrics: Mapping[str, Any], step: int | None = None) -> None:
        """Raises ``NonFiniteError`` when ``metrics["train/nonfinite_streak"]`` exceeds the limit.

        Args:
            metrics: the step's metrics (its ``Metric`` records, or device or host scalars); reading the streak
                waits for the step.
            step: the step number, for the message.
        """
        if STREAK_METRIC not in metrics:
            raise KeyError(f"metrics lack {STREAK_METRIC!r}; pass the metrics returned by the train step")
        streak = _count(metrics[STREAK_METRIC])
        if streak > self.max_consecutive:
            where = "" if step is None else f" at step {step}"
            total = _count(metrics[TOTAL_METRIC]) if TOTAL_METRIC in metrics else streak
            raise NonFiniteError(
                f"non-finite gradient or loss for {streak} consecutive steps{where} (limit {self.max_consecutive}, "
                f"{total} skipped in total): the run has diverged; lower the learning rate, check the data, or "
                "raise train.max_nonfinite_steps"
            )


def _count(value: Any) -> int:
    """A counter of the step's metrics, given as its "last" ``Metric`` or as a scalar."""
    return int(value.value if isinstance(value, Metric) else value)
