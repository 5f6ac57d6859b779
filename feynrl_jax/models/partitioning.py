"""Logical axis names of every parameter, for sharding by a rules table (MaxText's `logical_axis_rules`).

The sharding package maps each name to a mesh axis (or None); see `RULES` in `feynrl_jax.sharding`. Activations
carry no names: batches are placed over `("data", "fsdp")` and XLA propagates the rest from the parameters.
"""

from __future__ import annotations

import jax

from feynrl_jax.models import lora
from feynrl_jax.models.config import ModelConfig
from feynrl_jax.models.decoder import param_shapes

_AXES = {
    "embed/embedding": ("vocab", "embed"),
    "layers/attn_norm/scale": ("layers", "norm"),
    "layers/mlp_norm/scale": ("layers", "norm"),
    "layers/q_proj/kernel": ("layers", "embed", "heads", "head_dim"),
    "layers/k_proj/kernel": ("layers", "embed", "kv_heads", "head_dim"),
    "layers/v_proj/kernel": ("layers", "embed", "kv_heads", "head_dim"),
    "layers/q_proj/bias": ("layers", "heads", "head_dim"),
    "layers/k_proj/bias": ("layers", "kv_heads", "head_dim"),
    "layers/v_proj/bias": ("layers", "kv_heads", "head_dim"),
    "layers/q_norm/scale": ("layers", "head_dim"),
    "layers/k_norm/scale": ("layers", "head_dim"),
    "layers/o_proj/kernel": ("layers", "heads", "head_dim", "embed"),
    "layers/o_proj/bias": ("layers", "embed"),
    "layers/gate_proj/kernel": ("layers", "embed", "mlp"),
    "layers/up_proj/kernel": ("layers", "embed", "mlp"),
    "layers/down_proj/kernel": ("layers", "mlp", "embed"),
    "final_norm/scale": ("norm",),
    "lm_head/kernel": ("embed", "vocab"),
}


def _is_shape(x) -> bool:
    return isinstance(x, tuple) and all(isinstance(i, int) for i in x)


def param_path(path) -> str:
    """A pytree key path as the slash-joined name used in the contract table, e.g. `layers/q_proj/kernel`."""
    return "/".join(str(getattr(k, "key", k)) for k in path)


def logical_axes(config: ModelConfig) -> dict:
    """A pytree matching `init_params(config, ...)`, each leaf a tuple of logical axis names.

    Tuples are pytrees themselves: map over the result with `is_leaf=lambda x: isinstance(x, tuple)`.
    """
    return jax.tree_util.tree_map_with_path(_axes_of, param_shapes(config), is_leaf=_is_shape)


def _axes_of(path, shape) -> tuple[str, ...]:
    name = param_path(path)
    if lora.is_adapter_path(path):  # layers/<target>/lora_a|lora_b: the kernel's axes around the rank axis
        target = name.split("/")[-2]
        return lora.adapter_axes(_AXES[f"layers/{target}/kernel"], target)[name.split("/")[-1]]
    if name.endswith("/kernel_nf4"):  # NF4 codes: the kernel's axes (the last one holds two codes per byte)
        return _AXES[name.removesuffix("_nf4")]
    if name.endswith("/kernel_absmax"):  # NF4 block scales: the kernel's axes, blocks on the last (never split)
        return (*_AXES[name.removesuffix("_absmax")][:-1], "quant_blocks")
    return _AXES[name]
