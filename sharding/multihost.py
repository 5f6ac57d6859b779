"""Multi-host start-up: one ``jax.distributed.initialize`` call from whatever launched the processes.

Environments recognised, in this order:

* **Explicit variables** (processes started by Ray, by a launcher script or by hand):
  ``FEYNRL_COORDINATOR_ADDRESS`` (``host:port`` of process 0), ``FEYNRL_NUM_PROCESSES``, ``FEYNRL_PROCESS_ID``;
  JAX's own ``JAX_COORDINATOR_ADDRESS``, ``JAX_NUM_PROCESSES``, ``JAX_PROCESS_ID`` are accepted as aliases.
  All three must be set together. Optional ``FEYNRL_LOCAL_DEVICE_IDS`` (``"0,1"``) restricts the devices a
  process uses.
* **SLURM** (``srun``): ``SLURM_PROCID``, ``SLURM_NTASKS`` and the first host of ``SLURM_STEP_NODELIST`` (or
  ``SLURM_JOB_NODELIST``) with port ``FEYNRL_COORDINATOR_PORT``, or a port derived from ``SLURM_JOB_ID`` so two
  jobs sharing a node do not collide. When explicit variables are set too they must agree with SLURM's.
* **TPU pod** (``TPU_WORKER_ID``, ``TPU_WORKER_HOSTNAMES``, ``CLOUD_TPU_TASK_ID`` or
  ``MEGASCALE_COORDINATOR_ADDRESS`` present): ``jax.distributed.initialize()`` with no arguments, which asks the
  TPU metadata server.
* Otherwise a single process: nothing to initialise.

The parsing (``detect_distributed_env``) is a pure function of an environment mapping, so every rule is
unit-tested without starting processes.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Mapping

import jax

EXPLICIT_VARIABLES: dict[str, tuple[str, str]] = {
    "coordinator_address": ("FEYNRL_COORDINATOR_ADDRESS", "JAX_COORDINATOR_ADDRESS"),
    "num_processes": ("FEYNRL_NUM_PROCESSES", "JAX_NUM_PROCESSES"),
    "process_id": ("FEYNRL_PROCESS_ID", "JAX_PROCESS_ID"),
}
TPU_MARKERS: tuple[str, ...] = (
    "TPU_WORKER_ID",
    "TPU_WORKER_HOSTNAMES",
    "CLOUD_TPU_TASK_ID",
    "MEGASCALE_COORDINATOR_ADDRESS",
)
SLURM_PORT_BASE = 20000
SLURM_PORT_RANGE = 20000


class DistributedConfigError(ValueError):
    """The launch environment is contradictory or incomplete; the message names the variables."""


@dataclasses.dataclass(frozen=True)
class DistributedSpec:
    """How this process joins the job.

    Attributes:
        source: ``"explicit"``, ``"slurm"``, ``"tpu"`` or ``"single"``.
        coordinator_address: ``host:port`` of process 0's coordinator, or ``None`` (TPU: auto-detected).
        num_processes: number of processes, or ``None`` (TPU: auto-detected).
        process_id: this process's id in ``[0, num_processes)``, or ``None`` (TPU: auto-detected).
        local_device_ids: devices this process uses, or ``None`` for all visible ones.
    """

    source: str
    coordinator_address: str | None = None
    num_processes: int | None = None
    process_id: int | None = None
    local_device_ids: tuple[int, ...] | None = None

    @property
    def is_multiprocess(self) -> bool:
        """Whether ``jax.distributed.initialize`` must run (TPU pods always; others when more than 1 process)."""
        return self.source == "tpu" or (self.num_processes or 1) > 1


def _parse_int(env: Mapping[str, str], name: str) -> int:
    value = env[name].strip()
    try:
        return int(value)
    except ValueError:
        raise DistributedConfigError(f"{name}={env[name]!r} is not an integer") from None


def _check_address(name: str, address: str) -> str:
    host, sep, port = address.strip().rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise DistributedConfigError(f"{name}={address!r} must be 'host:port' with a port in 1..65535")
    return address.strip()


def _explicit(env: Mapping[str, str]) -> dict[str, tuple[str, str]]:
    """Reads the explicit variables: field -> (variable name, raw value), checking FEYNRL_/JAX_ agreement."""
    found: dict[str, tuple[str, str]] = {}
    for field, names in EXPLICIT_VARIABLES.items():
        present = [(n, env[n].strip()) for n in names if env.get(n, "").strip()]
        if len(present) == 2 and present[0][1] != present[1][1]:
            (n0, v0), (n1, v1) = present
            raise DistributedConfigError(f"{n0}={v0!r} and {n1}={v1!r} disagree; set one of them")
        if present:
            found[field] = present[0]
    if found and len(found) != len(EXPLICIT_VARIABLES):
        missing = [EXPLICIT_VARIABLES[f][0] for f in EXPLICIT_VARIABLES if f not in found]
        given = [found[f][0] for f in found]
        raise DistributedConfigError(
            f"{', '.join(given)} set but {', '.join(missing)} missing: the coordinator address, process count "
            "and process id must be set together"
        )
    return found


def _check_rank(num_processes: int, process_id: int, count_name: str, id_name: str) -> None:
    if num_processes < 1:
        raise DistributedConfigError(f"{count_name}={num_processes} must be at least 1")
    if not 0 <= process_id < num_processes:
        raise DistributedConfigError(
            f"{id_name}={process_id} is outside [0, {num_processes}) given by {count_name}={num_processes}"
        )


def expand_slurm_nodelist(nodelist: str) -> list[str]:
    """Expands a SLURM host list such as ``"gpu[001-003,010],cpu7"`` into host names.

    Args:
        nodelist: the compressed list (``SLURM_STEP_NODELIST``); ranges keep their zero padding, several
            bracket groups in one name (``"r[1-2]n[01-02]"``) expand as a product.

    Returns:
        The host names in order.

    Raises:
        DistributedConfigError: on unbalanced brackets or a malformed range.
    """
    hosts: list[str] = []
    for item in _split_top_level(nodelist):
        hosts.extend(_expand_host_pattern(item, nodelist))
    if not hosts:
        raise DistributedConfigError(f"SLURM node list {nodelist!r} names no host")
    return hosts


def _split_top_level(text: str) -> list[str]:
    items, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise DistributedConfigError(f"SLURM node list {text!r} has an unmatched ']'")
        elif ch == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    if depth:
        raise DistributedConfigError(f"SLURM node list {text!r} has an unmatched '['")
    items.append(text[start:])
    return [item.strip() for item in items if item.strip()]


def _expand_host_pattern(pattern: str, whole: str) -> list[str]:
    open_at = pattern.find("[")
    if open_at < 0:
        return [pattern]
    close_at = pattern.index("]", open_at)
    prefix, body, rest = pattern[:open_at], pattern[open_at + 1 : close_at], pattern[close_at + 1 :]
    values: list[str] = []
    for part in body.split(","):
        match = re.fullmatch(r"\s*(\d+)\s*(?:-\s*(\d+)\s*)?", part)
        if not match:
            raise DistributedConfigError(f"SLURM node list {whole!r}: cannot read range {part!r}")
        first, last = match.group(1), match.group(2) or match.group(1)
        if int(last) < int(first):
            raise DistributedConfigError(f"SLURM node list {whole!r}: range {part!r} runs backwards")
        values.extend(str(n).zfill(len(first)) for n in range(int(first), int(last) + 1))
    return [prefix + value + tail for value in values for tail in _expand_host_pattern(rest, whole)]


def _slurm(env: Mapping[str, str]) -> DistributedSpec | None:
    has_id, has_count = "SLURM_PROCID" in env, "SLURM_NTASKS" in env
    if not has_id and not has_count:
        return None
    if has_id != has_count:
        missing = "SLURM_NTASKS" if has_id else "SLURM_PROCID"
        raise DistributedConfigError(f"SLURM environment incomplete: {missing} is missing (launch with srun)")
    num_processes = _parse_int(env, "SLURM_NTASKS")
    process_id = _parse_int(env, "SLURM_PROCID")
    _check_rank(num_processes, process_id, "SLURM_NTASKS", "SLURM_PROCID")
    address = None
    if num_processes > 1:
        nodelist_var = next((n for n in ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST") if env.get(n)), None)
        if nodelist_var is None:
            raise DistributedConfigError(
                "SLURM_NTASKS > 1 but neither SLURM_STEP_NODELIST nor SLURM_JOB_NODELIST is set; cannot find the "
                "coordinator host"
            )
        host = expand_slurm_nodelist(env[nodelist_var])[0]
        if env.get("FEYNRL_COORDINATOR_PORT"):
            port = _parse_int(env, "FEYNRL_COORDINATOR_PORT")
        elif env.get("SLURM_JOB_ID"):
            port = SLURM_PORT_BASE + _parse_int(env, "SLURM_JOB_ID") % SLURM_PORT_RANGE
        else:
            raise DistributedConfigError("SLURM_JOB_ID is missing: set FEYNRL_COORDINATOR_PORT to choose a port")
        address = _check_address("FEYNRL_COORDINATOR_PORT", f"{host}:{port}")
    return DistributedSpec("slurm", address, num_processes, process_id)


def _local_device_ids(env: Mapping[str, str]) -> tuple[int, ...] | None:
    for name in ("FEYNRL_LOCAL_DEVICE_IDS", "JAX_LOCAL_DEVICE_IDS"):
        raw = env.get(name, "").strip()
        if raw:
            try:
                return tuple(int(x) for x in raw.split(","))
            except ValueError:
                raise DistributedConfigError(f"{name}={raw!r} must be comma-separated integers") from None
    return None


def detect_distributed_env(env: Mapping[str, str]) -> DistributedSpec:
    """Works out how this process joins the job from its environment (a pure function).

    Args:
        env: the environment, e.g. ``os.environ``.

    Returns:
        The ``DistributedSpec``.

    Raises:
        DistributedConfigError: when variables are half-set, malformed or contradict each other: the explicit
            triple incomplete, a FEYNRL_ and a JAX_ variable with different values, a process id outside
            ``[0, count)``, or explicit variables disagreeing with SLURM's.
    """
    explicit = _explicit(env)
    slurm = _slurm(env)
    devices = _local_device_ids(env)
    if explicit:
        (addr_name, address) = explicit["coordinator_address"]
        (count_name, _), (id_name, _) = explicit["num_processes"], explicit["process_id"]
        num_processes, process_id = _parse_int(env, count_name), _parse_int(env, id_name)
        _check_rank(num_processes, process_id, count_name, id_name)
        address = _check_address(addr_name, address)
        if slurm is not None:
            if slurm.num_processes != num_processes:
                raise DistributedConfigError(
                    f"{count_name}={num_processes} contradicts SLURM_NTASKS={slurm.num_processes}"
                )
            if slurm.process_id != process_id:
                raise DistributedConfigError(f"{id_name}={process_id} contradicts SLURM_PROCID={slurm.process_id}")
        return DistributedSpec("explicit", address, num_processes, process_id, devices)
    if slurm is not None:
        return dataclasses.replace(slurm, local_device_ids=devices)
    if any(env.get(name) for name in TPU_MARKERS):
        return DistributedSpec("tpu", local_device_ids=devices)
    return DistributedSpec("single", num_processes=1, process_id=0, local_device_ids=devices)


def initialize_distributed(
    env: Mapping[str, str] | None = None, *, initialization_timeout: int = 300, heartbeat_timeout: int = 100
) -> DistributedSpec:
    """Calls ``jax.distributed.initialize`` as the environment says; call it before any other JAX work.

    Args:
        env: the environment (``os.environ`` by default).
        initialization_timeout: seconds to wait for every process to join.
        heartbeat_timeout: seconds without a heartbeat after which a process counts as dead; JAX's coordination
            service then stops every other process of the job (a fatal error, not a hang).

    Returns:
        The ``DistributedSpec`` used. A single process, or a second call in an initialised process, does nothing.

    Raises:
        DistributedConfigError: see ``detect_distributed_env``.
    """
    spec = detect_distributed_env(os.environ if env is None else env)
    if not spec.is_multiprocess or jax.distributed.is_initialized():
        return spec
    if spec.source == "tpu":
        jax.distributed.initialize(
            local_device_ids=spec.local_device_ids,
            initialization_timeout=initialization_timeout,
            heartbeat_timeout_seconds=heartbeat_timeout,
        )
    else:
        jax.distributed.initialize(
            coordinator_address=spec.coordinator_address,
            num_processes=spec.num_processes,
            process_id=spec.process_id,
            local_device_ids=spec.local_device_ids,
            initialization_timeout=initialization_timeout,
            heartbeat_timeout_seconds=heartbeat_timeout,
        )
    return spec
