"""Where feynrl-jax keeps what it can rebuild: converted checkpoints and JAX's compiled programs (stdlib only).

JAX's persistent compilation cache (`JAX_COMPILATION_CACHE_DIR`) stores every program that took at least a second to
compile (`jax_persistent_cache_min_compile_time_secs`), keyed by the program, the JAX and XLA versions, the flags and
the devices, so a run that compiles what an earlier run compiled loads it instead. The CLI points it at
`<cache root>/jax_compile_cache` (`set_compile_cache_dir`) before JAX starts; its children and a local Ray cluster's
workers inherit the variable. Measured on the 2-core development machine by `benchmarks/bench_compile_cache.py`
(the demo for 2 steps, twice, with one cache folder): 87.1 s with an empty cache against 62.7 s with the one its
first run left (1.39x); the evaluation before training 28.1 -> 14.8 s, the first rollout 22.1 -> 9.9 s, the first
update 16.5 -> 10.1 s.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, MutableMapping

COMPILE_CACHE_VARIABLE = "JAX_COMPILATION_CACHE_DIR"
MAX_SIZE_VARIABLE = "JAX_COMPILATION_CACHE_MAX_SIZE"
DEFAULT_MAX_BYTES = 2 * 2**30
"""The default folder's size bound: JAX evicts the least recently used programs beyond it (its own default: none)."""


def default_cache_root(environ: Mapping[str, str] | None = None) -> str:
    """`$FEYNRL_JAX_CACHE`, else `$XDG_CACHE_HOME/feynrl_jax`, else `~/.cache/feynrl_jax`.

    Args:
        environ: the environment to read (default: this process's).
    """
    environ = os.environ if environ is None else environ
    if environ.get("FEYNRL_JAX_CACHE"):
        return environ["FEYNRL_JAX_CACHE"]
    base = environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "feynrl_jax")


def set_compile_cache_dir(environ: MutableMapping[str, str]) -> str | None:
    """Sets `JAX_COMPILATION_CACHE_DIR` in `environ` to `<cache root>/jax_compile_cache`, bounded to
    `DEFAULT_MAX_BYTES` unless `JAX_COMPILATION_CACHE_MAX_SIZE` says otherwise, where the variable is not set already:
    a folder of the user's is left as it is, and an empty value turns the cache off (JAX would take it for a folder
    set, so `JAX_ENABLE_COMPILATION_CACHE=false` goes with it). Call it before JAX is imported.

    Args:
        environ: the environment to update (the CLI passes `os.environ`).

    Returns:
        The cache folder in use, or None where the cache is off.
    """
    if COMPILE_CACHE_VARIABLE not in environ:
        environ[COMPILE_CACHE_VARIABLE] = os.path.join(default_cache_root(environ), "jax_compile_cache")
        environ.setdefault(MAX_SIZE_VARIABLE, str(DEFAULT_MAX_BYTES))
    if not environ[COMPILE_CACHE_VARIABLE]:
        environ.setdefault("JAX_ENABLE_COMPILATION_CACHE", "false")
        return None
    return environ[COMPILE_CACHE_VARIABLE]
