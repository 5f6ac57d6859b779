"""Starting Ray: a local instance sized to this machine, or a connection to an existing cluster.

Local start (`ray.address` unset): `ray.init` with the machine's CPUs (or `ray.num_cpus`), no dashboard, every
Ray process (GCS, raylet, workers, actors) listening on 127.0.0.1 only, and therefore token authentication off
(`RAY_AUTH_MODE=disabled`, so nothing is written to `~/.ray`): nothing of a local run is reachable from another
machine. A remote cluster (`ray.address` set) keeps the environment's authentication: start it with
`RAY_AUTH_MODE=token` and give the driver the same `RAY_AUTH_TOKEN`. Actors ask for
fractional CPUs (`ACTOR_CPUS`) so the trainer, the rollout workers, the reward scorer and the parameter store
all fit on a 2-CPU laptop; they share the cores in time unless `train.cpu_cores` / `rollout.cpu_cores` pin the
trainer and the rollout workers to cores of their own (`pin_cpu_cores`), which lets async RL overlap them.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Sequence

import psutil
import ray
from ml_collections import ConfigDict

from feynrl_jax import host_memory

log = logging.getLogger(__name__)

ACTOR_CPUS = {"trainer": 0.5, "rollout": 0.25, "reward": 0.1, "store": 0.05}
"""Logical CPUs each actor reserves (scheduling only; JAX and the reward pool use what the OS gives them)."""

LOCAL_START_ATTEMPTS = 2
"""How many times `start_ray` tries to start a local instance. Ray gives a new raylet a fixed 30 s to register with
the GCS (`ray/_private/node.py`) and raises `START_TIMEOUT_MESSAGE` when it does not; an overloaded machine missed
that once in CI (the same test passed alone). The attempt's processes are stopped before the next one."""

START_TIMEOUT_MESSAGE = "The current node timed out during startup"

DRIVER_OMP_THREADS = "FEYNRL_DRIVER_OMP_NUM_THREADS"
"""Carries the driver's `OMP_NUM_THREADS` ("" when unset) to the actors (`openmp_threads_from_cores`)."""


def start_ray(ray_cfg: ConfigDict) -> bool:
    """Starts or connects to Ray as `config.ray` says; a no-op when this process is already connected.

    Args:
        ray_cfg: the `config.ray` section (`address`, `num_cpus`, `log_to_driver`).

    Returns:
        True when this call started (or connected) Ray and the caller should `ray.shutdown()` at the end.
    """
    if ray.is_initialized():
        return False
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ[DRIVER_OMP_THREADS] = os.environ.get("OMP_NUM_THREADS", "")
    if ray_cfg.address:
        log.info("connecting to the Ray cluster at %s", ray_cfg.address)
        # The cluster's workers do not inherit this process's environment: ask for the allocator tunables explicitly
        # (retention only where FEYNRL_RETAIN_MEMORY=1 asks for it: their machines' CPU counts are unknown here).
        env_vars = host_memory.allocator_env({}, other_machine=True) | {
            DRIVER_OMP_THREADS: os.environ[DRIVER_OMP_THREADS]
        }
        ray.init(address=ray_cfg.address, log_to_driver=ray_cfg.log_to_driver, runtime_env={"env_vars": env_vars})
        return True
    num_cpus = ray_cfg.num_cpus or os.cpu_count() or 1
    listen_on_loopback_only()
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    # Ray's memory monitor kills actors when the *machine* is nearly full, whoever uses the memory; on a shared
    # workstation that kills a healthy run. Locally it is off unless the environment turns it on.
    os.environ.setdefault("RAY_memory_monitor_refresh_ms", "0")
    # Ray lowers its workers' priority (nice 15) by default; here the actors *are* the workload.
    os.environ.setdefault("RAY_worker_niceness", "0")
    # Ray also marks its workers as the kernel OOM killer's first victims (oom_score_adj 1000); on a shared
    # machine that picks the trainer whoever holds the memory. Leave the kernel's own choice.
    os.environ.setdefault("RAY_worker_oom_score_adjustment", "0")
    for attempt in range(1, LOCAL_START_ATTEMPTS + 1):
        before = {process.pid for process in psutil.Process().children(recursive=True)}
        try:
            ray.init(
                num_cpus=num_cpus,
                include_dashboard=False,
                log_to_driver=ray_cfg.log_to_driver,
                configure_logging=False,
            )
            break
        except Exception as error:
            if START_TIMEOUT_MESSAGE not in str(error) or attempt == LOCAL_START_ATTEMPTS:
                raise
            stopped = stop_processes_started_since(before)
            log.warning(
                "the local Ray instance timed out during start-up (%s); stopped the %d processes it had started and "
                "starting it again (attempt %d of %d)",
                error,
                stopped,
                attempt + 1,
                LOCAL_START_ATTEMPTS,
            )
    log.info("started a local Ray instance with %d CPUs", num_cpus)
    return True


