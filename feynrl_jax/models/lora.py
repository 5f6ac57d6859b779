"""Low-rank adapters (LoRA) over the params dict: shapes, initialisation, splitting, merging.

A projection `y = x W` (`W` the kernel, `N` inputs, `M` outputs) with an adapter computes

    y = x W + (alpha / r) * (x A) B,        A: [N, r],  B: [r, M]

with `W` frozen and only `A`, `B` trained. The adapters live in the params dict beside the kernel they adapt,
stacked over layers like it, in the kernel's own input and output axes:

    layers/q_proj/lora_a [L, D, r]      layers/q_proj/lora_b [L, r, H, Dh]     (k_proj, v_proj: K heads)
    layers/o_proj/lora_a [L, H, Dh, r]  layers/o_proj/lora_b [L, r, D]
    layers/{gate,up}_proj/lora_a [L, D, r]  lora_b [L, r, F]     layers/down_proj/lora_a [L, F, r]  lora_b [L, r, D]

so `lax.scan` slices them with the layer, the logical-axis rules shard them like their kernel (the rank axis
`lora_rank` is never split), and `forward` applies every adapter it finds (`ModelConfig.lora_scale` gives
`alpha / r`). Without the adapters the same params are the base model: the reference model of a LoRA run is the
policy's own params with the adapters dropped (`base_params`), no second copy.

Initialisation (Hu et al. 2021, Section 4.1): `B = 0`, so a fresh adapter leaves the model unchanged; `A` uniform
in `±1/sqrt(N)` (PyTorch's default for a linear layer, which PEFT uses for `lora_A`).

References:
    Hu et al., "LoRA: Low-Rank Adaptation of Large Language Models", 2021 (arXiv:2106.09685).
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp

from feynrl_jax.models.config import ModelConfig

ADAPTER_LEAVES = ("lora_a", "lora_b")
"""Leaf names that hold adapters."""
RANK_AXIS = "lora_rank"
"""Logical axis name of the rank dimension (replicated by every rules table)."""
_INPUT_DIMS = {"o_proj": 2}
"""Kernel dimensions (after the layer axis) that are the projection's input; 1 for every other target."""


def input_dims(target: str) -> int:
    """How many leading kernel dimensions (after the layer axis) are `target`'s input: 2 for `o_proj` `[H, Dh]`,
    1 otherwise."""
    return _INPUT_DIMS.get(target, 1)


def adapter_shapes(config: ModelConfig, kernel_shapes: dict[str, tuple[int, ...]]) -> dict[str, dict]:
    """`{target: {"lora_a": shape, "lora_b": shape}}` for every target of `config`, from the kernels' shapes
    (`{target: (L, *inputs, *outputs)}`)."""
    r = config.lora_rank
    out = {}
    for target in config.lora_targets:
        shape = kernel_shapes[target]
        n = 1 + input_dims(target)
        out[target] = {"lora_a": (*shape[:n], r), "lora_b": (shape[0], r, *shape[n:])}
    return out


def adapter_axes(kernel_axes: tuple[str, ...], target: str) -> dict[str, tuple[str, ...]]:
    """The logical axes of `target`'s adapters from its kernel's (`("layers", *inputs, *outputs)`)."""
    n = 1 + input_dims(target)
    return {"lora_a": (*kernel_axes[:n], RANK_AXIS), "lora_b": (kernel_axes[0], RANK_AXIS, *kernel_axes[n:])}


def init_leaf(name: str, shape: tuple[int, ...], key: jax.Array, target: str) -> jax.Array:
    """A fresh adapter leaf in float32: `lora_b` zeros, `lora_a` uniform in `±1/sqrt(fan_in)`."""
    if name == "lora_b":
        return jnp.zeros(shape, jnp.float32)
    fan_in = math.prod(shape[1 : 1 + input_dims(target)])
    bound = 1.0 / math.sqrt(fan_in)
    return jax.random.uniform(key, shape, jnp.float32, -bound, bound)


def is_adapter_path(path: tuple[Any, ...]) -> bool:
    """Whether a pytree key path (`jax.tree_util` keys or strings) ends in an adapter leaf."""
    return bool(path) and str(getattr(path[-1], "key", path[-1])) in ADAPTER_LEAVES


