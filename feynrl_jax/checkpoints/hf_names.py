"""One-to-one mapping between our params pytree and Hugging Face safetensors tensor names.

Every family stores the same tensors under the same names (`LlamaForCausalLM`, `Qwen2ForCausalLM`,
`Qwen3ForCausalLM`, `MistralForCausalLM`); the per-family tables are in docs/MODELS.md. `{i}` is the layer:
our stacked arrays hold layer `i` at index `i` of axis 0. Torch `nn.Linear` stores `[out, in]`; we store
`[in, out]` with heads split out, so the transforms below are a transpose plus a reshape.

| our path | HF name | HF shape -> our shape (per layer) |
|---|---|---|
| `embed/embedding` | `model.embed_tokens.weight` | `[V, D]` -> `[V, D]` |
| `layers/attn_norm/scale` | `model.layers.{i}.input_layernorm.weight` | `[D]` |
| `layers/q_proj/kernel` | `model.layers.{i}.self_attn.q_proj.weight` | `[H*Dh, D]` -> `[D, H, Dh]` |
| `layers/k_proj/kernel` | `model.layers.{i}.self_attn.k_proj.weight` | `[K*Dh, D]` -> `[D, K, Dh]` |
| `layers/v_proj/kernel` | `model.layers.{i}.self_attn.v_proj.weight` | `[K*Dh, D]` -> `[D, K, Dh]` |
| `layers/{q,k,v}_proj/bias` | `model.layers.{i}.self_attn.{q,k,v}_proj.bias` | `[H*Dh]` -> `[H, Dh]` |
| `layers/q_norm/scale` | `model.layers.{i}.self_attn.q_norm.weight` | `[Dh]` (qwen3) |
| `layers/k_norm/scale` | `model.layers.{i}.self_attn.k_norm.weight` | `[Dh]` (qwen3) |
| `layers/o_proj/kernel` | `model.layers.{i}.self_attn.o_proj.weight` | `[D, H*Dh]` -> `[H, Dh, D]` |
| `layers/o_proj/bias` | `model.layers.{i}.self_attn.o_proj.bias` | `[D]` (attention_bias, not qwen2) |
| `layers/mlp_norm/scale` | `model.layers.{i}.post_attention_layernorm.weight` | `[D]` |
| `layers/gate_proj/kernel` | `model.layers.{i}.mlp.gate_proj.weight` | `[F, D]` -> `[D, F]` |
| `layers/up_proj/kernel` | `model.layers.{i}.mlp.up_proj.weight` | `[F, D]` -> `[D, F]` |
| `layers/down_proj/kernel` | `model.layers.{i}.mlp.down_proj.weight` | `[D, F]` -> `[F, D]` |
| `final_norm/scale` | `model.norm.weight` | `[D]` |
| `lm_head/kernel` | `lm_head.weight` | `[V, D]` -> `[D, V]` (untied only) |
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator

import numpy as np

from feynrl_jax.models.config import ModelConfig
from feynrl_jax.models.decoder import param_shapes


@dataclasses.dataclass(frozen=True)
class TensorMapping:
    """How one of our parameters is stored in a HF checkpoint.

    Attributes:
        path: our slash-joined param path, e.g. `layers/q_proj/kernel`.
        hf_name: the HF tensor name; `{i}` stands for the layer index in stacked parameters.
        stacked: the parameter has a leading layer axis.
        shape: our shape of one slice (one layer for stacked parameters).
        hf_shape: the HF tensor's shape.
        to_ours: HF array -> our array (one layer).
        to_hf: our array (one layer) -> HF array.
    """

    path: str
    hf_name: str
    stacked: bool
    shape: tuple[int, ...]
    hf_shape: tuple[int, ...]
    to_ours: Callable[[np.ndarray], np.ndarray]
    to_hf: Callable[[np.ndarray], np.ndarray]


_HF_NAMES = {
    "embed/embedding": "model.embed_tokens.weight",
    "layers/attn_norm/scale": "model.layers.{i}.input_layernorm.weight",
    "layers/q_proj/kernel": "model.layers.{i}.self_attn.q_proj.weight",
    "layers/k_proj/kernel": "model.layers.{i}.self_attn.k_proj.weight",
    "layers/v_proj/kernel": "model.layers.{i}.self_attn.v_proj.weight",
    "layers/q_proj/bias": "model.layers.{i}.self_attn.q_proj.bias",
    "layers/k_proj/bias": "model.layers.{i}.self_attn.k_proj.bias",
    "layers/v_proj/bias": "model.layers.{i}.self_attn.v_proj.bias",
    "layers/q_norm/scale": "model.layers.{i}.self_attn.q_norm.weight",
    "layers/k_norm/scale": "model.layers.{i}.self_attn.k_norm.weight",
    "layers/o_proj/kernel": "model.layers.{i}.self_attn.o_proj.weight",
    "layers/o_proj/bias": "model.layers.{i}.self_attn.o_proj.bias",
    "layers/mlp_norm/scale": "model.layers.{i}.post_attention_layernorm.weight",
    "layers/gate_proj/kernel": "model.layers.{i}.mlp.gate_proj.weight",
    "layers/up_proj/kernel": "model.layers.{i}.mlp.up_proj.weight",
    "layers/down_proj/kernel": "model.layers.{i}.mlp.down_proj.weight",
    "final_norm/scale": "model.norm.weight",
    "lm_head/kernel": "lm_head.weight",
}


def _identity(x: np.ndarray) -> np.ndarray:
    return x


def _transforms(path: str, shape: tuple[int, ...]):
    """(to_ours, to_hf, hf_shape) for one parameter slice of our `shape`."""
    leaf = path.split("/", 1)[-1]
    if leaf in ("q_proj/kernel", "k_proj/kernel", "v_proj/kernel"):
        d, n, dh = shape
        return (lambda w: w.T.reshape(d, n, dh)), (lambda k: k.reshape(d, n * dh).T), (n * dh, d)
    if leaf in ("q_proj/bias", "k_proj/bias", "v_proj/bias"):
        n, dh = shape
        return (lambda b: b.reshape(n, dh)), (lambda b: b.reshape(n * dh)), (n * dh,)
    if leaf == "o_proj/kernel":
        n, dh, d = shape
        return (lambda w: w.T.reshape(n, dh, d)), (lambda k: k.reshape(n * dh, d).T), (d, n * dh)
    if leaf in ("gate_proj/kernel", "up_proj/kernel", "down_proj/kernel", "kernel"):
        return (lambda w: w.T), (lambda k: k.T), shape[::-1]
    return _identity, _identity, shape


def tensor_mappings(config: ModelConfig) -> list[TensorMapping]:
    """The mapping of every parameter of a model with this config, in params-pytree order."""
    shapes = param_shapes(config)
    out = []
    for group, leaves in shapes.items():
        for module, params in leaves.items():
            items = params.items() if isinstance(params, dict) else [(None, params)]
            for name, shape in items:
                path = f"{group}/{module}" + (f"/{name}" if name else "")
                stacked = group == "layers"
                one = tuple(shape[1:]) if stacked else tuple(shape)
                to_ours, to_hf, hf_shape = _transforms(path, one)
                out.append(TensorMapping(path, _HF_NAMES[path], stacked, one, tuple(hf_shape), to_ours, to_hf))
    return out


def get_path(tree: dict, path: str):
    """The leaf of a nested dict at a slash-joined path."""
    for key in path.split("/"):
        tree = tree[key]
    return tree


def set_path(tree: dict, path: str, value) -> None:
    """Sets the leaf at a slash-joined path, creating intermediate dicts."""
    keys = path.split("/")
    for key in keys[:-1]:
        tree = tree.setdefault(key, {})
    tree[keys[-1]] = value


def hf_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """`{HF tensor name: HF shape}` of every tensor a model with this config has, in params-pytree order."""
    out = {}
    for m in tensor_mappings(config):
        names = [m.hf_name.format(i=i) for i in range(config.num_layers)] if m.stacked else [m.hf_name]
        out.update((name, m.hf_shape) for name in names)
    return out


def hf_tensors(
    params: dict, config: ModelConfig, dtype: np.dtype, *, what: str = "params"
) -> Iterator[tuple[str, np.ndarray]]:
    """`(HF name, contiguous host array in dtype)` for every tensor of `params`, in params-pytree order.

    One parameter at a time is fetched to host (`np.asarray`) and cast, so the host holds at most one converted
    parameter besides the caller's copies.

    Args:
        params: the params pytree (paths and shapes of docs/CONTRACTS.md; any array type `np.asarray` accepts).
        config: the model config the params belong to.
        dtype: the dtype of the returned arrays (a numpy dtype; `ml_dtypes.bfloat16` for bfloat16).
        what: how error messages name `params`.

    Raises:
        KeyError: `params` lacks a parameter of the model (names its path).
        ValueError: a parameter has the wrong shape (names its path and both shapes).
    """
    for m in tensor_mappings(config):
        try:
            leaf = get_path(params, m.path)
        except (KeyError, TypeError) as e:
            raise KeyError(f"{what} has no {m.path!r}, which a {config.architecture} model needs") from e
        host = np.asarray(leaf).astype(dtype, copy=False)
        expected = ((config.num_layers,) if m.stacked else ()) + m.shape
        if host.shape != expected:
            raise ValueError(f"{what} {m.path!r} has shape {host.shape}, the model needs {expected}")
        if m.stacked:
            for i in range(config.num_layers):
                yield m.hf_name.format(i=i), np.ascontiguousarray(m.to_hf(host[i]))
        else:
            yield m.hf_name, np.ascontiguousarray(m.to_hf(host))
