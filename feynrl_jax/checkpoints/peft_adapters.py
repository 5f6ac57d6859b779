"""LoRA adapters in PEFT's folder format: written so that `peft.PeftModel.from_pretrained` loads them onto the
transformers model, and read back to continue training.

A folder holds `adapter_config.json` (`peft_type` "LORA", `r`, `lora_alpha`, `target_modules`, ...) and
`adapter_model.safetensors` with, for every layer `i` and target projection,

| our leaf (one layer) | PEFT tensor | PEFT shape |
|---|---|---|
| `layers/<t>/lora_a` `[*inputs, r]` | `base_model.model.model.layers.{i}.<module>.<t>.lora_A.weight` | `[r, in]` |
| `layers/<t>/lora_b` `[r, *outputs]` | `base_model.model.model.layers.{i}.<module>.<t>.lora_B.weight` | `[out, r]` |

where `<module>` is `self_attn` (q, k, v, o) or `mlp` (gate, up, down), and `in`/`out` flatten the heads exactly as
the kernels' Hugging Face layout does (`hf_names`): PEFT computes `x A^T B^T (alpha / r)`, ours `x A B (alpha / r)`.
Only plain LoRA is read: rsLoRA's `alpha / sqrt(r)`, DoRA, trained biases, `modules_to_save` or per-module ranks
are refused with the file named, never half-applied.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from typing import Any

import numpy as np

from feynrl_jax.errors import InputError
from feynrl_jax.models.config import LORA_TARGETS, ModelConfig
from feynrl_jax.models.lora import input_dims

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
_MODULE = {t: "self_attn" if t in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp" for t in LORA_TARGETS}


def tensor_name(layer: int, target: str, which: str) -> str:
    """The PEFT tensor name of one layer's `lora_A` / `lora_B` (`which` "A" or "B") of `target`."""
    return f"base_model.model.model.layers.{layer}.{_MODULE[target]}.{target}.lora_{which}.weight"


def read_adapter_config(folder: str) -> dict[str, Any]:
    """`{"lora_rank", "lora_alpha", "lora_targets"}` of a PEFT LoRA folder.

    Raises:
        InputError: no `adapter_config.json`, not JSON, not a LoRA adapter, or one using what this project does
            not train (rsLoRA, DoRA, biases, `modules_to_save`, per-module ranks or alphas, `fan_in_fan_out`);
            names the file and the key.
    """
    path = os.path.join(folder, ADAPTER_CONFIG)
    try:
        with open(path) as f:
            raw = json.load(f)
    except FileNotFoundError:
        raise InputError(f"{path}: no PEFT adapter config (adapter_config.json) in {folder}") from None
    except json.JSONDecodeError as e:
        raise InputError(f"{path}: not valid JSON ({e})") from None
    if raw.get("peft_type") != "LORA":
        raise InputError(f"{path}: peft_type={raw.get('peft_type')!r}; only LORA adapters are read")
    unsupported = {
        "use_rslora": False,
        "use_dora": False,
        "fan_in_fan_out": False,
        "lora_bias": False,
        "bias": "none",
        "modules_to_save": None,
        "rank_pattern": {},
        "alpha_pattern": {},
        "layers_to_transform": None,
        "layers_pattern": None,
    }
    for key, plain in unsupported.items():
        value = raw.get(key, plain)
        if value != plain and (plain == "none" or value):  # unset, null, false and empty mean "not used"
            raise InputError(f"{path}: {key}={raw[key]!r} is not supported (plain LoRA only: {key}={plain!r})")
    if raw.get("init_lora_weights", True) not in (True, False, "gaussian"):  # PiSSA, OLoRA, LoftQ...: another base
        raise InputError(
            f"{path}: init_lora_weights={raw['init_lora_weights']!r} is not supported: such an adapter is relative to "
            "a modified base model (plain LoRA only)"
        )
    targets = raw.get("target_modules")
    if isinstance(targets, str) or not targets:
        raise InputError(f"{path}: target_modules={targets!r}; a list of projection names is needed")
    unknown = sorted(set(targets) - set(LORA_TARGETS))
    if unknown:
        raise InputError(f"{path}: target_modules {unknown} are not among {LORA_TARGETS}")
    for key in ("r", "lora_alpha"):
        if not isinstance(raw.get(key), int | float) or raw[key] <= 0:
            raise InputError(f"{path}: {key}={raw.get(key)!r} must be a positive number")
    return {"lora_rank": int(raw["r"]), "lora_alpha": float(raw["lora_alpha"]), "lora_targets": tuple(targets)}