def split(params: dict) -> tuple[dict, dict]:
    """`(base, adapters)`: the params without adapter leaves, and the adapter leaves alone (same nesting).

    Both share the arrays of `params` (no copy). Dicts left empty are dropped from `adapters`. Per-layer params
    (`unstack_layers`: `layers` a tuple of dicts) split layer by layer.
    """

    def go(tree: Any) -> tuple[Any, Any]:
        if isinstance(tree, tuple):
            parts = [go(layer) for layer in tree]
            adapters = tuple(a for _, a in parts)
            return tuple(b for b, _ in parts), (adapters if any(adapters) else None)
        if not isinstance(tree, dict):
            return tree, None
        base, adapters = {}, {}
        for key, value in tree.items():
            if key in ADAPTER_LEAVES:
                adapters[key] = value
                continue
            b, a = go(value)
            base[key] = b
            if a:
                adapters[key] = a
        return base, adapters

    return go(params)


def base_params(params: dict) -> dict:
    """The params without their adapters: the base model (arrays shared, no copy)."""
    return split(params)[0]


def adapters_of(params: dict) -> dict:
    """The adapter leaves of `params` alone, nested as in `params` (arrays shared)."""
    return split(params)[1]


def combine(base: dict, adapters: dict) -> dict:
    """The union of two nested dicts (`split`'s inverse): base params with adapters beside their kernels.

    Raises:
        ValueError: an adapter's place does not exist in `base`, or a leaf would be replaced.
    """

    def go(b: Any, a: Any, where: str) -> Any:
        if isinstance(b, tuple) and isinstance(a, tuple) and len(a) == len(b):  # per-layer params
            return tuple(go(bl, al, f"{where}/{i}") for i, (bl, al) in enumerate(zip(b, a)))
        if not isinstance(b, dict) or not isinstance(a, dict):
            raise ValueError(f"adapters at {where or '/'} do not fit the base params")
        out = dict(b)
        for key, value in a.items():
            if key in ADAPTER_LEAVES:
                if key in b:
                    raise ValueError(f"{where}/{key} is in both the base params and the adapters")
                out[key] = value
            elif key not in b:
                raise ValueError(f"adapters at {where}/{key} have no such place in the base params")
            else:
                out[key] = go(b[key], value, f"{where}/{key}")
        return out

    return go(base, adapters, "")


def init_adapters(config: ModelConfig, rng: jax.Array) -> dict:
    """Fresh adapters for `config` (`{"layers": {target: {"lora_a", "lora_b"}}}`, float32), one jitted program."""
    return _init_adapters(config, rng)


@functools.partial(jax.jit, static_argnums=0)
def _init_adapters(config: ModelConfig, rng: jax.Array) -> dict:
    from feynrl_jax.models.decoder import param_shapes

    shapes = adapters_of(param_shapes(config))
    layers = shapes.get("layers", {})
    keys = jax.random.split(rng, max(1, len(layers)))
    out = {}
    for key, (target, leaves) in zip(keys, sorted(layers.items())):
        out[target] = {name: init_leaf(name, shape, key, target) for name, shape in leaves.items()}
    return {"layers": out} if out else {}


def merge(params: dict, config: ModelConfig) -> dict:
    """The base params with every adapter folded into its kernel: `W + (alpha / r) A B` (computed in float32,
    stored in the kernel's dtype). The result has no adapter leaves and computes what `params` computes (up to
    rounding); `config.without_lora()` describes it.

    Args:
        params: params with adapters (stacked layers), as `forward` takes them.
        config: the model config (its `lora_scale`).
    """
    base, adapters = split(params)
    layers = dict(base["layers"])
    for target, leaves in adapters.get("layers", {}).items():
        kernel = layers[target]["kernel"]
        a, b = leaves["lora_a"], leaves["lora_b"]
        n, r = a.shape[0], a.shape[-1]
        delta = jnp.einsum(
            "lir,lro->lio",
            a.reshape(n, -1, r).astype(jnp.float32),
            b.reshape(n, r, -1).astype(jnp.float32),
            precision=jax.lax.Precision.HIGHEST,
        ).reshape(kernel.shape)
        merged = (kernel.astype(jnp.float32) + config.lora_scale * delta).astype(kernel.dtype)
        layers[target] = {**layers[target], "kernel": merged}
    return {**base, "layers": layers}
