"""The multi-process side of the `feynrl-jax` entry point, without starting a job: which invocations are
watched by `feynrl_jax.cli.supervisor`, what the watcher reports for each way its child can end, and the XLA:CPU
flag set where several CPU devices share a process (the jobs themselves: tests/test_multiprocess_cli.py)."""

from __future__ import annotations

import sys

import pytest

from feynrl_jax.cli import supervisor, xla_flags
from feynrl_jax.sharding import multihost

TWO = {"FEYNRL_COORDINATOR_ADDRESS": "127.0.0.1:2000", "FEYNRL_NUM_PROCESSES": "2", "FEYNRL_PROCESS_ID": "1"}


def test_launch_variables_cover_every_multiprocess_environment():
    names = set(supervisor.LAUNCH_VARIABLES)
    assert {multihost.EXPLICIT_VARIABLES["num_processes"][0], multihost.EXPLICIT_VARIABLES["num_processes"][1]} <= names
    assert "SLURM_NTASKS" in names and set(multihost.TPU_MARKERS) <= names


@pytest.mark.parametrize(
    ("argv", "env", "watched"),
    [
        (["feynrl-jax", "train"], TWO, True),
        (
            ["feynrl-jax", "eval"],
            {"SLURM_PROCID": "0", "SLURM_NTASKS": "4", "SLURM_JOB_NODELIST": "n1", "SLURM_JOB_ID": "7"},
            True,
        ),
        (["feynrl-jax", "train"], {"TPU_WORKER_ID": "0"}, True),
        (["feynrl-jax", "train"], {}, False),  # one process
        (["feynrl-jax", "train"], {"SLURM_PROCID": "0", "SLURM_NTASKS": "1"}, False),
        (["feynrl-jax", "plot"], TWO, False),  # only train and eval join jobs
        (["feynrl-jax", "train"], {**TWO, supervisor.CHILD: "1"}, False),  # the child runs the command
        (["feynrl-jax", "train"], {"FEYNRL_NUM_PROCESSES": "2"}, False),  # half-set: the command reports it
    ],
)
def test_which_invocations_are_watched(argv, env, watched):
    assert supervisor.wanted(argv, env) is watched


def _child_says(tmp_path, monkeypatch, script: str) -> tuple[int, str]:
    """Runs `supervise` with a child that executes `script` instead of the CLI; returns (exit code, stderr)."""
    path = tmp_path / "child.py"
    path.write_text(script)
    real = supervisor.subprocess.Popen

    def popen(command, **kwargs):
        return real([sys.executable, str(path)], **kwargs)

    monkeypatch.setattr(supervisor.subprocess, "Popen", popen)
    err = tmp_path / "err"
    with open(err, "wb") as sink:
        monkeypatch.setattr(
            sys,
            "stderr",
            type(
                "E", (), {"buffer": sink, "write": lambda s, t: sink.write(t.encode()), "flush": lambda s: sink.flush()}
            )(),
        )
        code = supervisor.supervise(["feynrl-jax", "train"], TWO)
    return code, err.read_text()


SERVICE_STOP = (
    "client.h:80] Terminating process because the JAX distributed service detected fatal errors. This most "
    "likely indicates that another task died"
)
COORDINATION_STOP = r"""
import os, sys
sys.stderr.write("step 4 done\n")
sys.stderr.write("F1124 00:40:30.352601   31090 SERVICE_STOP\n")
sys.stderr.write("    @     0x7f8853b40634  absl::LogMessage::SendToLog()\n")
sys.stderr.write("Fatal Python error: Aborted\n")
sys.stderr.flush()
os.abort()
"""