def _per_layer(leaf: np.ndarray, target: str, which: str) -> list[np.ndarray]:
    """Our stacked adapter leaf as one PEFT matrix per layer."""
    rank = leaf.shape[-1] if which == "A" else leaf.shape[1]
    if which == "A":  # [L, *inputs, r] -> [r, in]
        return [a.reshape(-1, rank).T for a in leaf]
    return [b.reshape(rank, -1).T for b in leaf]  # [L, r, *outputs] -> [out, r]


def peft_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """`{PEFT tensor name: shape}` of every adapter matrix of `config` (`lora_A` `[r, in]`, `lora_B` `[out, r]`)."""
    from feynrl_jax.models.decoder import param_shapes

    shapes = param_shapes(config.without_lora())["layers"]
    r = config.lora_rank
    out = {}
    for target in config.lora_targets:
        kernel = shapes[target]["kernel"][1:]
        n = input_dims(target)
        fan_in, fan_out = int(np.prod(kernel[:n])), int(np.prod(kernel[n:]))
        for i in range(config.num_layers):
            out[tensor_name(i, target, "A")] = (r, fan_in)
            out[tensor_name(i, target, "B")] = (fan_out, r)
    return out


def peft_tensors(params: dict, config: ModelConfig) -> dict[str, np.ndarray]:
    """`{PEFT tensor name: contiguous host matrix}` of the adapters in `params` (full params or the adapters
    alone, `lora.adapters_of`; host or device arrays, dtype kept)."""
    if not config.lora_rank:
        raise ValueError("peft_tensors needs a model config with LoRA adapters (lora_rank > 0)")
    tensors = {}
    for target in config.lora_targets:
        for key, which in (("lora_a", "A"), ("lora_b", "B")):
            leaf = params.get("layers", {}).get(target, {}).get(key)
            if leaf is None:
                raise KeyError(f"layers/{target}/{key}")
            for i, matrix in enumerate(_per_layer(np.asarray(leaf), target, which)):
                tensors[tensor_name(i, target, which)] = np.ascontiguousarray(matrix)
    return tensors


def hf_kernel_name(layer: int, target: str) -> str:
    """The Hugging Face name of the kernel that `target`'s adapter of `layer` adapts (`[out, in]`)."""
    return f"model.layers.{layer}.{_MODULE[target]}.{target}.weight"


def merge_into_hf(
    hf: dict[str, np.ndarray], adapters: dict[str, np.ndarray], config: ModelConfig
) -> dict[str, np.ndarray]:
    """Hugging Face tensors with PEFT adapter tensors merged in: `W + (alpha / r) B A` for each adapted kernel, in
    float32, cast back to the kernel's dtype (PEFT's `merge_and_unload`). Unadapted tensors are passed through
    (the same arrays).

    Args:
        hf: `{HF name: array}` of the base (`hf_names.hf_tensors`).
        adapters: `{PEFT tensor name: array}` (`peft_tensors`).
        config: the model config (`lora_rank`, `lora_alpha`, `lora_targets`, `num_layers`).
    """
    out = dict(hf)
    scale = np.float32(config.lora_scale)
    for target in config.lora_targets:
        for i in range(config.num_layers):
            name = hf_kernel_name(i, target)
            kernel = out[name]
            a = np.asarray(adapters[tensor_name(i, target, "A")], np.float32)
            b = np.asarray(adapters[tensor_name(i, target, "B")], np.float32)
            out[name] = (np.asarray(kernel, np.float32) + scale * (b @ a)).astype(kernel.dtype)
    return out


def adapter_config(config: ModelConfig, *, base_model: str = "") -> dict[str, Any]:
    """The `adapter_config.json` of `config`'s adapters: plain LoRA (`r`, `lora_alpha`, `target_modules`).

    Args:
        config: the model config (`lora_rank`, `lora_alpha`, `lora_targets`).
        base_model: `base_model_name_or_path` (the base model's folder or hub id), or "".
    """
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model or None,
        "r": config.lora_rank,
        "lora_alpha": config.lora_alpha,
        "lora_dropout": config.lora_dropout,
        "target_modules": list(config.lora_targets),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
        "modules_to_save": None,
        "inference_mode": True,
    }


