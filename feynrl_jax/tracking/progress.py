"""A live progress bar (tqdm): step, rate, ETA, the loss and a few main metrics."""

from __future__ import annotations

import sys
from typing import IO, Any

from tqdm import tqdm

MAIN_METRIC_HINTS = ("reward", "kl", "accuracy", "pass@", "entropy")
"""Substrings that promote a metric into the bar next to the loss (first matches, in this order)."""


def main_metrics(metrics: dict[str, Any], *, max_items: int = 4) -> dict[str, Any]:
    """Picks what the bar shows: the first ``loss/`` metric, then metrics matching :data:`MAIN_METRIC_HINTS`."""
    picked: dict[str, Any] = {}
    losses = [k for k in metrics if k.startswith("loss/")]
    if losses:
        key = "loss/total" if "loss/total" in metrics else losses[0]
        picked[key] = metrics[key]
    for hint in MAIN_METRIC_HINTS:
        for key, value in metrics.items():
            if len(picked) >= max_items:
                return picked
            if hint in key and key not in picked:
                picked[key] = value
                break
    return picked


class ProgressBar:
    """Wraps ``tqdm``: :meth:`update` moves the bar to ``step`` and shows the main metrics.

    Args:
        total_steps: the run's last step (for the ETA); None for an open-ended bar.
        initial_step: the step a resumed run starts from.
        stream: where to draw (stderr by default).
    """

    def __init__(self, total_steps: int | None, *, initial_step: int = 0, stream: IO[str] | None = None):
        self._bar = tqdm(
            total=total_steps,
            initial=initial_step,
            file=stream or sys.stderr,
            dynamic_ncols=True,
            unit="step",
            desc="train",
        )
        self._step = initial_step

    def update(self, step: int, metrics: dict[str, Any]) -> None:
        shown = {k: (f"{v:.4g}" if isinstance(v, float) else v) for k, v in main_metrics(metrics).items()}
        self._bar.set_postfix(shown, refresh=False)
        if step > self._step:
            self._bar.update(step - self._step)
            self._step = step
        else:
            self._bar.refresh()

    def close(self) -> None:
        self._bar.close()
