"""One run per run folder: an exclusive `flock` on `<run_dir>/.lock`, held for the whole run.

Two runs started on the same `run_dir` would interleave their checkpoints and metrics; the second one to take
the lock fails at once with an `InputError` that names the holder (its pid, host and start time, which the
holder writes into the lock file). The lock belongs to the open file, not to the file's existence: the kernel
releases it when the holder exits, however it exits (`kill -9` included), so a stale `.lock` file never
blocks the next run. The file itself is left in place on release; deleting it would let a third run lock a
fresh file while a second still holds the old one.

In a multi-process launch (one process per host, all on the same `run_dir`) only process 0 takes the lock;
the others share its run and would otherwise lock each other out.

Caveats: `flock` is advisory (only runs that take this lock are kept out). On NFS, Linux emulates it with a
POSIX byte-range lock, which works across hosts when the server supports locking; a file system that refuses
locks entirely (`ENOLCK`, `EOPNOTSUPP`) gets a warning and the run goes on unlocked.
"""

from __future__ import annotations

import datetime
import errno
import fcntl
import json
import logging
import os
import socket

from feynrl_jax.errors import InputError
from feynrl_jax.sharding.multihost import detect_distributed_env

log = logging.getLogger(__name__)

LOCK_FILE = ".lock"
_UNSUPPORTED = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)

_held_fds: set[int] = set()  # lock files this process holds; a forked child closes its copies


def _close_inherited() -> None:
    # A child forked without exec (multiprocessing's fork start) would otherwise keep the lock alive after its
    # parent died. Closing the child's copy only drops its reference; the parent keeps the lock.
    for fd in list(_held_fds):
        try:
            os.close(fd)
        except OSError:
            pass
    _held_fds.clear()


os.register_at_fork(after_in_child=_close_inherited)


def _is_primary_process() -> bool | None:
    """True for process 0 or a single process, False for the others, None when a launch does not say which."""
    import jax

    if jax.distributed.is_initialized():  # does not start a backend
        return jax.process_index() == 0
    spec = detect_distributed_env(os.environ)
    if not spec.is_multiprocess:
        return True
    return None if spec.process_id is None else spec.process_id == 0


def _describe(holder: str) -> str:
    """The lock file's contents as `pid 1234 on host h, started ...`, or what it holds when not ours."""
    try:
        info = json.loads(holder)
        return f"pid {info['pid']} on host {info['host']}, started {info['started']}"
    except (ValueError, KeyError, TypeError):
        return "holder unknown: the lock file does not say" if not holder.strip() else holder.strip()[:200]


class RunLock:
    """Holds `<run_dir>/.lock` exclusively (`fcntl.flock`, `LOCK_EX | LOCK_NB`) while the run lasts.

    Args:
        run_dir: the run folder (created if missing).

    Use as a context manager around the whole run, or call `acquire()` / `release()`.

    Raises:
        InputError: from `acquire` (or `__enter__`): another run holds the lock (names its pid, host and start
            time), or the lock file cannot be opened.
    """

    def __init__(self, run_dir: str | os.PathLike):
        self.run_dir = os.fspath(run_dir)
        self.path = os.path.join(self.run_dir, LOCK_FILE)
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        """Whether this object holds the lock now."""
        return self._fd is not None

    def acquire(self) -> None:
        """Takes the lock without waiting and writes this process's pid, host and start time into the file.

        A process other than process 0 of a multi-process launch takes nothing (`held` stays False).
        """
        if self._fd is not None:
            raise RuntimeError(f"{self.path} is already held by this RunLock")
        primary = _is_primary_process()
        if not primary:
            if primary is None:
                log.warning("multi-process launch whose process ids are not known yet: %s is not locked", self.path)
            return
        try:
            os.makedirs(self.run_dir, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as error:
            raise InputError(f"cannot open the run lock {self.path}: {error.strerror}") from error
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 4096, 0).decode("utf-8", "replace")
            os.close(fd)
            raise InputError(
                f"run_dir {self.run_dir} is in use by another run ({_describe(holder)}); wait for it or choose "
                "another run_dir"
            ) from None
        except OSError as error:
            if error.errno not in _UNSUPPORTED:
                os.close(fd)
                raise InputError(f"cannot lock {self.path}: {error.strerror}") from error
            log.warning(
                "the file system of %s does not support file locks (%s); nothing stops a second run from "
                "using this run_dir at the same time",
                self.run_dir,
                error.strerror,
            )
        started = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
        holder = json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "started": started})
        os.ftruncate(fd, 0)
        os.pwrite(fd, (holder + "\n").encode(), 0)
        self._fd = fd
        _held_fds.add(fd)

    def release(self) -> None:
        """Clears the holder's details and releases the lock (closing the file releases it)."""
        fd, self._fd = self._fd, None
        if fd is None:
            return
        _held_fds.discard(fd)
        try:
            os.ftruncate(fd, 0)
        except OSError:
            pass
        os.close(fd)

    def __enter__(self) -> RunLock:
        self.acquire()
        return self

    def __exit__(self, *exc_info) -> None:
        self.release()
