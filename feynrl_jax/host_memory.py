"""Transparent huge pages for the host allocator: a process-level setting that makes CPU training faster.

XLA:CPU and PyTorch allocate their large temporary buffers with `malloc`, which serves them with fresh `mmap`
regions; every first touch of a 4 KiB page is a page fault. A forward+backward pass of SmolLM2-135M on a batch
of 8 x 256 tokens touches about 5.8 GB of fresh pages per step this way (1.4 million minor faults), about 15% of
its time on a 2-core machine. glibc (2.35 and later) can ask the kernel for 2 MiB transparent huge pages on
those regions (`GLIBC_TUNABLES=glibc.malloc.hugetlb=1`, which only `madvise`s, so it is harmless where huge
pages are off), cutting the faults about 100-fold. glibc reads the tunable once, at process start, so a process
that wants it re-executes itself with the variable set (`reexec_with_huge_pages`); child processes and Ray
workers inherit it through `huge_pages_env`.

`FEYNRL_HUGE_PAGES=0` turns all of this off.
"""

from __future__ import annotations

import os
import platform
import sys

TUNABLE = "glibc.malloc.hugetlb=1"
_SWITCH = "FEYNRL_HUGE_PAGES"


def _wanted() -> bool:
    return os.environ.get(_SWITCH, "1") != "0" and sys.platform == "linux" and platform.libc_ver()[0] == "glibc"


def huge_pages_env(environ: dict[str, str] | None = None) -> dict[str, str]:
    """The environment variables that turn huge pages on for a new process (empty where they do not apply).

    Args:
        environ: the environment to extend (default: this process's).

    Returns:
        `{"GLIBC_TUNABLES": ...}` with the tunable appended to any already set, or `{}`.
    """
    environ = os.environ if environ is None else environ
    current = environ.get("GLIBC_TUNABLES", "")
    if not _wanted() or TUNABLE in current.split(":"):
        return {}
    return {"GLIBC_TUNABLES": f"{current}:{TUNABLE}" if current else TUNABLE}


def reexec_with_huge_pages() -> None:
    """Re-executes this Python process with huge pages on, once; returns at once where they are on or off.

    Call it first thing in an entry point, before any heavy import (the process image is replaced, so work done
    before the call is done twice). `sys.argv` is passed through unchanged. A process whose command line cannot
    be replayed (`python -c`, or a `sys.argv[0]` that is not a file) goes on without huge pages.
    """
    extra = huge_pages_env()
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
