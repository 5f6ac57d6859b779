"""Moving a params pytree from one mesh to another (the trainer's mesh to a rollout engine's mesh).

``jax.device_put`` with a target ``NamedSharding`` performs the transfer device to device: each target shard
is assembled from the source shards that overlap it, with no round trip through the host. The source and
target meshes may use different devices, shapes and rules; on several processes, each target device must be
addressable by the process that holds it, as for any ``device_put``.
"""

from __future__ import annotations

from typing import Any

import jax
from jax.sharding import Mesh

from feynrl_jax.sharding.rules import MeshAxes, Rules, param_shardings


def reshard(tree: Any, target_shardings: Any, *, donate: bool = False) -> Any:
    """Returns ``tree`` laid out at ``target_shardings``.

    Args:
        tree: a pytree of ``jax.Array`` (e.g. the trainer's params).
        target_shardings: a pytree of ``jax.sharding.Sharding`` with ``tree``'s structure.
        donate: release the source buffers once copied (halves the peak memory of a weight sync; the
            source arrays must not be used afterwards).

    Returns:
        A pytree of new arrays with the same values, each with its target sharding.

    Raises:
        ValueError: naming the first leaf whose shape the target sharding cannot hold.
    """
    src_def, dst_def = jax.tree.structure(tree), jax.tree.structure(target_shardings)
    if src_def != dst_def:
        raise ValueError(f"params and target shardings have different structures: {src_def} vs {dst_def}")
    for path, leaf, sharding in zip(
        (p for p, _ in jax.tree_util.tree_leaves_with_path(tree)),
        jax.tree.leaves(tree),
        jax.tree.leaves(target_shardings),
        strict=True,
    ):
        try:
            sharding.shard_shape(leaf.shape)
        except ValueError as err:
            raise ValueError(f"cannot reshard {jax.tree_util.keystr(path)} of shape {leaf.shape}: {err}") from None
    return jax.device_put(tree, target_shardings, donate=donate)


def reshard_to_mesh(
    params: Any, logical_axes_tree: Any, mesh: Mesh, rules: Rules | dict[str, MeshAxes], *, donate: bool = False
) -> Any:
    """Reshards params onto ``mesh`` by logical axes and ``rules`` (e.g. the rollout mesh's ``RULES['fsdp_tp']``).

    Args:
        params: the params pytree.
        logical_axes_tree: ``feynrl_jax.models.logical_axes(config)``.
        mesh: the target mesh.
        rules: the target rules table.
        donate: see ``reshard``.

    Returns:
        The params on ``mesh``.
    """
    return reshard(params, param_shardings(logical_axes_tree, mesh, rules, shapes=params), donate=donate)
