"""The SIGKILL / resume harness shared by the exact-resume tests (SFT and RL), as plain functions.

A test writes a config file, runs `feynrl-jax train` in subprocesses with `start_train`, kills one with
`kill_after_logged_step` once it has logged a given step and committed a checkpoint, resumes it with
`start_train` + `wait_success`, and compares the straight and the interrupted run with `assert_same_metrics`
and `assert_same_final_state` (bitwise). Not a test module: pytest imports it from the tests folder.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable

import jax
import numpy as np
from xla_codegen import with_suite_codegen

from feynrl_jax.checkpoints.train_state import TrainCheckpointer, latest_step
from feynrl_jax.tracking import read_metrics


def subprocess_env(*, devices: int, rl: bool = False, **extra: str) -> dict[str, str]:
    """The environment of every run of one test: CPU, `devices` fake devices, the suite's XLA code generation or,
    for an RL run (`rl`), XLA's default (tests/xla_codegen.py), offline, and the session's persistent compilation
    cache (tests/conftest.py), every program written to it (a minimum compile time of 0: these runs start many
    processes that build the same small programs), so a program another run compiled is loaded: the same
    executable either way; it only saves time."""
    devices_flag = f"--xla_force_host_platform_device_count={devices}"
    env = dict(os.environ)
    env.update(
        JAX_PLATFORMS="cpu",
        XLA_FLAGS=devices_flag if rl else with_suite_codegen(devices_flag),
        HF_HUB_OFFLINE="1",
        WANDB_MODE="offline",
        RAY_AUTH_MODE="disabled",
        JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
    )
    env.update(extra)
    return env


def popen(argv: list[str], env: dict[str, str], *, new_session: bool = False) -> subprocess.Popen:
    """Starts `argv` with stdout discarded and stderr kept in a temporary file (`stderr_text`); `new_session` puts it
    in its own process group (Ray)."""
    err = tempfile.TemporaryFile()
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=err, start_new_session=new_session)
    proc.stderr_file = err  # closed with the Popen object
    return proc


def stderr_text(proc: subprocess.Popen) -> str:
    """What a `popen` process has written to stderr so far (read at an offset: the process's own stays where it is)."""
    fd = proc.stderr_file.fileno()
    return os.pread(fd, os.fstat(fd).st_size, 0).decode(errors="replace")


def start_train(config_spec: str, env: dict[str, str], *, new_session: bool = False) -> subprocess.Popen:
    """Starts `feynrl-jax train --config=<config_spec>` (`popen`)."""
    command = [sys.executable, "-m", "feynrl_jax.cli.main", "train", f"--config={config_spec}"]
    return popen(command, env, new_session=new_session)


def wait_success(proc: subprocess.Popen, *, timeout: float) -> None:
    """Waits for a `popen` process and fails with the end of its stderr unless it exited with 0."""
    proc.wait(timeout=timeout)
    assert proc.returncode == 0, f"run exited with {proc.returncode}: {stderr_text(proc)[-3000:]}"


def logged_steps(run_dir: str) -> list[int]:
    """The steps of `run_dir/metrics.jsonl` in file order (a line being written is ignored)."""
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        return []
    steps = []
    with open(path) as f:
        for line in f:
            try:
                steps.append(json.loads(line)["step"])
            except (json.JSONDecodeError, KeyError):
                continue
    return steps


def logged_and_committed(run_dir: str | os.PathLike, step: int) -> bool:
    """Whether the run has logged `step` or later and has a committed checkpoint.

    Saves are asynchronous: the checkpoint of an earlier step may still be written in the background when a later
    step is logged (on a loaded machine the writer thread lags), so a test that waited for the logged step alone
    could kill a run before anything is committed to resume from.
    """
    return any(s >= step for s in logged_steps(str(run_dir))) and latest_step(run_dir) is not None


def kill_after_logged_step(
    proc: subprocess.Popen,
    run_dir: str,
    step: int,
    *,
    save_every: int,
    total_steps: int,
    timeout: float,
    group: bool = False,
) -> int:
    """SIGKILLs `proc` (its whole process group when `group`) once the run has logged `step` or later and has
    committed a checkpoint (`logged_and_committed`).

    Returns:
        The newest committed checkpoint step left behind (asserted to be a real, unfinished one).
    """
    deadline = time.monotonic() + timeout
    while not logged_and_committed(run_dir, step):
        if proc.poll() is not None:
            raise AssertionError(
                f"the run exited (code {proc.returncode}) before step {step} and a committed checkpoint: "
                f"{stderr_text(proc)[-3000:]}"
            )
        assert time.monotonic() < deadline, f"step {step} and a committed checkpoint never reached"
        time.sleep(0.002)
    if group:
        os.killpg(proc.pid, signal.SIGKILL)
    else:
        proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, f"the run was not killed (exit code {proc.returncode})"
    committed = latest_step(run_dir)
    assert committed is not None and save_every <= committed < total_steps, committed
    return committed


def assert_same_metrics(want_dir: str, got_dir: str, keys: Iterable[str], *, total_steps: int) -> None:
    """Both runs logged steps 1..total_steps with bitwise-equal values of `keys` (the later line of a step wins)."""
    want, got = read_metrics(want_dir), read_metrics(got_dir)
    want = [r for r in want if r["step"] >= 1]
    got = [r for r in got if r["step"] >= 1]
    assert [r["step"] for r in want] == list(range(1, total_steps + 1))
    assert [r["step"] for r in got] == list(range(1, total_steps + 1))
    for key in keys:
        assert [r[key] for r in got] == [r[key] for r in want], key


def final_state(run_dir: str, *, total_steps: int) -> dict[str, np.ndarray]:
    """The train state of the run's checkpoint at `total_steps`, flattened to `{path: host array}`."""
    with TrainCheckpointer(run_dir, save_every=1, keep=1, read_only=True) as ckpt:
        assert ckpt.latest_step() == total_steps
        state = ckpt.restore_state_unsharded()
    leaves, _ = jax.tree_util.tree_flatten_with_path(state)
    return {jax.tree_util.keystr(path): np.asarray(leaf) for path, leaf in leaves}


def assert_same_final_state(want_dir: str, got_dir: str, *, total_steps: int) -> None:
    """The final train states (params, optimizer state, counters) of two runs are bitwise equal."""
    a, b = final_state(want_dir, total_steps=total_steps), final_state(got_dir, total_steps=total_steps)
    assert a.keys() == b.keys()
    for name in a:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)
