"""XLA flags a run sets for itself before JAX starts.

Several CPU devices in one process (`--xla_force_host_platform_device_count=N`, how the CPU path debugs a mesh,
and each process of a multi-process CPU job) run their collectives inside XLA:CPU's shared intra-op thread pool,
which has one thread per core. XLA's concurrency-optimised scheduler lets a participant of an all-gather or
all-reduce wait in a pool thread while the thunks of the other participants queue behind it; with fewer cores
than devices the rendezvous never completes and XLA aborts the process after 40 s (measured on the 2-core CI
machine: an fsdp-sharded train step with gradient accumulation over 8 fake devices, every run). Turning that
scheduler off keeps collectives in program order on every device, and the deadlock is gone; it changes nothing
on GPU or TPU, or for one CPU device, where it is not set.
"""

from __future__ import annotations

import re
from collections.abc import MutableMapping

from feynrl_jax.config.validation import PROCESS_COUNT_VARIABLES

SCHEDULER_FLAG = "--xla_cpu_enable_concurrency_optimized_scheduler"
_FORCED_DEVICES = re.compile(r"(?:^|\s)--?xla_force_host_platform_device_count=(\d+)")


def several_cpu_devices(environ: MutableMapping[str, str]) -> bool:
    """Whether this process will hold more than one CPU device, or belongs to a multi-process job."""
    forced = _FORCED_DEVICES.findall(environ.get("XLA_FLAGS", ""))
    if forced and int(forced[-1]) > 1:
        return True
    count = environ.get("JAX_NUM_CPU_DEVICES", "").strip()
    if count.isdigit() and int(count) > 1:
        return True
    return any(environ.get(name, "").strip() not in ("", "1") for name in PROCESS_COUNT_VARIABLES)


def set_cpu_collective_flags(environ: MutableMapping[str, str]) -> bool:
    """Turns XLA:CPU's concurrency-optimised scheduler off in `environ["XLA_FLAGS"]` where several CPU devices
    share one process; a value the user set for that flag is kept. Call it before JAX is imported.

    Returns:
        Whether the flag was added.
    """
    flags = environ.get("XLA_FLAGS", "")
    if SCHEDULER_FLAG in flags or not several_cpu_devices(environ):
        return False
    environ["XLA_FLAGS"] = f"{flags} {SCHEDULER_FLAG}=false".strip()
    return True