def write_peft(tensors: dict[str, np.ndarray], config: dict[str, Any], folder: str) -> str:
    """Writes a PEFT folder (`adapter_model.safetensors` and `adapter_config.json`), complete or not at all: written
    beside it, then renamed into place; an existing folder is replaced. Returns `folder`."""
    from safetensors.numpy import save_file

    parent = os.path.dirname(os.path.abspath(folder))
    os.makedirs(parent, exist_ok=True)
    staging = tempfile.mkdtemp(prefix=".peft-", dir=parent)
    try:
        save_file(tensors, os.path.join(staging, ADAPTER_WEIGHTS), metadata={"format": "pt"})
        with open(os.path.join(staging, ADAPTER_CONFIG), "w") as f:
            json.dump(config, f, indent=2, sort_keys=True)
        if os.path.isdir(folder):
            shutil.rmtree(folder)
        os.replace(staging, folder)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return folder


def export_peft(params: dict, config: ModelConfig, folder: str, *, base_model: str = "") -> str:
    """Writes the adapters of `params` as a PEFT LoRA folder (`write_peft`: complete or not at all).

    Args:
        params: params with adapters (host or device arrays; float32 adapters stay float32).
        config: the model config (`lora_rank`, `lora_alpha`, `lora_targets`).
        folder: the folder to write.
        base_model: `base_model_name_or_path` for the config (the base model's folder or hub id), or "".

    Returns:
        `folder`.
    """
    return write_peft(peft_tensors(params, config), adapter_config(config, base_model=base_model), folder)


def load_peft_adapters(folder: str, config: ModelConfig) -> dict:
    """The adapters of a PEFT LoRA folder as our nested, stacked float32 leaves (`{"layers": {target: {...}}}`).

    Args:
        folder: the PEFT folder.
        config: the model config the adapters are for (its LoRA fields must be the folder's).

    Raises:
        InputError: the folder's config or tensors do not fit `config` (a tensor missing, unexpected, or of
            another shape; the message names the file and the tensor).
    """
    from safetensors import SafetensorError
    from safetensors.numpy import load_file

    found = read_adapter_config(folder)
    keys = {"lora_rank": "rank", "lora_alpha": "alpha", "lora_targets": "targets"}
    for field, key in keys.items():
        want, got = getattr(config, field), found[field]
        if field == "lora_targets":
            want, got = tuple(sorted(want)), tuple(sorted(got))
        if want != got:
            raise InputError(
                f"config.model.lora.{key}={getattr(config, field)!r} but the PEFT adapter in {folder} has {got!r} "
                f"(model.lora.init_from): set config.model.lora.{key} to the adapter's"
            )
    path = os.path.join(folder, ADAPTER_WEIGHTS)
    try:
        tensors = load_file(path)
    except (FileNotFoundError, SafetensorError, OSError) as e:
        raise InputError(f"{path}: cannot read the adapter weights ({e})") from None
    from feynrl_jax.models.decoder import param_shapes

    ours = param_shapes(config)["layers"]
    expected = peft_shapes(config)
    out: dict[str, dict] = {}
    for target in config.lora_targets:
        leaves = {}
        for key, which in (("lora_a", "A"), ("lora_b", "B")):
            layers = []
            for i in range(config.num_layers):
                name = tensor_name(i, target, which)
                if name not in tensors:
                    raise InputError(f"{path}: tensor {name} is missing")
                matrix = tensors[name]
                if tuple(matrix.shape) != expected[name]:
                    raise InputError(
                        f"{path}: tensor {name} has shape {tuple(matrix.shape)}, expected {expected[name]}"
                    )
                layers.append(matrix.astype(np.float32).T)
            leaves[key] = np.stack([m.reshape(ours[target][key][1:]) for m in layers])
        out[target] = leaves
    unexpected = sorted(set(tensors) - set(expected))
    if unexpected:
        raise InputError(f"{path}: {len(unexpected)} tensor(s) this model has no place for, e.g. {unexpected[0]}")
    return {"layers": out}
