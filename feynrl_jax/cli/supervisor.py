"""A lost process of a multi-process job becomes one line and exit code 1, not a hang or a C++ stack dump.

When a process of a `jax.distributed` job dies (killed, out of memory, its host gone), JAX's coordination service
notices the missing heartbeats within `distributed.heartbeat_timeout_s` and stops every other process with a
fatal C++ error: `abort()`, a page of stack addresses, no Python exception to catch. So in a multi-process launch
the `feynrl-jax` console script runs `train` / `eval` in a child process and watches it:

* the child's stderr is passed through line by line until a fatal error of JAX's native runtime (a glog line
  `F1124 00:40:30.352601 ... client.h:80] Terminating process because ...`, or an uncaught C++ exception,
  `terminate called after throwing an instance of ...` with its `what():` line, as gloo throws when a peer's
  connection closes in the middle of a CPU collective, or at least Python's `Fatal Python error: Aborted`), after
  which the stack dumps that follow are dropped;
* a child stopped that way ends with one line and exit code 1 (`errors.EXIT_RUN_FAILED`):
  `feynrl-jax: error: process 0 of 2 stopped: another process of the job died or stopped answering ...` when
  the coordination service stopped it, or the runtime's own message otherwise (a collective whose peer is gone);
  a child aborted (SIGABRT) without such a line ends the same way, named as aborted;
* any other exit code, or death by a signal (128 + signal number), is passed on unchanged;
* SIGTERM and SIGINT sent to the parent (SLURM's `scancel`, Ctrl-C) go to the child, and the child dies with
  its parent (`PR_SET_PDEATHSIG`), so killing the process that a launcher started kills the whole process.

A single-process run does not take this path: nothing changes for it.
"""

from __future__ import annotations

import ctypes
import os
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Mapping, Sequence

from feynrl_jax.errors import EXIT_RUN_FAILED

CHILD = "_FEYNRL_SUPERVISED"
"""Set in the child's environment: it runs the command itself."""
COMMANDS = ("train", "eval")
"""Subcommands that join a multi-process job."""
FATAL_MARKER = b"JAX distributed service detected fatal errors"
"""What JAX's coordination client prints when it stops a process because another one of the job is gone."""
_NATIVE_FATAL = re.compile(rb"^F\d{4} [\d:.]+\s+\d+ \S+\] (.*)")
_UNCAUGHT = re.compile(rb"^terminate called after throwing an instance of (.*)")
_WHAT = re.compile(rb"^\s*what\(\):\s*(.*)")
_PYTHON_FATAL = re.compile(rb"^(Fatal Python error: .*)")
LAUNCH_VARIABLES = (
    "FEYNRL_NUM_PROCESSES",
    "JAX_NUM_PROCESSES",
    "SLURM_NTASKS",
    "TPU_WORKER_ID",
    "TPU_WORKER_HOSTNAMES",
    "CLOUD_TPU_TASK_ID",
    "MEGASCALE_COORDINATOR_ADDRESS",
)
"""Variables without which `sharding.multihost` sees a single process: checked first, so that a single-process
command does not pay for importing JAX here (tests/test_cli_supervisor.py keeps the list in step)."""
_PR_SET_PDEATHSIG = 1


def wanted(argv: Sequence[str], environ: Mapping[str, str]) -> bool:
    """Whether this invocation should run its command in a watched child: a multi-process `train` / `eval`.

    A launch environment that cannot be read (half-set variables) is left to the command, which reports it.
    """
    if len(argv) < 2 or argv[1] not in COMMANDS or environ.get(CHILD) == "1":
        return False
    if not any(environ.get(name, "").strip() for name in LAUNCH_VARIABLES):
        return False
    from feynrl_jax.sharding.multihost import DistributedConfigError, detect_distributed_env

    try:
        return detect_distributed_env(environ).is_multiprocess
    except DistributedConfigError:
        return False


def _die_with_parent() -> None:  # runs in the child between fork and exec
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):  # not Linux: the child may outlive a parent killed with SIGKILL
        pass


def supervise(argv: Sequence[str], environ: Mapping[str, str] | None = None) -> int:
    """Runs `python -m feynrl_jax.cli.main argv[1:]` as a child and returns the exit code this process should use.

    Args:
        argv: this process's `sys.argv` (program, subcommand, flags).
        environ: the environment (`os.environ` by default); the child gets it plus `_FEYNRL_SUPERVISED=1`.

    Returns:
        The child's exit code, 128 + the signal that killed it, or 1 after the coordination service stopped it
        (the one-line reason is printed on stderr).
    """
    env = {**(os.environ if environ is None else environ), CHILD: "1"}
    child = subprocess.Popen(
        [sys.executable, "-m", "feynrl_jax.cli.main", *argv[1:]],
        env=env,
        stderr=subprocess.PIPE,
        preexec_fn=_die_with_parent if sys.platform == "linux" else None,
    )
    previous = {sig: signal.signal(sig, lambda s, _f: child.send_signal(s)) for sig in (signal.SIGTERM, signal.SIGINT)}
    fatal = _FatalLine()
    relay = threading.Thread(target=_relay, args=(child.stderr, fatal), daemon=True)
    relay.start()
    try:
        code = child.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    relay.join(timeout=10)
    if fatal.line is None and code == -signal.SIGABRT:
        fatal.line = b"the process aborted (SIGABRT)"
    if code != 0 and fatal.line is not None:
        who = _process_text(env)
        if FATAL_MARKER in fatal.line:
            why = (
                "another process of the job died or stopped answering for distributed.heartbeat_timeout_s, and "
                "JAX's coordination service ended the job (see that process's output for why)"
            )
        else:
            why = f"JAX's runtime stopped it: {fatal.line.decode(errors='replace').strip()}"
        print(
            f"feynrl-jax: error: {who} stopped: {why}. Start every process again with --resume: it continues from "
            "the last checkpoint that all of them committed.",
            file=sys.stderr,
            flush=True,
        )
        return EXIT_RUN_FAILED
    return 128 - code if code < 0 else code


class _FatalLine:
    """The first fatal line of JAX's native runtime (glog's `F<date> ... file:line] message`, or an uncaught C++
    exception's type and then its `what():` message), once seen."""

    line: bytes | None = None
    uncaught: bool = False


def _relay(stream, fatal: _FatalLine) -> None:
    """Copies the child's stderr to ours until a native fatal line; keeps that line's message and drops what
    follows it (the native stack dump and Python's dump of every thread)."""
    out = sys.stderr.buffer
    for line in iter(stream.readline, b""):
        if fatal.line is not None:
            what = _WHAT.match(line) if fatal.uncaught else None
            if what:  # the exception's message names the problem better than its type
                fatal.line, fatal.uncaught = what.group(1), False
            continue
        native, uncaught, python = _NATIVE_FATAL.match(line), _UNCAUGHT.match(line), _PYTHON_FATAL.match(line)
        if native or uncaught or python:  # Python's own report of the abort comes last, after the runtime's
            fatal.line = (native or uncaught or python).group(1)
            fatal.uncaught = uncaught is not None
            continue
        out.write(line)
        out.flush()


def _process_text(environ: Mapping[str, str]) -> str:
    from feynrl_jax.sharding.multihost import detect_distributed_env

    spec = detect_distributed_env(environ)
    if spec.process_id is None:
        return "this process"
    return f"process {spec.process_id} of {spec.num_processes}"
