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
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from feynrl_jax.models import quant
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


def partition(tree: Any, keep: Callable[[tuple[Any, ...]], bool]) -> tuple[Any, Any]:
    """`(rest, kept)`: the leaves of nested dicts whose key path `keep` accepts, and the others, each nested as in
    `tree` (no copy; containers left empty are dropped). Per-layer params (`unstack_layers`: `layers` a tuple of
    dicts) split layer by layer. `split` is this for adapter leaves; the train step uses it for
    `ParamsSpec.trainable`.

    Raises:
        TypeError: `tree` is not a dict.
    """
    if not isinstance(tree, dict):
        raise TypeError(f"partition needs params of nested dicts, found {type(tree).__name__}")
    return _partition(tree, keep, ())


def _is_container(x: Any) -> bool:
    """A dict, or a tuple of dicts (per-layer params); a tuple of ints (a shape) is a leaf."""
    return isinstance(x, dict) or (isinstance(x, tuple) and bool(x) and all(isinstance(t, dict) for t in x))


def _partition(tree: Any, keep: Callable[[tuple[Any, ...]], bool], path: tuple[Any, ...]) -> tuple[Any, Any]:
    if isinstance(tree, tuple):
        parts = [_partition(t, keep, (*path, jax.tree_util.SequenceKey(i))) for i, t in enumerate(tree)]
        rest, kept = tuple(r for r, _ in parts), tuple(k for _, k in parts)
        return (rest if any(rest) else {}), (kept if any(kept) else {})
    rest, kept = {}, {}
    for key, value in tree.items():
        where = (*path, jax.tree_util.DictKey(key))
        if _is_container(value):
            r, k = _partition(value, keep, where)
            if r:
                rest[key] = r
            if k:
                kept[key] = k
        elif keep(where):
            kept[key] = value
        else:
            rest[key] = value
    return rest, kept


def union(rest: Any, kept: Any, *, fit: bool = False) -> Any:
    """`partition`'s inverse: the two nested dicts (or tuples of them) merged, `rest` alone when `kept` is empty.

    Args:
        rest: nested dicts.
        kept: nested dicts to merge in.
        fit: every leaf of `kept` must go where `rest` has its container, and replace nothing (adapters that fit
            their base); otherwise `kept` may bring whole subtrees.

    Raises:
        ValueError: with `fit`, a leaf of `kept` has no place in `rest` or is in both (names the path).
    """
    return _union(rest, kept, fit, "")


def _union(rest: Any, kept: Any, fit: bool, where: str) -> Any:
    if not kept:
        return rest
    if not rest and not fit:
        return kept
    if isinstance(rest, tuple) and isinstance(kept, tuple) and len(rest) == len(kept):  # per-layer params
        return tuple(_union(r, k, fit, f"{where}/{i}") for i, (r, k) in enumerate(zip(rest, kept)))
    if not isinstance(rest, dict) or not isinstance(kept, dict):
        raise ValueError(f"{where or '/'}: the two trees do not fit")
    out = dict(rest)
    for key, value in kept.items():
        if _is_container(value):
            if key not in rest and fit:
                raise ValueError(f"{where}/{key} has no such place in the base params")
            out[key] = _union(rest.get(key, {}), value, fit, f"{where}/{key}")
        elif key in rest:
            raise ValueError(f"{where}/{key} is in both trees")
        else:
            out[key] = value
    return out


def split(params: dict) -> tuple[dict, dict]:
    """`(base, adapters)`: the params without adapter leaves, and the adapter leaves alone (same nesting; arrays
    shared, no copy)."""
    return partition(params, is_adapter_path)


def base_params(params: dict) -> dict:
    """The params without their adapters: the base model (arrays shared, no copy)."""
    return split(params)[0]


def adapters_of(params: dict) -> dict:
    """The adapter leaves of `params` alone, nested as in `params` (arrays shared)."""
    return split(params)[1]


def combine(base: dict, adapters: dict) -> dict:
    """`split`'s inverse: base params with adapters beside their kernels.

    Raises:
        ValueError: an adapter's place does not exist in `base`, or a leaf would be replaced.
    """
    return union(base, adapters, fit=True)


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
    rounding); `config.without_lora()` describes it. An NF4 base (QLoRA) is dequantized first, to `param_dtype`.

    Args:
        params: params with adapters (stacked layers), as `forward` takes them.
        config: the model config (its `lora_scale`).
    """
    base, adapters = split(params)
    base = quant.dequantize_base(base, jnp.dtype(config.param_dtype))
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