def stop_processes_started_since(before: set[int]) -> int:
    """Stops this process's Ray descendants whose pids are not in `before` (SIGTERM, then SIGKILL after 5 s) and
    reaps them; returns how many there were.

    A `ray.init` that timed out leaves the GCS, the raylet and their helpers running: it raises from inside the
    node's constructor, so no node is registered and `ray.shutdown` knows nothing to stop.
    """
    started = []
    for process in psutil.Process().children(recursive=True):
        if process.pid in before:
            continue
        try:
            if "ray" in " ".join(process.cmdline()).lower():
                started.append(process)
        except psutil.Error:  # already gone
            continue
    for process in started:
        with contextlib.suppress(psutil.Error):
            process.terminate()
    _, alive = psutil.wait_procs(started, timeout=5)
    for process in alive:
        with contextlib.suppress(psutil.Error):
            process.kill()
    psutil.wait_procs(alive, timeout=5)
    return len(started)


def listen_on_loopback_only() -> None:
    """Makes the local Ray instance that `ray.init` starts next listen on 127.0.0.1 only.

    Ray's servers listen on the node's IP address, which on Linux is the machine's outward address unless Ray
    runs as a single-machine cluster: then the node IP is the loopback address (what Ray does by default on
    macOS and Windows) and every server, worker and actor binds to it. The environment variable reaches the
    processes Ray starts; the constant is what this process, which imported Ray already, reads.
    """
    from ray._private import ray_constants

    os.environ[ray_constants.ENABLE_RAY_CLUSTERS_ENV_VAR] = "0"
    ray_constants.ENABLE_RAY_CLUSTER = False


def stop_ray() -> None:
    """Disconnects this process from Ray (and stops the local instance it started)."""
    if ray.is_initialized():
        ray.shutdown()
    os.environ.pop(DRIVER_OMP_THREADS, None)


def openmp_threads_from_cores() -> int:
    """Gives OpenMP the cores this process may run on, as XLA's CPU thread pool has them; call it before the
    oneDNN kernel loads (`feynrl_jax.kernels.onednn`: its bfloat16 products run on OpenMP threads).

    Ray sets `OMP_NUM_THREADS` in an actor to the actor's whole logical CPUs when the environment leaves it
    unset: 1 for every fractional `ACTOR_CPUS` here. A bfloat16 trainer or rollout worker then ran its products
    on one core while XLA ran the rest on all of them (on 2 cores: a GRPO step's rollout 14.3 s where the same
    engine outside Ray took 11.4 s). The value of the driver's environment is kept where the driver started Ray
    or connected to it (`start_ray` writes it to `DRIVER_OMP_THREADS`, "" when unset). Where it did not (a Ray
    started elsewhere), only Ray's default of 1 is replaced. An actor pinned by `pin_cpu_cores` gets its pinned
    cores.

    Returns:
        The threads OpenMP will start with (the first level of a nested `OMP_NUM_THREADS` list).
    """
    driver = os.environ.get(DRIVER_OMP_THREADS)
    current = os.environ.get("OMP_NUM_THREADS", "")
    if driver:
        os.environ["OMP_NUM_THREADS"] = driver
    elif driver == "" or current in ("", "1"):
        os.environ["OMP_NUM_THREADS"] = str(len(os.sched_getaffinity(0)))
    return int(os.environ["OMP_NUM_THREADS"].split(",")[0])


def pin_cpu_cores(cores: Sequence[int]) -> None:
    """Pins this process to `cores` (no-op when empty); call it before JAX starts in the process.

    XLA sizes its CPU thread pools from the cores the process may run on when its client starts, so an actor
    pinned first computes on exactly those cores: on a CPU machine, a trainer and a rollout worker on disjoint
    cores overlap the way they would on their own accelerators (`train.cpu_cores`, `rollout.cpu_cores`).

    Raises:
        ValueError: naming the cores when this machine does not have them.
    """
    if not cores:
        return
    try:
        os.sched_setaffinity(0, set(cores))
    except OSError as error:
        raise ValueError(f"cannot pin to CPU cores {sorted(cores)}: {error}") from error
