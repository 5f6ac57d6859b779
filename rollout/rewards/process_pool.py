"""A persistent pool of worker processes that calls rewards with a hard per-call timeout.

Why processes, and why not ``multiprocessing.Pool`` or ``concurrent.futures``:

- math-verify's parsing and comparison (and SymPy under them) are bounded with ``SIGALRM``, which works only in a
  process's main thread; a reward may also hang in C code that no Python-level timeout interrupts. Only killing
  the process stops every kind of hang.
- The standard pools cannot kill one worker and go on: a ``ProcessPoolExecutor`` whose worker dies is broken, and
  ``Pool`` offers no per-task timeout that frees the worker. This pool kills the hung worker (SIGKILL), starts a
  replacement, and hands the rest of its chunk to the other workers.
- Workers are started with the ``spawn`` method (``forkserver`` also works): the parent has imported JAX, whose
  threads make ``fork`` unsafe.
- A reward whose module imports a slow library at its first call (so that the process that builds the pool never
  imports it) names that library in a ``worker_imports`` attribute (a tuple of module names); each worker imports
  those modules during its start-up, bounded by ``start_timeout_s``, so the per-call timeout never pays for them.

Protocol: a worker receives a chunk (a list of ``(row, reward_index)`` calls plus the rows' data), runs the calls
in order and sends one message per finished call (its row, reward index, value, status and error message). The
parent's deadline for a busy worker is the time of its last message plus ``timeout_s``, so every single call gets
``timeout_s``, however long the chunk. When the deadline passes, the call in progress is known (the first one not
yet reported), scored 0 and counted as a timeout.

A reward that raises scores 0 and is counted as an error (its message kept); a worker that dies (a segfault, an
``os._exit`` in a reward) costs the call in progress the same way. A reward that bounds its own work
(``math_verify_reward``'s ``SIGALRM``) raises :class:`RewardTimeout` when that bound fires: the call scores 0 and is
counted as a timeout (its message kept), like a call the parent cut off, but the worker got control back and goes on
serving. Workers ignore SIGINT (the parent decides when they stop), are daemonic, and exit on their own when the
parent process disappears.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import importlib
import importlib.util
import logging
import math
import multiprocessing
import multiprocessing.connection
import os
import pickle
import signal
import sys
import threading
import time
import traceback
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

logger = logging.getLogger(__name__)

STATUS_OK = 0
STATUS_ERROR = 1
STATUS_TIMEOUT = 2

_PARENT_POLL_S = 1.0


class RewardTimeout(Exception):
    """Raised by a reward whose own time bound fired (``math_verify_reward``'s ``SIGALRM``, a judge's request timeout).

    The pool scores the call 0 and counts it as a timeout (``STATUS_TIMEOUT``), not an error, with this message; the
    worker process is kept, since the reward returned control.
    """


def _exit_when_orphaned(parent_pid: int) -> None:
    """Worker-side watchdog thread: leave as soon as the parent process is gone (no leaked workers).

    ``parent_pid`` is the worker's parent at start-up: the scorer's process under ``spawn``, the fork server
    under ``forkserver`` (which itself exits with the scorer's process). Orphans are re-parented, so a changed
    parent id means the parent died.
    """
    while True:
        time.sleep(_PARENT_POLL_S)
        if os.getppid() != parent_pid:
            os._exit(1)


def _describe(error: BaseException) -> str:
    """``"TypeName: message"``, cut to a sane length (and never raising, whatever ``str(error)`` does)."""
    try:
        message = str(error)
    except Exception:
        message = "<unprintable>"
    return f"{type(error).__name__}: {message}"[:500]


def worker_imports(fn: Callable[..., Any]) -> tuple[str, ...]:
    """The modules a reward asks its worker to import at start-up.

    Args:
      fn: a reward: a function, a ``functools.partial`` of one, or any callable object.

    Returns:
      The ``worker_imports`` attribute of ``fn`` (of the function a partial wraps, however deeply), as a tuple;
      empty when it has none.

    Raises:
      TypeError: when the attribute is a single string, not a collection of module names.
    """
    while isinstance(fn, functools.partial):
        fn = fn.func
    names = getattr(fn, "worker_imports", ())
    if isinstance(names, str):
        raise TypeError(f"worker_imports of reward {fn!r} must be a tuple of module names, got the string {names!r}")
    return tuple(names)


def _installed(module: str) -> bool:
    """Whether the top-level package of ``module`` can be imported; nothing is imported to find out."""
    try:
        return importlib.util.find_spec(module.partition(".")[0]) is not None
    except (ImportError, ValueError):
        return False


def _worker_main(conn: multiprocessing.connection.Connection, payload: bytes) -> None:
    """Entry point of a worker process: unpickle the rewards, then serve chunks until told to stop."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    threading.Thread(target=_exit_when_orphaned, args=(os.getppid(),), daemon=True).start()
    try:
        functions = pickle.loads(payload)
        for fn in functions:
            for module in worker_imports(fn):
                importlib.import_module(module)
    except BaseException:  # Anything that breaks start-up is reported to the parent.
        conn.send(("init_error", traceback.format_exc()))
        return
    conn.send(("ready", os.getpid()))
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            return
        if message is None:
            # Skip the interpreter's teardown (slow with SymPy loaded): there is nothing left to clean up.
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)
        calls, blobs = message
        rows = {}
        for row, index in calls:
            try:
                if row not in rows:
                    rows[row] = pickle.loads(blobs[row])
                prompt, completion, example = rows[row]
                value = float(functions[index](prompt, completion, example))
                if not math.isfinite(value):
                    raise ValueError(f"reward returned a non-finite value {value!r}")
                conn.send((row, index, value, STATUS_OK, None))
            except RewardTimeout as e:  # The reward's own bound fired: a timeout, and the worker is fine.
                conn.send((row, index, 0.0, STATUS_TIMEOUT, _describe(e)))
            except Exception as e:  # A failing reward scores 0 and is counted, by design.
                conn.send((row, index, 0.0, STATUS_ERROR, _describe(e)))