def test_a_child_stopped_by_the_coordination_service_ends_in_one_line(tmp_path, monkeypatch):
    code, err = _child_says(tmp_path, monkeypatch, COORDINATION_STOP.replace("SERVICE_STOP", SERVICE_STOP))
    lines = err.strip().splitlines()
    assert code == 1
    assert lines[0] == "step 4 done"  # the child's own output passes through
    assert len(lines) == 2, err  # the stack dump and Python's thread dump are dropped
    assert lines[1].startswith("feynrl-jax: error: process 1 of 2 stopped: another process of the job died")
    assert "--resume" in lines[1]


def test_another_native_fatal_error_is_named(tmp_path, monkeypatch):
    script = COORDINATION_STOP.replace("SERVICE_STOP", "rendezvous.cc:161] Termination timeout for all-reduce exceeded")
    code, err = _child_says(tmp_path, monkeypatch, script)
    assert code == 1
    assert "stopped: JAX's runtime stopped it: Termination timeout for all-reduce exceeded." in err


UNCAUGHT = r"""
import os, sys
sys.stderr.write("step 4 done\n")
sys.stderr.write("terminate called after throwing an instance of 'gloo::IoException'\n")
sys.stderr.write("  what():  [gloo/transport/tcp/pair.cc:598] Connection closed by peer [127.0.0.1]:4242\n")
sys.stderr.write("Fatal Python error: Aborted\n")
sys.stderr.write("Thread 0x00007f (most recent call first):\n")
sys.stderr.flush()
os.abort()
"""


def test_an_uncaught_native_exception_is_named_by_its_message(tmp_path, monkeypatch):
    code, err = _child_says(tmp_path, monkeypatch, UNCAUGHT)
    lines = err.strip().splitlines()
    assert code == 1
    assert len(lines) == 2, err
    assert "JAX's runtime stopped it: [gloo/transport/tcp/pair.cc:598] Connection closed by peer" in lines[1]
    assert "--resume" in lines[1]


def test_an_abort_without_a_message_still_ends_in_one_line(tmp_path, monkeypatch):
    code, err = _child_says(tmp_path, monkeypatch, "import os; os.abort()")
    assert code == 1
    assert "stopped: JAX's runtime stopped it: the process aborted (SIGABRT)." in err
    script = "import faulthandler, os; faulthandler.enable(); print('step 1', flush=True); os.abort()"
    code, err = _child_says(tmp_path, monkeypatch, script)  # Python's thread dump is dropped
    assert code == 1
    assert (
        err.strip()
        .splitlines()[-1]
        .endswith(
            "stopped: JAX's runtime stopped it: Fatal Python error: Aborted. Start every process again with --resume: "
            "it continues from the last checkpoint that all of them committed."
        )
    ), err
    assert "Thread 0x" not in err and "most recent call first" not in err


@pytest.mark.parametrize(
    ("script", "code"), [("import sys; sys.exit(2)", 2), ("import os; os.kill(os.getpid(), 9)", 137), ("pass", 0)]
)
def test_other_endings_pass_through(tmp_path, monkeypatch, script, code):
    assert _child_says(tmp_path, monkeypatch, script)[0] == code


@pytest.mark.parametrize(
    ("env", "added"),
    [
        ({"XLA_FLAGS": "--xla_force_host_platform_device_count=8"}, True),
        ({"JAX_NUM_CPU_DEVICES": "4"}, True),
        ({"FEYNRL_NUM_PROCESSES": "2"}, True),
        ({"XLA_FLAGS": "--xla_force_host_platform_device_count=1"}, False),
        ({}, False),
        ({"XLA_FLAGS": f"--xla_force_host_platform_device_count=8 {xla_flags.SCHEDULER_FLAG}=true"}, False),  # kept
    ],
)
def test_the_cpu_scheduler_flag_is_set_only_where_several_cpu_devices_share_a_process(env, added):
    before = env.get("XLA_FLAGS", "")
    assert xla_flags.set_cpu_collective_flags(env) is added
    if added:
        assert env["XLA_FLAGS"] == f"{before} {xla_flags.SCHEDULER_FLAG}=false".strip()
    else:
        assert env.get("XLA_FLAGS", "") == before
