"""``metrics.jsonl``: every logged metric, one JSON object per line, appended and flushed per step.

Each line is ``{"step": int, "time": float (Unix wall time), "<namespace>/<name>": value, ...}``. Non-finite
values are written as ``null`` (strict JSON); a resumed run appends to the same file, so a step can appear
twice (the later line wins in :func:`read_metrics`). A line cut short by a crash is ignored when reading.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any

METRICS_FILE = "metrics.jsonl"


def scalar_value(name: str, value: Any) -> float | int | None:
    """A metric value as a JSON scalar: ints stay ints, non-finite floats become None; arrays must hold one value."""
    if value is None:
        return None
    if hasattr(value, "item") and getattr(value, "size", 1) == 1:
        value = value.item()
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    raise TypeError(f"metric {name!r} must be a number or a one-element array, got {type(value).__name__}: {value!r}")


class MetricsFile:
    """Appends metric records to ``run_dir/metrics.jsonl``.

    Args:
        run_dir: the run folder (created if missing).
    """

    def __init__(self, run_dir: str):
        os.makedirs(run_dir, exist_ok=True)
        self.path = os.path.join(run_dir, METRICS_FILE)
        self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - closed in close()

    def write(self, step: int, wall_time: float, metrics: dict[str, Any]) -> dict[str, Any]:
        """Writes one line and flushes it; returns the record written."""
        record = {"step": int(step), "time": float(wall_time)}
        record.update({name: scalar_value(name, value) for name, value in metrics.items()})
        self._file.write(json.dumps(record, allow_nan=False) + "\n")
        self._file.flush()
        return record

    def close(self) -> None:
        if not self._file.closed:
            self._file.close()


def read_metrics(run_dir: str) -> list[dict[str, Any]]:
    """The records of ``run_dir/metrics.jsonl``, one per step in step order (the last line of a step wins).

    Raises:
        FileNotFoundError: the run folder has no metrics file.
        ValueError: a line other than the last is not valid JSON (naming the file and line).
    """
    path = os.path.join(run_dir, METRICS_FILE)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no {METRICS_FILE} in run folder {run_dir}")
    with open(path, encoding="utf-8") as f:
        lines = f.read().split("\n")
    by_step: dict[int, dict[str, Any]] = {}
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            if number == len(lines):  # the file did not end with a newline: a write cut short by a crash
                continue
            raise ValueError(f"{path}, line {number}: malformed metrics record: {error.msg}") from error
        by_step[int(record["step"])] = record
    return [by_step[step] for step in sorted(by_step)]
