"""Device meshes with the named axes ``("data", "fsdp", "tensor")``.

The mesh shape comes from the config (``mesh.data``, ``mesh.fsdp``, ``mesh.tensor``); one of the three may be
``-1`` and then takes whatever devices the other two leave. ``data`` replicates parameters and splits the batch,
``fsdp`` splits both the batch and the parameters (ZeRO-3 style, gathered per layer by XLA), ``tensor`` splits
heads and MLP columns inside a layer (Megatron style).

References:
    Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models", 2020.
    Shoeybi et al., "Megatron-LM: Training Multi-Billion Parameter Language Models Using Model Parallelism", 2019.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

MESH_AXES: tuple[str, str, str] = ("data", "fsdp", "tensor")
"""Names of the mesh axes, outermost (slowest interconnect) first."""


def resolve_mesh_shape(data: int, fsdp: int, tensor: int, num_devices: int) -> tuple[int, int, int]:
    """Fills a ``-1`` entry of the mesh shape and checks that the shape covers the devices exactly.

    Args:
        data: size of the ``data`` axis, or -1.
        fsdp: size of the ``fsdp`` axis, or -1.
        tensor: size of the ``tensor`` axis, or -1.
        num_devices: number of devices the mesh must use.

    Returns:
        ``(data, fsdp, tensor)`` with every entry positive and a product of ``num_devices``.

    Raises:
        ValueError: naming the offending axis when a size is 0 or below -1, when more than one axis is -1,
            when the fixed sizes do not divide ``num_devices``, or when the product differs from it.
    """
    sizes = {"data": data, "fsdp": fsdp, "tensor": tensor}
    for name, size in sizes.items():
        if not isinstance(size, (int, np.integer)) or isinstance(size, bool):
            raise ValueError(f"mesh.{name} must be an integer, got {size!r}")
        if size == 0 or size < -1:
            raise ValueError(f"mesh.{name} must be a positive integer or -1 (fill the rest), got {size}")
    if num_devices < 1:
        raise ValueError(f"a mesh needs at least one device, got {num_devices}")
    free = [name for name, size in sizes.items() if size == -1]
    if len(free) > 1:
        raise ValueError(f"at most one mesh axis may be -1, got -1 for {', '.join('mesh.' + n for n in free)}")
    fixed = math.prod(size for size in sizes.values() if size != -1)
    if free:
        if num_devices % fixed:
            fixed_desc = " x ".join(f"{n}={s}" for n, s in sizes.items() if s != -1)
            raise ValueError(
                f"mesh.{free[0]}=-1 cannot fill the mesh: {fixed_desc} (= {fixed}) does not divide the "
                f"{num_devices} devices"
            )
        sizes[free[0]] = num_devices // fixed
    elif fixed != num_devices:
        shape_desc = " x ".join(f"{n}={s}" for n, s in sizes.items())
        raise ValueError(f"mesh {shape_desc} uses {fixed} devices but {num_devices} are available; set one axis to -1")
    return int(sizes["data"]), int(sizes["fsdp"]), int(sizes["tensor"])


def make_mesh(data: int = 1, fsdp: int = -1, tensor: int = 1, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """Builds a ``("data", "fsdp", "tensor")`` mesh over ``devices``.

    Args:
        data: size of the ``data`` axis (-1 fills the rest).
        fsdp: size of the ``fsdp`` axis (-1 fills the rest).
        tensor: size of the ``tensor`` axis (-1 fills the rest).
        devices: the devices to use; all global devices (every process's) by default. With the default, the
            device order comes from ``jax.make_mesh``, which follows the physical topology on TPU and GPU.

    Returns:
        A ``jax.sharding.Mesh`` with axis types ``Auto`` (XLA propagates shardings inside jit).

    Raises:
        ValueError: when the sizes do not match the device count (see ``resolve_mesh_shape``).
    """
    device_list = list(jax.devices() if devices is None else devices)
    shape = resolve_mesh_shape(data, fsdp, tensor, len(device_list))
    axis_types = (AxisType.Auto,) * len(MESH_AXES)
    if devices is None:
        return jax.make_mesh(shape, MESH_AXES, axis_types, devices=device_list)
    return Mesh(np.asarray(device_list, dtype=object).reshape(shape), MESH_AXES, axis_types=axis_types)


def mesh_shape(mesh: Mesh) -> dict[str, int]:
    """Returns ``{axis name: size}`` of ``mesh``, for logging under ``perf/``."""
    return {name: int(size) for name, size in mesh.shape.items()}
