"""Placing params, optimizer state and batches on a mesh, on one process or many.

Three ways data reaches devices, one function each:

* ``place_tree``: a pytree (params, a train state) that every process holds in full, or that already lives on
  devices; each process materialises only the shards its devices own.
* ``place_batch``: a global batch that every process holds in full (tests, small runs).
* ``place_process_batch``: each process holds only its own rows (a real multi-host data pipeline); the global
  batch is their concatenation in process order.

``host_tree`` goes the other way: global arrays back to whole host arrays on every process.

The optimizer state's shardings come from the params' shardings by tree structure: optax states hold copies of
the params pytree (Adam's ``mu`` and ``nu``); every subtree with the params' structure gets the params'
shardings, every other leaf (step counts, flags) is replicated.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding

from feynrl_jax.sharding.rules import batch_pspec, batch_size_multiple, replicated


def state_shardings_like(state_shape: Any, params_shape: Any, params_shardings: Any, mesh: Mesh) -> Any:
    """Shardings for a pytree (e.g. an optax state) that contains copies of the params pytree.

    Args:
        state_shape: the state (arrays or ``jax.ShapeDtypeStruct``, e.g. from ``jax.eval_shape``).
        params_shape: the params pytree (only its structure is used).
        params_shardings: the params' shardings, same structure as ``params_shape``.
        mesh: the mesh for the replicated leaves.

    Returns:
        A pytree with ``state_shape``'s structure: the params' shardings on every params-shaped subtree, a
        replicated sharding on every other leaf.
    """
    params_def = jax.tree.structure(params_shape)
    params_leaves = jax.tree.leaves(params_shape)
    if params_def.num_leaves <= 1:
        raise ValueError("state_shardings_like needs a params pytree with at least two leaves to match by structure")
    rep = replicated(mesh)

    def is_params_like(node: Any) -> bool:
        if jax.tree.structure(node) != params_def:
            return False
        return all(tuple(a.shape) == tuple(b.shape) for a, b in zip(jax.tree.leaves(node), params_leaves, strict=True))

    return jax.tree.map(
        lambda node: params_shardings if is_params_like(node) else rep, state_shape, is_leaf=is_params_like
    )


def optimizer_state_shardings(init_fn: Callable[[Any], Any], params: Any, params_shardings: Any, mesh: Mesh) -> Any:
    """Shardings of ``init_fn(params)`` (e.g. ``optimizer.init``) derived from the params' shardings.

    Args:
        init_fn: the optimizer's ``init``.
        params: params or their ``jax.ShapeDtypeStruct``s.
        params_shardings: the params' shardings.
        mesh: the mesh.

    Returns:
        A pytree of ``NamedSharding`` with the optimizer state's structure.
    """
    state_shape = jax.eval_shape(init_fn, params)
    return state_shardings_like(state_shape, params, params_shardings, mesh)


def _place_leaf(leaf: Any, sharding: NamedSharding) -> jax.Array:
    if isinstance(leaf, jax.Array) and (jax.process_count() == 1 or not leaf.is_fully_addressable):
        return jax.device_put(leaf, sharding)
    host = np.asarray(leaf)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def place_tree(tree: Any, shardings: Any) -> Any:
    """Puts every leaf of ``tree`` at its sharding.

    Args:
        tree: a pytree of host arrays (numpy, identical on every process) or ``jax.Array``s.
        shardings: a pytree of ``NamedSharding`` with the same structure.

    Returns:
        The pytree of global ``jax.Array``s. Device arrays move device to device (a reshard); host arrays are
        sliced on the host so a process never copies shards it does not own.
    """
    return jax.tree.map(_place_leaf, tree, shardings)


def _check_batch_rows(batch: Any, multiple: int, what: str) -> None:
    for path, leaf in jax.tree_util.tree_leaves_with_path(batch):
        rows = np.shape(leaf)[0] if np.ndim(leaf) else None
        if rows is None:
            raise ValueError(f"batch field {jax.tree_util.keystr(path)} is a scalar; batch fields need a row axis")
        if rows % multiple:
            raise ValueError(
                f"batch field {jax.tree_util.keystr(path)} has {rows} {what}, not a multiple of {multiple} "
                f"(the number of batch shards on this mesh)"
            )


def batch_shardings(batch: Any, mesh: Mesh) -> Any:
    """The ``NamedSharding`` of every field of ``batch``: rows over ``("data", "fsdp")``."""
    return jax.tree.map(lambda leaf: NamedSharding(mesh, batch_pspec(np.ndim(leaf))), batch)


def place_batch(batch: Any, mesh: Mesh) -> Any:
    """Places a global batch that every process holds in full.

    Args:
        batch: a pytree (e.g. ``TrainBatch``) of ``[B, ...]`` arrays; ``None`` fields stay ``None``.
        mesh: the mesh; ``B`` must be a multiple of ``data * fsdp``.

    Returns:
        The same pytree of global arrays, rows split over ``("data", "fsdp")``.
    """
    _check_batch_rows(batch, batch_size_multiple(mesh), "rows")
    return place_tree(batch, batch_shardings(batch, mesh))


def place_process_batch(batch: Any, mesh: Mesh) -> Any:
    """Places a batch of which each process holds only its own rows.

    Args:
        batch: a pytree of ``[B_local, ...]`` host arrays, this process's rows.
        mesh: the mesh; the global batch has ``B_local * process_count`` rows.

    Returns:
        The global arrays, assembled without any process seeing the others' rows.
    """
    local_multiple = max(1, batch_size_multiple(mesh) // jax.process_count())
    _check_batch_rows(batch, local_multiple, "local rows")
    return jax.tree.map(
        lambda leaf, s: jax.make_array_from_process_local_data(s, np.asarray(leaf)),
        batch,
        batch_shardings(batch, mesh),
    )


def host_tree(tree: Any) -> Any:
    """Every leaf of ``tree`` as a whole host NumPy array, on every process.

    A leaf spread over several processes' devices is gathered from all of them (``process_allgather``, a
    collective: in a multi-process job every process must make the same call); any other leaf is read from this
    process's devices.
    """

    def leaf(x: Any) -> np.ndarray:
        if isinstance(x, jax.Array) and not x.is_fully_addressable and not x.is_fully_replicated:
            return np.asarray(multihost_utils.process_allgather(x, tiled=True))
        return np.asarray(x)

    return jax.tree.map(leaf, tree)


def tree_bytes_per_device(tree: Any) -> dict[jax.Device, int]:
    """Bytes that the leaves of ``tree`` occupy on each addressable device (shards counted where they live)."""
    usage: dict[jax.Device, int] = {}
    for leaf in jax.tree.leaves(tree):
        for shard in leaf.addressable_shards:
            usage[shard.device] = usage.get(shard.device, 0) + shard.data.nbytes
    return usage
