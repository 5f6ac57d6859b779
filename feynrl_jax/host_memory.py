"""Host allocator settings for CPU training: transparent huge pages and freed memory kept for reuse.

XLA:CPU and PyTorch allocate their large temporary buffers with `malloc`. Two glibc tunables decide what that
costs; glibc reads them once, at process start (`GLIBC_TUNABLES`), so a process that wants them re-executes itself
with the variable set (`reexec_with_allocator_tunables`); child processes and Ray workers get them through
`allocator_env`.

- **Huge pages** (`glibc.malloc.hugetlb=1`, `HUGE_PAGES`). Every first touch of a fresh 4 KiB page is a page
  fault: a forward+backward pass of SmolLM2-135M on a batch of 8 x 256 tokens touches about 5.8 GB of fresh pages
  per step (1.4 million minor faults), about 15% of its time on a 2-core machine. With the tunable glibc asks the
  kernel for 2 MiB transparent huge pages on those regions (it only `madvise`s, so it is harmless where huge
  pages are off), cutting the faults about 100-fold.
- **Freed memory kept** (`RETAIN`: one arena, no `mmap` for large blocks, no trimming), on machines with at most
  `RETAIN_MAX_CPUS` usable CPUs. By default glibc serves every block over 32 MiB with its own `mmap` and returns
  it to the kernel on `free`, so each training step's temporaries (one XLA allocation of GBs) are fresh pages again
  at the next step. On a virtual machine whose host backs guest memory lazily and takes freed memory back (free
  page reporting), touching such pages again runs about 14x slower than touching pages the process still holds,
  and on the 2-core development machine an RL update that followed an 8-second held-out evaluation spent about
  2 s of its 7 in the kernel. With every allocation from one `brk` heap that is never trimmed, a process reuses
  the pages it has touched. Measured on the 2-core machine
  (`benchmarks/bench_allocator.py`, both settings side by side): a 2 GB array filled again after a 3 s pause at
  8.4 GB/s against 0.6; our GRPO step at 64 new tokens 1.21x faster and its update 1.35x, the first step 4% slower,
  the peak PSS 2% higher (the heap keeps its high-water mark and some fragmentation).
  One arena serializes `malloc` across threads: on a 16-core Xeon (the lent GPU host's CPU,
  `bench_allocator.py --skip-grpo --fwd-bwd`) the same tunables made our bfloat16 forward+backward 1.27x slower
  and PyTorch's 2.14x slower, hence the CPU bound.

`FEYNRL_HUGE_PAGES=0` leaves out the huge pages; `FEYNRL_RETAIN_MEMORY=0` leaves out the retention and `=1` asks for
it whatever the CPU count. A tunable already set in `GLIBC_TUNABLES` (by its name, whatever its value) is left as
the user set it.
"""

from __future__ import annotations

import os
import platform
import resource
import sys

HUGE_PAGES = ("glibc.malloc.hugetlb=1",)
RETAIN = (
    # One arena: XLA allocates its buffers on its own threads, whose arenas (64 MiB heaps) `mmap` any larger
    # block whatever `mmap_max` says; the main arena's `brk` heap has no such limit.
    "glibc.malloc.arena_max=1",
    "glibc.malloc.mmap_max=0",  # no block gets its own mapping (and so none is unmapped on `free`)
    "glibc.malloc.trim_threshold=68719476736",  # 64 GiB: the top of the heap is never given back
)
RETAIN_MAX_CPUS = 2
"""Retention is on by default up to this many usable CPUs: measured faster with 2, slower with 16 (module doc)."""


