"""The tracker the loops log through: ``metrics.jsonl``, wandb and a progress bar behind one ``log`` call."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import IO, Any

from feynrl_jax.tracking.metrics_file import MetricsFile, scalar_value
from feynrl_jax.tracking.namespaces import check_metric_name
from feynrl_jax.tracking.progress import ProgressBar
from feynrl_jax.tracking.wandb_sink import WandbSink


class Tracker:
    """Logs every metric of a step to each enabled sink.

    Args:
        run_dir: the run folder; ``metrics.jsonl`` is appended there.
        total_steps: the run's last step, for the progress bar's ETA.
        initial_step: the step the run starts after: 0 for a fresh run, the restored checkpoint's step for a
            resumed one. Lines of ``metrics.jsonl`` for later steps are dropped before appending (that run had
            logged past its last checkpoint before it stopped; those steps are run and logged again). None (a
            tracker outside a training loop) keeps every whole line; a partial last line is dropped either way.
        jsonl: write ``run_dir/metrics.jsonl``.
        use_wandb: log to wandb (offline without ``WANDB_API_KEY``, online with it; started on first log).
        wandb_project: the wandb project.
        wandb_name: the wandb run name.
        config: a dict stored as the wandb run config.
        progress_bar: draw a live tqdm bar.
        progress_stream: where the bar draws (stderr by default).

    Every metric name must lie in a fixed namespace (``loss/``, ``train/``, ``rollout/``, ``eval/``,
    ``perf/``); :meth:`log` rejects any other name with a ``ValueError`` before writing anything.
    """

    def __init__(
        self,
        run_dir: str,
        *,
        total_steps: int | None = None,
        initial_step: int | None = None,
        jsonl: bool = True,
        use_wandb: bool = False,
        wandb_project: str = "feynrl-jax",
        wandb_name: str | None = None,
        config: dict[str, Any] | None = None,
        progress_bar: bool = True,
        progress_stream: IO[str] | None = None,
    ):
        self.run_dir = run_dir
        self._file = MetricsFile(run_dir, resume_step=initial_step) if jsonl else None
        self._wandb = WandbSink(run_dir, project=wandb_project, name=wandb_name, config=config) if use_wandb else None
        self._bar = (
            ProgressBar(total_steps, initial_step=initial_step or 0, stream=progress_stream) if progress_bar else None
        )

    @property
    def metrics_path(self) -> str | None:
        """The ``metrics.jsonl`` path, or None when JSONL logging is off."""
        return self._file.path if self._file is not None else None

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Records ``metrics`` (name -> scalar) at ``step`` in every sink; the JSONL line is flushed at once.

        Raises:
            ValueError: a metric name outside the fixed namespaces.
            TypeError: a value that is not a scalar.
        """
        for name in metrics:
            check_metric_name(name)
        wall_time = time.time()
        values = {name: scalar_value(name, value) for name, value in metrics.items()}
        if self._file is not None:
            self._file.write(step, wall_time, values)
        if self._wandb is not None:
            self._wandb.log(step, values)
        if self._bar is not None:
            self._bar.update(step, values)

    def close(self) -> None:
        """Flushes and closes every sink (wandb finishes its run)."""
        if self._bar is not None:
            self._bar.close()
        if self._wandb is not None:
            self._wandb.close()
        if self._file is not None:
            self._file.close()

    def __enter__(self) -> Tracker:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()