@dataclasses.dataclass(eq=False)
class _Worker:
    """Parent-side record of one worker process."""

    process: Any  # multiprocessing.process.BaseProcess
    conn: multiprocessing.connection.Connection
    started_at: float
    ready: bool = False
    calls: collections.deque = dataclasses.field(default_factory=collections.deque)
    deadline: float = math.inf

    @property
    def busy(self) -> bool:
        return bool(self.calls)


def _stop_workers(workers: list[_Worker]) -> None:
    """Asks every worker to exit, kills those that do not within a second, and reaps them all."""
    for worker in workers:
        try:
            worker.conn.send(None)
        except (OSError, ValueError):
            pass
    deadline = time.monotonic() + 1.0
    for worker in workers:
        worker.process.join(timeout=max(0.0, deadline - time.monotonic()))
        if worker.process.is_alive():
            worker.process.kill()
            worker.process.join(timeout=5.0)
        worker.conn.close()
    workers.clear()


@dataclasses.dataclass(frozen=True)
class PoolResult:
    """Results of one :meth:`TimeoutProcessPool.map` call over N rows and K rewards.

    Attributes:
      values: ``[N, K]`` float64, the reward values; 0 where a call failed or timed out.
      status: ``[N, K]`` int8, ``STATUS_OK``, ``STATUS_ERROR`` or ``STATUS_TIMEOUT``.
      errors: ``(row, reward_index, message)`` of every failed or timed-out call.
    """

    values: np.ndarray
    status: np.ndarray
    errors: list[tuple[int, int, str]]