def usable_cpus() -> int:
    """The CPUs this process may run on: its affinity mask, capped by a cgroup v2 CPU quota (`cpu.max`, a container's
    `--cpus`). `os.cpu_count()` counts the host's CPUs, which in a container can be many more."""
    try:
        count = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        count = os.cpu_count() or 1
    try:
        with open("/sys/fs/cgroup/cpu.max") as f:
            quota, period = f.read().split()[:2]
        if quota != "max":
            count = min(count, max(1, int(quota) // int(period)))
    except (OSError, ValueError):
        pass
    return count


def _glibc() -> bool:
    return sys.platform == "linux" and platform.libc_ver()[0] == "glibc"


def wanted_tunables(other_machine: bool = False) -> tuple[str, ...]:
    """The tunables this process's switches and CPU count ask for (none where glibc is not the C library).

    Args:
        other_machine: for processes on other machines (a Ray cluster's workers), whose CPU count this process
            does not know: retention only where `FEYNRL_RETAIN_MEMORY=1` asks for it.

    Returns:
        `HUGE_PAGES` unless `FEYNRL_HUGE_PAGES=0`, then `RETAIN` where it applies.

    Raises:
        ValueError: `FEYNRL_RETAIN_MEMORY` is not 0, 1 or auto.
    """
    if not _glibc():
        return ()
    wanted = HUGE_PAGES if os.environ.get("FEYNRL_HUGE_PAGES", "1") != "0" else ()
    retain = os.environ.get("FEYNRL_RETAIN_MEMORY", "auto")
    if retain not in ("0", "1", "auto"):
        raise ValueError(f"FEYNRL_RETAIN_MEMORY={retain!r}: expected 0, 1 or auto (the default)")
    if retain == "1" or (retain == "auto" and not other_machine and usable_cpus() <= RETAIN_MAX_CPUS):
        wanted += RETAIN
    return wanted


def allocator_env(environ: dict[str, str] | None = None, *, other_machine: bool = False) -> dict[str, str]:
    """The environment variables that give a new process the wanted tunables (empty where none is missing).

    Args:
        environ: the environment whose `GLIBC_TUNABLES` to extend (default: this process's); this process's
            switches decide what is wanted.
        other_machine: the process runs on another machine (`wanted_tunables`).

    Returns:
        `{"GLIBC_TUNABLES": ...}` with the missing tunables appended to any already set, or `{}`.
    """
    environ = os.environ if environ is None else environ
    current = [t for t in environ.get("GLIBC_TUNABLES", "").split(":") if t]
    names = {t.split("=", 1)[0] for t in current}
    missing = [t for t in wanted_tunables(other_machine) if t.split("=", 1)[0] not in names]
    if not missing:
        return {}
    return {"GLIBC_TUNABLES": ":".join(current + missing)}


def reexec_with_allocator_tunables() -> None:
    """Re-executes this Python process with the wanted tunables, once; returns at once where none is missing.

    Call it first thing in an entry point, before any heavy import (the process image is replaced, so work done
    before the call is done twice). `sys.argv` is passed through unchanged. A process whose command line cannot
    be replayed (`python -c`, or a `sys.argv[0]` that is not a file) goes on as it is.
    """
    extra = allocator_env()
    if not extra or os.environ.get("_FEYNRL_REEXECED") == "1":
        return
    env = {**os.environ, **extra, "_FEYNRL_REEXECED": "1"}
    sys.stdout.flush()
    sys.stderr.flush()
    # `-m` entry points keep their module form; console scripts and script paths are re-run as given.
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    argv = [sys.executable]
    if spec is not None and spec.name and spec.name != "__main__":
        argv += ["-m", spec.name.removesuffix(".__main__"), *sys.argv[1:]]
    elif sys.argv and os.path.isfile(sys.argv[0]):
        argv += sys.argv
    else:
        return
    os.execve(sys.executable, argv, env)


def peak_rss_gib() -> float:
    """This process's peak resident memory so far, in GiB (`getrusage`: KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / (2**30 if sys.platform == "darwin" else 2**20)


def system_cpu_seconds() -> float:
    """The CPU time this process (all its threads) has spent in the kernel so far: on a machine whose memory is
    backed lazily, mostly page faults of memory it had not touched before."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_stime
