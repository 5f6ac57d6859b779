"""``metrics.jsonl``: every logged metric, one JSON object per line, appended per step.

Each line is ``{"step": int, "time": float (Unix wall time), "<namespace>/<name>": value, ...}``. Non-finite
values are written as ``null`` (strict JSON).

Crash safety. A line is written with one ``write`` call on a file opened with ``O_APPEND`` (no user-space
buffer), so a crash leaves at most the last line cut short. A run that opens the file again first drops such
a partial last line (it has no newline), so its own lines start on a fresh line; a resumed run also drops
the lines of steps after the step it resumes from, which it is about to run (and log) again. The file is
rewritten for that through a temporary file and an atomic rename, never in place. :func:`read_metrics`
skips any malformed line with a warning naming its line number, and when a step appears twice the later
line wins.
"""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

from feynrl_jax.errors import InputError

log = logging.getLogger(__name__)

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


def _parse_record(line: bytes | str) -> dict[str, Any]:
    """One line as a metrics record; ValueError (with the reason) when it is not one."""
    record = json.loads(line)
    if not isinstance(record, dict) or not isinstance(record.get("step"), int):
        raise ValueError('not a JSON object with an integer "step"')
    return record


def _reason(error: ValueError) -> str:
    return error.msg if isinstance(error, json.JSONDecodeError) else str(error)


def _repair(path: str, resume_step: int | None) -> None:
    """Makes ``path`` valid JSONL before appending: drops a partial last line, and records after ``resume_step``.

    Lines are kept byte for byte; the file is replaced atomically, and only when something is dropped.
    """
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return
    lines = data.split(b"\n")
    tail = lines.pop()  # b"" when the file ends with a newline; otherwise a line cut short by a crash
    dropped: list[str] = []
    unterminated = False
    if tail:
        try:
            _parse_record(tail)
            lines.append(tail)  # whole but unterminated (written by hand?): kept, with a newline added
            unterminated = True
        except ValueError:
            dropped.append(f"a partial last line ({len(tail)} bytes, no newline)")
    if resume_step is not None:
        kept, later = [], 0
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                step = _parse_record(line)["step"]
            except ValueError as error:
                dropped.append(f"malformed line {number} ({_reason(error)})")
                continue
            if step > resume_step:
                later += 1
                continue
            kept.append(line)
        if later:
            dropped.append(f"{later} line(s) of steps after {resume_step}, which this run logs again")
        lines = kept
    if not dropped:
        if unterminated:
            with open(path, "ab") as f:
                f.write(b"\n")
        return
    temporary = path + ".tmp"
    with open(temporary, "wb") as f:
        f.write(b"".join(line + b"\n" for line in lines))
        f.flush()
        os.fsync(f.fileno())
    os.replace(temporary, path)
    log.warning("%s: dropped %s", path, "; ".join(dropped))


class MetricsFile:
    """Appends metric records to ``run_dir/metrics.jsonl``, one line per ``write`` call.

    Args:
        run_dir: the run folder (created if missing).
        resume_step: the step a (re)started run continues after (0 for a fresh run): lines of later steps are
            dropped before appending. None keeps every whole line (appending to another run's file).

    A partial last line left by a crash is dropped in either case.
    """

    def __init__(self, run_dir: str, *, resume_step: int | None = None):
        os.makedirs(run_dir, exist_ok=True)
        self.path = os.path.join(run_dir, METRICS_FILE)
        _repair(self.path, resume_step)
        self._fd: int | None = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)

    def write(self, step: int, wall_time: float, metrics: dict[str, Any]) -> dict[str, Any]:
        """Appends one line in a single ``write`` call (nothing is buffered); returns the record written.

        Raises:
            InputError: the line cannot be written (a full disk, say), naming the file.
        """
        if self._fd is None:
            raise ValueError(f"{self.path} is closed")
        record = {"step": int(step), "time": float(wall_time)}
        record.update({name: scalar_value(name, value) for name, value in metrics.items()})
        line = (json.dumps(record, allow_nan=False) + "\n").encode("utf-8")
        try:
            written = os.write(self._fd, line)
            while written < len(line):  # a short write (rare on regular files): finish the same line
                written += os.write(self._fd, line[written:])
        except OSError as error:
            raise InputError(f"cannot append step {step} to {self.path}: {error.strerror}") from error
        return record

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def read_metrics(run_dir: str) -> list[dict[str, Any]]:
    """The records of ``run_dir/metrics.jsonl``, one per step in step order (the last line of a step wins).

    A malformed line (cut short by a crash, or damaged) is skipped with a warning naming the file and its line
    number; so is a line that is not a JSON object with an integer ``"step"``.

    Raises:
        FileNotFoundError: the run folder has no metrics file.
    """
    path = os.path.join(run_dir, METRICS_FILE)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no {METRICS_FILE} in run folder {run_dir}")
    with open(path, "rb") as f:
        lines = f.read().split(b"\n")
    by_step: dict[int, dict[str, Any]] = {}
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = _parse_record(line)
        except ValueError as error:  # UnicodeDecodeError and JSONDecodeError are ValueErrors too
            where = f"line {number}" + (" (the last, cut short by a crash?)" if number == len(lines) else "")
            log.warning("%s, %s: skipping a malformed metrics record (%s)", path, where, _reason(error))
            continue
        by_step[record["step"]] = record
    return [by_step[step] for step in sorted(by_step)]


def metric_series(records: Sequence[Mapping[str, Any]], name: str) -> tuple[list[int], list[float]]:
    """One metric of a run as a curve: the steps that logged it as a number, and its values there.

    Args:
        records: a run's records, as :func:`read_metrics` returns them (step order).
        name: a metric name, e.g. ``"rollout/reward/total/mean"``.

    Returns:
        ``(steps, values)``, two lists of equal length in the records' order; a step where the metric is
        missing or ``null`` (a non-finite value) is left out.
    """
    steps, values = [], []
    for record in records:
        value = record.get(name)
        if isinstance(value, int | float) and not isinstance(value, bool):
            steps.append(record["step"])
            values.append(float(value))
    return steps, values