class TimeoutProcessPool:
    """Calls a fixed list of rewards on many rows in worker processes, each call bounded by ``timeout_s``.

    Use as a context manager, or call :meth:`close`; the workers are also stopped when the pool is garbage
    collected or the interpreter exits.
    """

    def __init__(
        self,
        functions: Sequence[Callable[[str, str, dict], float]],
        *,
        num_workers: int,
        timeout_s: float,
        start_timeout_s: float = 120.0,
        mp_context: str = "spawn",
        max_chunk: int = 64,
    ):
        """Starts the workers (without waiting for them to be ready).

        Args:
          functions: the rewards; picklable (module-level functions or partials of them).
          num_workers: number of worker processes, >= 1.
          timeout_s: the bound on one reward call, in seconds, > 0.
          start_timeout_s: the bound on a worker's start-up (interpreter, imports, unpickling the rewards).
          mp_context: ``"spawn"`` or ``"forkserver"`` (``"fork"`` is refused: unsafe once JAX runs threads).
          max_chunk: the most calls sent to a worker at once.

        Raises:
          ValueError: on a bad argument, or a module a reward names in ``worker_imports`` whose top-level package is
            not installed (a missing submodule of an installed package fails the worker's start-up instead).
          TypeError: when a reward cannot be pickled (naming it), or names its ``worker_imports`` as one string.
        """
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        if mp_context not in ("spawn", "forkserver"):
            raise ValueError(f"mp_context must be 'spawn' or 'forkserver', got {mp_context!r}")
        for index, fn in enumerate(functions):
            for module in worker_imports(fn):  # the workers import it; a missing one fails here, not at a first call
                if not _installed(module):
                    raise ValueError(f"reward #{index} {fn!r} needs module {module!r}, which is not installed")
            try:
                pickle.dumps(fn)
            except Exception as e:
                raise TypeError(
                    f"reward #{index} {fn!r} cannot be pickled into a worker process (use a module-level function "
                    f"or a functools.partial of one, not a lambda or closure): {_describe(e)}"
                ) from e
        self.num_functions = len(functions)
        self.timeout_s = float(timeout_s)
        self.start_timeout_s = float(start_timeout_s)
        self.max_chunk = int(max_chunk)
        self.num_workers = int(num_workers)
        self.workers_replaced = 0
        self._payload = pickle.dumps(list(functions))
        self._context = multiprocessing.get_context(mp_context)
        self._lock = threading.Lock()
        self._workers: list[_Worker] = []
        self._closed = False
        self._finalizer = weakref.finalize(self, _stop_workers, self._workers)
        for _ in range(num_workers):
            self._workers.append(self._start_worker())

    # -- worker life cycle ---------------------------------------------------------------------------------------

    def _start_worker(self) -> _Worker:
        parent_conn, child_conn = self._context.Pipe(duplex=True)
        process = self._context.Process(
            target=_worker_main,
            args=(child_conn, self._payload),
            name="feynrl-reward-worker",
            daemon=True,
        )
        process.start()
        child_conn.close()
        return _Worker(process=process, conn=parent_conn, started_at=time.monotonic())

    def _replace(self, worker: _Worker) -> None:
        """Kills ``worker`` (if still alive) and puts a fresh one in its place."""
        if worker.process.is_alive():
            worker.process.kill()
        worker.process.join(timeout=5.0)
        worker.conn.close()
        self._workers[self._workers.index(worker)] = self._start_worker()
        self.workers_replaced += 1

    @property
    def worker_pids(self) -> list[int]:
        """Process ids of the current workers."""
        return [w.process.pid for w in self._workers]

    def close(self) -> None:
        """Stops every worker and reaps it; idempotent."""
        self._closed = True
        self._finalizer()

    def __enter__(self) -> TimeoutProcessPool:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- scoring -------------------------------------------------------------------------------------------------

    def map(self, rows: Sequence[tuple[str, str, dict]]) -> PoolResult:
        """Calls every reward on every row.

        Args:
          rows: N ``(prompt, completion, example)`` tuples; picklable.

        Returns:
          A :class:`PoolResult` with ``[N, K]`` values and statuses, K the number of rewards.

        Raises:
          ValueError: when a row cannot be pickled (naming the row); nothing is run then.
          RuntimeError: when the pool is closed, or a worker cannot start (the worker's traceback is included).
        """
        blobs = []
        for i, row in enumerate(rows):
            try:
                blobs.append(pickle.dumps(row, protocol=pickle.HIGHEST_PROTOCOL))
            except Exception as e:
                raise ValueError(f"row {i} cannot be pickled for the reward workers: {_describe(e)}") from e
        with self._lock:
            if self._closed:
                raise RuntimeError("the reward pool is closed")
            try:
                return self._map(blobs)
            except BaseException:
                # An interrupted or failed map leaves workers mid-chunk: stop them all rather than leak state.
                self.close()
                raise

    def _map(self, blobs: Sequence[bytes]) -> PoolResult:
        n, k = len(blobs), self.num_functions
        values = np.zeros((n, k), np.float64)
        status = np.full((n, k), -1, np.int8)
        errors: list[tuple[int, int, str]] = []
        calls = [(row, index) for row in range(n) for index in range(k)]
        chunk = max(1, min(self.max_chunk, math.ceil(len(calls) / (4 * self.num_workers))))
        pending = collections.deque(calls[i : i + chunk] for i in range(0, len(calls), chunk))
        remaining = len(calls)

        def finish(worker: _Worker, value: float, code: int, message: str | None) -> None:
            nonlocal remaining
            row, index = worker.calls.popleft()
            values[row, index] = value
            status[row, index] = code
            if message is not None:
                errors.append((row, index, message))
            remaining -= 1
            worker.deadline = time.monotonic() + self.timeout_s if worker.calls else math.inf

        def fail_in_progress(worker: _Worker, code: int, message: str) -> None:
            """The call in progress fails; the rest of the chunk goes back to the queue; the worker is replaced."""
            finish(worker, 0.0, code, message)
            if worker.calls:
                pending.appendleft(list(worker.calls))
                worker.calls.clear()
            self._replace(worker)

        while remaining:
            for worker in self._workers:
                if worker.ready and not worker.busy and pending:
                    batch = pending.popleft()
                    needed = {row: blobs[row] for row, _ in batch}
                    worker.calls.extend(batch)
                    worker.deadline = time.monotonic() + self.timeout_s
                    try:
                        worker.conn.send((batch, needed))
                    except (OSError, ValueError):
                        pending.appendleft(list(worker.calls))
                        worker.calls.clear()
                        self._replace(worker)
            now = time.monotonic()
            deadlines = [w.deadline if w.ready else w.started_at + self.start_timeout_s for w in self._workers]
            wait_s = min(_PARENT_POLL_S, max(0.0, min(deadlines) - now))
            by_conn = {w.conn: w for w in self._workers}
            for conn in multiprocessing.connection.wait(list(by_conn), timeout=wait_s):
                worker = by_conn[conn]
                try:
                    message = conn.recv()
                except (EOFError, OSError):
                    worker.process.join(timeout=5.0)
                    exit_message = f"reward worker exited with code {worker.process.exitcode}"
                    if not worker.ready:
                        raise RuntimeError(f"{exit_message} while starting") from None
                    if worker.busy:
                        fail_in_progress(worker, STATUS_ERROR, exit_message)
                    else:
                        self._replace(worker)
                    continue
                if message[0] == "ready":
                    worker.ready = True
                elif message[0] == "init_error":
                    raise RuntimeError(f"reward worker failed to start:\n{message[1]}")
                else:
                    row, index, value, code, error = message
                    expected = worker.calls[0] if worker.calls else None
                    if expected != (row, index):
                        raise RuntimeError(f"reward worker protocol error: got {(row, index)}, expected {expected}")
                    finish(worker, value, code, error)
            now = time.monotonic()
            for worker in list(self._workers):
                if not worker.ready and now > worker.started_at + self.start_timeout_s:
                    raise RuntimeError(f"reward worker did not start within {self.start_timeout_s:.0f} s")
                if worker.busy and now > worker.deadline:
                    row, index = worker.calls[0]
                    logger.warning("reward #%d timed out after %.1f s on row %d", index, self.timeout_s, row)
                    fail_in_progress(worker, STATUS_TIMEOUT, f"timed out after {self.timeout_s} s")
        return PoolResult(values=values, status=status, errors=errors)
