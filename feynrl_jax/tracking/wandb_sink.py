"""Weights & Biases logging: offline without an API key, online with one; started on the first log."""

from __future__ import annotations

import os
import uuid
from typing import Any

WANDB_ID_FILE = "wandb_id.txt"


def wandb_mode() -> str:
    """ "online" when ``WANDB_API_KEY`` is set, else "offline" (runs sync later with ``wandb sync``)."""
    return "online" if os.environ.get("WANDB_API_KEY") else "offline"


class WandbSink:
    """Logs metrics to wandb, initialising lazily so runs that never log never start wandb.

    The run id is kept in ``run_dir/wandb_id.txt``, so a resumed run continues the same wandb run.

    Args:
        run_dir: the run folder (wandb writes under ``run_dir/wandb``).
        project: the wandb project.
        name: the wandb run name.
        config: a dict logged as the run's config.
    """

    def __init__(self, run_dir: str, *, project: str, name: str | None = None, config: dict[str, Any] | None = None):
        self.run_dir, self.project, self.name, self.config = run_dir, project, name, config
        self.run = None

    def _run_id(self) -> str:
        path = os.path.join(self.run_dir, WANDB_ID_FILE)
        if os.path.isfile(path):
            with open(path) as f:
                return f.read().strip()
        run_id = uuid.uuid4().hex[:12]
        os.makedirs(self.run_dir, exist_ok=True)
        with open(path, "w") as f:
            f.write(run_id)
        return run_id

    def _start(self):
        import wandb

        self.run = wandb.init(
            project=self.project,
            name=self.name,
            dir=self.run_dir,
            config=self.config,
            mode=wandb_mode(),
            id=self._run_id(),
            resume="allow",
        )
        return self.run

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        """Logs ``metrics`` at ``step`` (None values, i.e. non-finite ones, are left out)."""
        run = self.run or self._start()
        run.log({k: v for k, v in metrics.items() if v is not None}, step=int(step))

    def close(self) -> None:
        if self.run is not None:
            self.run.finish()
            self.run = None
