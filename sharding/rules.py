"""Logical-axis rules: which mesh axis splits which named dimension.

Every parameter carries a tuple of logical axis names (``feynrl_jax.models.logical_axes``, see
docs/CONTRACTS.md), for example ``("layers", "embed", "heads", "head_dim")`` for ``q_proj/kernel``. A rules
table maps each logical name to a mesh axis (or a tuple of mesh axes, or ``None`` for replicated); a parallelism
strategy is a table, not code (MaxText's ``logical_axis_rules``).

Two rules keep every table valid on every model:

* a dimension whose size does not divide evenly by its mesh axes is replicated instead (for example the 9 heads
  of SmolLM2-135M under ``tensor=2``); the program stays correct and only that tensor loses the split;
* a mesh axis is used at most once per array; a later dimension that maps to an axis already taken is
  replicated.

References:
    MaxText, ``logical_axis_rules`` (https://github.com/AI-Hypercomputer/maxtext).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

MeshAxes = str | tuple[str, ...] | None
Rules = tuple[tuple[str, MeshAxes], ...]

BATCH_AXES: tuple[str, str] = ("data", "fsdp")
"""Mesh axes that split the batch dimension ``B`` (contract: batches are sharded over ``("data", "fsdp")``)."""

_PARAMS_REPLICATED: Rules = (
    ("vocab", None),
    ("embed", None),
    ("heads", None),
    ("kv_heads", None),
    ("head_dim", None),
    ("mlp", None),
    ("layers", None),
    ("norm", None),
    ("lora_rank", None),  # the rank of LoRA adapters (a few to a few hundred): never split
    ("quant_blocks", None),  # the NF4 block scales along a quantized kernel's last axis (1/64 of it): never split
)


def _override(base: Rules, **updates: MeshAxes) -> Rules:
    names = {name for name, _ in base}
    unknown = set(updates) - names
    if unknown:
        raise ValueError(f"unknown logical axis names {sorted(unknown)}")
    return tuple((name, updates.get(name, axes)) for name, axes in base)


RULES: dict[str, Rules] = {
    # Pure data parallelism: parameters replicated, batch split over every device of data x fsdp.
    "dp": _PARAMS_REPLICATED,
    # FSDP / ZeRO-3: every matrix split along its model dimension over `fsdp`.
    "fsdp": _override(_PARAMS_REPLICATED, embed="fsdp"),
    # FSDP + tensor parallelism: heads, KV heads, MLP columns and vocabulary over `tensor` (Megatron).
    "fsdp_tp": _override(
        _PARAMS_REPLICATED, embed="fsdp", heads="tensor", kv_heads="tensor", mlp="tensor", vocab="tensor"
    ),
}
"""The built-in rules tables, by strategy name (config key ``mesh.rules``)."""


def get_rules(name: str) -> Rules:
    """Returns ``RULES[name]`` or raises a ``ValueError`` listing the known strategies."""
    if name not in RULES:
        raise ValueError(f"unknown sharding rules {name!r}; known: {sorted(RULES)}")
    return RULES[name]


def _rules_dict(rules: Rules | Mapping[str, MeshAxes]) -> dict[str, MeshAxes]:
    if isinstance(rules, Mapping):
        return dict(rules)
    table: dict[str, MeshAxes] = {}
    for entry in rules:
        if len(entry) != 2:
            raise ValueError(f"a rules entry must be (logical_name, mesh_axes), got {entry!r}")
        name, axes = entry
        if name in table:
            raise ValueError(f"logical axis {name!r} appears twice in the rules table")
        table[name] = axes
    return table


def _as_tuple(axes: MeshAxes) -> tuple[str, ...]:
    if axes is None:
        return ()
    if isinstance(axes, str):
        return (axes,)
    return tuple(axes)


def logical_to_pspec(
    axes: Sequence[str | None],
    rules: Rules | Mapping[str, MeshAxes],
    *,
    shape: Sequence[int] | None = None,
    mesh: Mesh | None = None,
) -> PartitionSpec:
    """Translates logical axis names into a ``PartitionSpec``.

    Args:
        axes: one logical name (or ``None``: replicated) per dimension, e.g. ``("vocab", "embed")``.
        rules: a rules table (tuple of ``(logical_name, mesh_axes)``) or a dict.
        shape: the array's shape; with ``mesh``, a dimension not divisible by the product of its mesh axis
            sizes is replicated.
        mesh: the mesh, needed for the divisibility fallback and to ignore axes absent from it.

    Returns:
        A ``PartitionSpec`` with one entry per dimension (``None``, a mesh axis name or a tuple of them).

    Raises:
        ValueError: when a logical name is missing from the rules, or ``shape`` has the wrong rank.
    """
    table = _rules_dict(rules)
    if shape is not None and len(shape) != len(axes):
        raise ValueError(f"logical axes {tuple(axes)} have rank {len(axes)} but the array has shape {tuple(shape)}")
    used: set[str] = set()
    spec: list[MeshAxes] = []
    for dim, name in enumerate(axes):
        if name is None:
            spec.append(None)
            continue
        if name not in table:
            raise ValueError(f"logical axis {name!r} has no entry in the rules table; known: {sorted(table)}")
        mesh_axes = tuple(a for a in _as_tuple(table[name]) if mesh is None or a in mesh.shape)
        if mesh is not None:
            # Size-1 mesh axes split nothing; dropping them keeps specs canonical.
            mesh_axes = tuple(a for a in mesh_axes if mesh.shape[a] > 1)
        if any(a in used for a in mesh_axes):
            mesh_axes = ()
        if mesh_axes and shape is not None and mesh is not None:
            if shape[dim] % math.prod(mesh.shape[a] for a in mesh_axes):
                mesh_axes = ()
        used.update(mesh_axes)
        spec.append(None if not mesh_axes else mesh_axes[0] if len(mesh_axes) == 1 else mesh_axes)
    return PartitionSpec(*spec)


def _is_axes_leaf(node: Any) -> bool:
    return isinstance(node, tuple) and all(a is None or isinstance(a, str) for a in node)


def param_shardings(
    logical_axes_tree: Any,
    mesh: Mesh,
    rules: Rules | Mapping[str, MeshAxes],
    shapes: Any = None,
) -> Any:
    """Builds the ``NamedSharding`` of every parameter.

    Args:
        logical_axes_tree: a pytree like the params whose leaves are tuples of logical names.
        mesh: the device mesh.
        rules: a rules table.
        shapes: optional pytree with the params' structure whose leaves have ``.shape`` (arrays or
            ``jax.ShapeDtypeStruct``); enables the divisibility fallback and the rank check. Without it every
            rule is applied as written, so pass it unless the sizes are known to divide.

    Returns:
        A pytree with the params' structure and a ``NamedSharding`` at each leaf.

    Raises:
        ValueError: naming the parameter path whose logical axes are unknown or of the wrong rank.
    """

    def one(path: Any, axes: tuple, shape: Sequence[int] | None) -> NamedSharding:
        try:
            return NamedSharding(mesh, logical_to_pspec(axes, rules, shape=shape, mesh=mesh))
        except ValueError as err:
            raise ValueError(f"parameter {jax.tree_util.keystr(path)}: {err}") from None

    if shapes is None:
        return jax.tree_util.tree_map_with_path(lambda p, a: one(p, a, None), logical_axes_tree, is_leaf=_is_axes_leaf)
    axes_def = jax.tree.structure(logical_axes_tree, is_leaf=_is_axes_leaf)
    shapes_def = jax.tree.structure(shapes)
    if axes_def.num_leaves != shapes_def.num_leaves:
        raise ValueError(
            f"logical axes tree has {axes_def.num_leaves} leaves but the params have {shapes_def.num_leaves}: "
            f"{axes_def} vs {shapes_def}"
        )
    return jax.tree_util.tree_map_with_path(lambda p, s, a: one(p, a, tuple(s.shape)), shapes, logical_axes_tree)


def batch_pspec(ndim: int) -> PartitionSpec:
    """``PartitionSpec`` of a batch array of rank ``ndim``: ``B`` over ``("data", "fsdp")``, the rest replicated."""
    if ndim < 1:
        raise ValueError("a batch array needs a leading batch dimension")
    return PartitionSpec(BATCH_AXES, *([None] * (ndim - 1)))


def batch_sharding(mesh: Mesh, ndim: int = 2) -> NamedSharding:
    """``NamedSharding`` of a ``[B, ...]`` batch array of rank ``ndim`` on ``mesh``."""
    return NamedSharding(mesh, batch_pspec(ndim))


def batch_size_multiple(mesh: Mesh) -> int:
    """The number of batch shards: every (micro-)batch size must be a multiple of it."""
    return int(math.prod(mesh.shape[a] for a in BATCH_AXES))


def replicated(mesh: Mesh) -> NamedSharding:
    """A fully replicated ``NamedSharding`` on ``mesh`` (scalars, step counters)."""
    return NamedSharding(mesh, PartitionSpec())
