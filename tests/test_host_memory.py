"""The host allocator's tunables: the environment they ask for, the one-time re-execution, and what retention does."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import textwrap

import pytest

from feynrl_jax import host_memory

GLIBC = sys.platform == "linux" and platform.libc_ver()[0] == "glibc"


ALL = ":".join(host_memory.HUGE_PAGES + host_memory.RETAIN)
CLEAN = ("GLIBC_TUNABLES", "_FEYNRL_REEXECED", "FEYNRL_HUGE_PAGES", "FEYNRL_RETAIN_MEMORY")


def clean_env(**extra: str) -> dict[str, str]:
    """This environment without the tunables and switches, retention asked for whatever the CPU count."""
    return {**{k: v for k, v in os.environ.items() if k not in CLEAN}, "FEYNRL_RETAIN_MEMORY": "1", **extra}


@pytest.fixture(autouse=True)
def retention_on(monkeypatch):
    monkeypatch.delenv("FEYNRL_HUGE_PAGES", raising=False)
    monkeypatch.setenv("FEYNRL_RETAIN_MEMORY", "1")


@pytest.mark.skipif(not GLIBC, reason="glibc tunables exist only on Linux with glibc")
def test_env_appends_the_missing_tunables_once_and_keeps_the_users():
    assert host_memory.allocator_env({}) == {"GLIBC_TUNABLES": ALL}
    # A tunable the user set keeps the user's value: arena_max=2 stays, the others are appended.
    merged = host_memory.allocator_env({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2:glibc.cpu.x86_shstk=off"})
    rest = [t for t in host_memory.HUGE_PAGES + host_memory.RETAIN if not t.startswith("glibc.malloc.arena_max=")]
    assert merged == {"GLIBC_TUNABLES": ":".join(["glibc.malloc.arena_max=2", "glibc.cpu.x86_shstk=off", *rest])}
    assert host_memory.allocator_env(merged) == {}


@pytest.mark.skipif(not GLIBC, reason="glibc tunables exist only on Linux with glibc")
def test_each_group_is_switched_off_by_its_environment_variable(monkeypatch):
    monkeypatch.setenv("FEYNRL_HUGE_PAGES", "0")
    assert host_memory.allocator_env({}) == {"GLIBC_TUNABLES": ":".join(host_memory.RETAIN)}
    monkeypatch.setenv("FEYNRL_HUGE_PAGES", "1")
    monkeypatch.setenv("FEYNRL_RETAIN_MEMORY", "0")
    assert host_memory.allocator_env({}) == {"GLIBC_TUNABLES": ":".join(host_memory.HUGE_PAGES)}


@pytest.mark.skipif(not GLIBC, reason="glibc tunables exist only on Linux with glibc")
def test_retention_by_default_only_on_small_machines(monkeypatch):
    # One arena serializes malloc across threads: measured faster on 2 cores, slower on 16 (host_memory's doc).
    monkeypatch.setenv("FEYNRL_RETAIN_MEMORY", "auto")
    monkeypatch.setattr(host_memory, "usable_cpus", lambda: host_memory.RETAIN_MAX_CPUS)
    assert host_memory.wanted_tunables() == host_memory.HUGE_PAGES + host_memory.RETAIN
    monkeypatch.setattr(host_memory, "usable_cpus", lambda: 16)
    assert host_memory.wanted_tunables() == host_memory.HUGE_PAGES
    monkeypatch.delenv("FEYNRL_RETAIN_MEMORY")
    assert host_memory.wanted_tunables() == host_memory.HUGE_PAGES
    monkeypatch.setenv("FEYNRL_RETAIN_MEMORY", "1")
    assert host_memory.wanted_tunables() == host_memory.HUGE_PAGES + host_memory.RETAIN
    # A Ray cluster's workers run on machines whose CPU count the driver does not know: only an explicit 1.
    assert host_memory.wanted_tunables(other_machine=True) == host_memory.HUGE_PAGES + host_memory.RETAIN
    monkeypatch.setenv("FEYNRL_RETAIN_MEMORY", "auto")
    monkeypatch.setattr(host_memory, "usable_cpus", lambda: 1)
    assert host_memory.wanted_tunables(other_machine=True) == host_memory.HUGE_PAGES


@pytest.mark.skipif(not GLIBC, reason="glibc tunables exist only on Linux with glibc")
def test_a_misspelt_retention_switch_is_refused_by_name(monkeypatch):
    monkeypatch.setenv("FEYNRL_RETAIN_MEMORY", "yes")
    with pytest.raises(ValueError, match="FEYNRL_RETAIN_MEMORY='yes'"):
        host_memory.allocator_env({})


def test_switched_off_by_the_environment_variables(monkeypatch):
    monkeypatch.setenv("FEYNRL_HUGE_PAGES", "0")
    monkeypatch.setenv("FEYNRL_RETAIN_MEMORY", "0")
    assert host_memory.allocator_env({}) == {}
    assert host_memory.allocator_env() == {}


SCRIPT = textwrap.dedent(
    """
    import os, sys
    print("started", flush=True)
    from feynrl_jax.host_memory import reexec_with_allocator_tunables
    reexec_with_allocator_tunables()
    print("tunables", os.environ.get("GLIBC_TUNABLES"), "argv", sys.argv[1:], flush=True)
    """
)


@pytest.mark.skipif(not GLIBC, reason="glibc tunables exist only on Linux with glibc")
def test_reexec_runs_the_script_again_with_the_tunable_and_the_same_arguments(tmp_path):
    script = tmp_path / "entry.py"
    script.write_text(SCRIPT)
    out = subprocess.run(
        [sys.executable, str(script), "--flag", "x y"], env=clean_env(), capture_output=True, text=True, check=True
    ).stdout.splitlines()
    # Started twice (the first image is replaced), then ran on once with the tunables and the original argv.
    assert out == ["started", "started", f"tunables {ALL} argv ['--flag', 'x y']"]


def test_no_reexec_when_switched_off(tmp_path):
    script = tmp_path / "entry.py"
    script.write_text(SCRIPT)
    env = clean_env(FEYNRL_HUGE_PAGES="0", FEYNRL_RETAIN_MEMORY="0")
    out = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.splitlines() == ["started", "tunables None argv []"]


def test_no_reexec_when_the_command_line_cannot_be_replayed():
    # `python -c` with an entry point's argv (as a test harness does): there is no file to run again, so the
    # process goes on as it is instead of exec-ing a path that does not exist.
    code = SCRIPT.replace("import os, sys", "import os, sys\nsys.argv = ['feynrl-jax', 'train']")
    out = subprocess.run([sys.executable, "-c", code], env=clean_env(), capture_output=True, text=True, check=True)
    assert out.stdout.splitlines() == ["started", "tunables None argv ['train']"]


# A 512 MiB block allocated and written on a thread that is not the main one (XLA allocates on its own threads), then
# freed: the process's resident memory right after, above what it was before, in MiB.
FREED = textwrap.dedent(
    """
    import threading
    import numpy as np

    def resident_mib():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096 / 2**20

    before = resident_mib()
    def work():
        block = np.ones(512 * 2**20 // 8)
        del block
    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    print(round(resident_mib() - before))
    """
)


@pytest.mark.skipif(not GLIBC, reason="glibc tunables exist only on Linux with glibc")
def test_retention_keeps_a_freed_block_resident_and_the_default_returns_it(monkeypatch):
    def kept_mib(**switches: str) -> int:
        env = clean_env(**switches)
        for switch in ("FEYNRL_HUGE_PAGES", "FEYNRL_RETAIN_MEMORY"):
            monkeypatch.setenv(switch, switches.get(switch, "1"))
        env.update(host_memory.allocator_env(env))
        done = subprocess.run([sys.executable, "-c", FREED], env=env, capture_output=True, text=True, check=True)
        return int(done.stdout.strip())

    # With the tunables the freed pages stay in the heap for the next allocation; without them glibc unmaps the
    # block on `free`. 512 MiB against a few MiB of interpreter noise either way.
    assert kept_mib(FEYNRL_HUGE_PAGES="0") >= 500
    assert kept_mib(FEYNRL_HUGE_PAGES="0", FEYNRL_RETAIN_MEMORY="0") < 64


@pytest.mark.skipif(sys.platform != "linux", reason="reads the kernel's high-water mark in /proc/self/status")
def test_peak_rss_is_the_kernels_high_water_mark():
    """`peak_rss_gib` (the RL trainer's `perf/train_peak_rss_gib`) against VmHWM, read before and after it, after
    touching 256 MiB more than this process held."""

    def high_water_kib() -> int:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))

    block = bytearray(256 << 20)  # zero-filled: every page touched
    before = high_water_kib()
    peak = host_memory.peak_rss_gib()
    after = high_water_kib()
    del block
    # The kernel keeps a process's resident-page count in per-thread or per-CPU parts that it folds together lazily,
    # so two reads can disagree by a few MiB; 16 MiB of slack covers it, far below the 256 MiB block.
    slack = 16 / 1024
    assert before / 2**20 - slack <= peak <= after / 2**20 + slack
    assert peak >= 0.25
