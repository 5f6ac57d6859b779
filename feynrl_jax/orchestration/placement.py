"""Where the RL actors run: the CPUs they reserve and the GPUs the config names (`config.ray`).

- The trainer asks for `ray.trainer_gpus` GPUs (its JAX devices: Ray sets `CUDA_VISIBLE_DEVICES` for it).
- Each rollout worker with `ray.gpus_per_rollout_worker = g > 0` gets a placement group of its own: one bundle of
  g GPUs (and its CPU share), `STRICT_PACK`, so the g GPUs are on one node; the worker is scheduled into the bundle
  with `placement_group_capture_child_tasks`, so the processes and tasks its engine starts (vLLM's tensor-parallel
  workers) share those GPUs. vLLM spans them with `tensor_parallel_size = g`.
- With 0 GPUs (the defaults, and every CPU machine) nothing changes: CPU shares only, no placement group.

Ray would leave an actor pending forever when the cluster lacks the GPUs; `check_gpus` fails first, naming the
keys, and a placement group that cannot be placed within `ray.stall_timeout_s` fails too.
"""

from __future__ import annotations

from typing import Any

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from feynrl_jax.errors import InputError
from feynrl_jax.orchestration.runtime import ACTOR_CPUS


def check_gpus(config: Any) -> None:
    """Raises `InputError` when the Ray cluster has fewer GPUs than `config.ray` asks for (names the keys)."""
    per_worker, trainer = config.ray.gpus_per_rollout_worker, config.ray.trainer_gpus
    needed = trainer * config.ray.trainer_processes + config.rollout.num_workers * per_worker
    if not needed:
        return
    available = ray.cluster_resources().get("GPU", 0)
    if needed > available:
        raise InputError(
            f"the run needs {needed:g} GPUs (ray.trainer_gpus={trainer} x ray.trainer_processes="
            f"{config.ray.trainer_processes} + rollout.num_workers="
            f"{config.rollout.num_workers} x ray.gpus_per_rollout_worker={per_worker}) but the Ray cluster has "
            f"{available:g}; lower those keys or add GPUs"
        )


def trainer_options(config: Any) -> dict[str, Any]:
    """Ray actor options of a trainer process: its CPU share and `ray.trainer_gpus` GPUs; several trainer
    processes (`ray.trainer_processes`) are spread over the nodes where Ray can."""
    options: dict[str, Any] = {"num_cpus": ACTOR_CPUS["trainer"]}
    if config.ray.trainer_gpus:
        options["num_gpus"] = config.ray.trainer_gpus
    if config.ray.trainer_processes > 1:
        options["scheduling_strategy"] = "SPREAD"
    return options


class WorkerPlacement:
    """Placement groups of the rollout workers (one per worker with GPUs); `remove()` releases them."""

    def __init__(self, config: Any):
        self.gpus = config.ray.gpus_per_rollout_worker
        self.timeout_s = config.ray.stall_timeout_s
        self.groups: list[Any] = []

    def options(self, index: int) -> dict[str, Any]:
        """Ray actor options of rollout worker `index`: its CPU share and, with GPUs, its own placement group."""
        options: dict[str, Any] = {"num_cpus": ACTOR_CPUS["rollout"]}
        if not self.gpus:
            return options
        group = placement_group(
            [{"CPU": ACTOR_CPUS["rollout"], "GPU": self.gpus}], strategy="STRICT_PACK", name=f"rollout_worker_{index}"
        )
        self.groups.append(group)
        ready, _ = ray.wait([group.ready()], timeout=self.timeout_s)
        if not ready:
            raise InputError(
                f"rollout worker {index}: no node has ray.gpus_per_rollout_worker={self.gpus} free GPUs "
                f"(waited ray.stall_timeout_s={self.timeout_s:g} s); lower it or free GPUs"
            )
        options["num_gpus"] = self.gpus
        options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
            group, placement_group_bundle_index=0, placement_group_capture_child_tasks=True
        )
        return options

    def remove(self) -> None:
        for group in self.groups:
            remove_placement_group(group)
        self.groups = []
