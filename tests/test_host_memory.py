"""Huge pages for the host allocator: the environment it asks for, and the one-time re-execution."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import textwrap

import pytest

from feynrl_jax import host_memory

GLIBC = sys.platform == "linux" and platform.libc_ver()[0] == "glibc"


@pytest.mark.skipif(not GLIBC, reason="glibc tunables exist only on Linux with glibc")
def test_env_appends_the_tunable_once_and_keeps_others():
    assert host_memory.huge_pages_env({}) == {"GLIBC_TUNABLES": host_memory.TUNABLE}
    merged = host_memory.huge_pages_env({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"})
    assert merged == {"GLIBC_TUNABLES": f"glibc.malloc.arena_max=2:{host_memory.TUNABLE}"}
    assert host_memory.huge_pages_env(merged) == {}


def test_switched_off_by_the_environment_variable(monkeypatch):
    monkeypatch.setenv("FEYNRL_HUGE_PAGES", "0")
    assert host_memory.huge_pages_env({}) == {}


SCRIPT = textwrap.dedent(
    """
    import os, sys
    print("started", flush=True)
    from feynrl_jax.host_memory import reexec_with_huge_pages
    reexec_with_huge_pages()
    print("tunables", os.environ.get("GLIBC_TUNABLES"), "argv", sys.argv[1:], flush=True)
    """
)


@pytest.mark.skipif(not GLIBC, reason="glibc tunables exist only on Linux with glibc")
def test_reexec_runs_the_script_again_with_the_tunable_and_the_same_arguments(tmp_path):
    script = tmp_path / "entry.py"
    script.write_text(SCRIPT)
    env = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", "_FEYNRL_REEXECED", "FEYNRL_HUGE_PAGES")}
    out = subprocess.run(
        [sys.executable, str(script), "--flag", "x y"], env=env, capture_output=True, text=True, check=True
    ).stdout.splitlines()
    # Started twice (the first image is replaced), then ran on once with the tunable and the original argv.
    assert out == ["started", "started", f"tunables {host_memory.TUNABLE} argv ['--flag', 'x y']"]


def test_no_reexec_when_switched_off(tmp_path):
    script = tmp_path / "entry.py"
    script.write_text(SCRIPT)
    env = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", "_FEYNRL_REEXECED")}
    env["FEYNRL_HUGE_PAGES"] = "0"
    out = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.splitlines() == ["started", "tunables None argv []"]


def test_no_reexec_when_the_command_line_cannot_be_replayed():
    # `python -c` with an entry point's argv (as a test harness does): there is no file to run again, so the
    # process goes on as it is instead of exec-ing a path that does not exist.
    code = SCRIPT.replace("import os, sys", "import os, sys\nsys.argv = ['feynrl-jax', 'train']")
    env = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", "_FEYNRL_REEXECED", "FEYNRL_HUGE_PAGES")}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.splitlines() == ["started", "tunables None argv ['train']"]
