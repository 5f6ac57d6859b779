"""Distributed execution: device meshes, logical-axis rules, placement, multi-host start-up and resharding.

Imports only jax, numpy and the standard library.
"""

from feynrl_jax.sharding.mesh import MESH_AXES, make_mesh, mesh_shape, resolve_mesh_shape
from feynrl_jax.sharding.multihost import (
    DistributedConfigError,
    DistributedSpec,
    detect_distributed_env,
    expand_slurm_nodelist,
    initialize_distributed,
)
from feynrl_jax.sharding.placement import (
    batch_shardings,
    host_tree,
    optimizer_state_shardings,
    place_batch,
    place_process_batch,
    place_tree,
    state_shardings_like,
    tree_bytes_per_device,
)
from feynrl_jax.sharding.reshard import reshard, reshard_to_mesh
from feynrl_jax.sharding.rules import (
    BATCH_AXES,
    RULES,
    batch_pspec,
    batch_sharding,
    batch_size_multiple,
    get_rules,
    logical_to_pspec,
    param_shardings,
    replicated,
)

__all__ = [
    "BATCH_AXES",
    "MESH_AXES",
    "RULES",
    "DistributedConfigError",
    "DistributedSpec",
    "batch_pspec",
    "batch_sharding",
    "batch_shardings",
    "batch_size_multiple",
    "detect_distributed_env",
    "expand_slurm_nodelist",
    "get_rules",
    "host_tree",
    "initialize_distributed",
    "logical_to_pspec",
    "make_mesh",
    "mesh_shape",
    "optimizer_state_shardings",
    "param_shardings",
    "place_batch",
    "place_process_batch",
    "place_tree",
    "replicated",
    "reshard",
    "reshard_to_mesh",
    "resolve_mesh_shape",
    "state_shardings_like",
    "tree_bytes_per_device",
]
