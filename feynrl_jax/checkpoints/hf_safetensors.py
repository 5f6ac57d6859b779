"""Hugging Face safetensors checkpoints: load into a (sharded) params pytree, export back to a HF folder.

Loading goes tensor by tensor through `safetensors.safe_open`: a stacked parameter is assembled layer by layer
in one preallocated host array, placed on devices with its sharding, and released before the next parameter
is read, so host memory never holds a second full copy of the model (the peak is one stacked parameter).
Every tensor is checked as it is read: its shape, a floating-point dtype (`WEIGHT_DTYPES`; an integer tensor
would be cast into nonsense) and finite values (one host pass over it); the error names the file and the tensor.

Export writes safetensors shards, `config.json` and the tokenizer files into a temporary folder next to the
destination and renames it into place: a failure leaves nothing half-written.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from feynrl_jax.checkpoints.hf_names import TensorMapping, get_path, hf_tensors, set_path, tensor_mappings
from feynrl_jax.errors import InputError
from feynrl_jax.models.config import ModelConfig
from feynrl_jax.models.decoder import Params
from feynrl_jax.sharding.placement import place_tree

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
)


# Safetensors dtypes a weight may be stored in; anything else (integers, bool, FP8 without its scales) would be
# cast to the param dtype into meaningless numbers.
WEIGHT_DTYPES = ("F16", "BF16", "F32", "F64")


class CheckpointError(InputError, ValueError):
    """A checkpoint file is missing, truncated or holds a tensor of the wrong shape, dtype or values.

    The message names the file and the tensor.
    """


def nonfinite(array: np.ndarray) -> bool:
    """Whether a host array holds a NaN or an infinity (bfloat16 by its exponent bits; integers never)."""
    if array.dtype == jnp.bfloat16:
        # Exponent all ones: infinity or NaN. ml_dtypes' isfinite is a slow Python-level ufunc.
        return bool(array.size) and bool((array.view(np.uint16) & 0x7FFF).max() >= 0x7F80)
    if not np.issubdtype(array.dtype, np.inexact):
        return False
    return not bool(np.isfinite(array).all())


class _TensorIndex:
    """Which file holds each tensor of a HF folder, with open handles cached per file."""

    def __init__(self, folder: str):
        self.folder = folder
        self._handles: dict[str, Any] = {}
        index_path = os.path.join(folder, INDEX_FILE)
        single = os.path.join(folder, SINGLE_FILE)
        if os.path.isfile(index_path):
            with open(index_path) as f:
                try:
                    self.weight_map: dict[str, str] = json.load(f)["weight_map"]
                except (json.JSONDecodeError, KeyError) as e:
                    raise CheckpointError(f"{index_path}: not a safetensors index ({e})") from e
            for shard in sorted(set(self.weight_map.values())):
                if not os.path.isfile(os.path.join(folder, shard)):
                    held = sorted(name for name, file in self.weight_map.items() if file == shard)
                    shown = ", ".join(held[:16]) + (f", ... ({len(held)} in all)" if len(held) > 16 else "")
                    raise CheckpointError(
                        f"missing shard {os.path.join(folder, shard)} (listed in {index_path} for tensors: {shown})"
                    )
        elif os.path.isfile(single):
            handle = self._open(SINGLE_FILE)
            self.weight_map = {name: SINGLE_FILE for name in handle.keys()}
        else:
            raise CheckpointError(f"{folder}: no {SINGLE_FILE} or {INDEX_FILE}")

    def _open(self, file: str):
        if file not in self._handles:
            path = os.path.join(self.folder, file)
            try:
                self._handles[file] = safe_open(path, framework="numpy")
            except (SafetensorError, OSError) as e:
                raise CheckpointError(f"{path}: cannot read safetensors file ({e})") from e
        return self._handles[file]

    def __contains__(self, name: str) -> bool:
        return name in self.weight_map

    def read(self, name: str, expected_shape: tuple[int, ...]) -> np.ndarray:
        """Reads one tensor, checking its shape, dtype (`WEIGHT_DTYPES`) and values (all finite).

        Errors name the file and the tensor.
        """
        if name not in self.weight_map:
            files = sorted(set(self.weight_map.values()))
            raise CheckpointError(f"tensor {name!r} not found in {self.folder} (files: {files})")
        file = self.weight_map[name]
        path = os.path.join(self.folder, file)
        handle = self._open(file)
        try:
            view = handle.get_slice(name)
            shape, dtype = tuple(view.get_shape()), view.get_dtype()
        except SafetensorError as e:
            raise CheckpointError(f"{path}: tensor {name!r} is listed in the index but not in the file ({e})") from e
        if shape != tuple(expected_shape):
            raise CheckpointError(f"{path}: tensor {name!r} has shape {shape}, expected {tuple(expected_shape)}")
        if dtype not in WEIGHT_DTYPES:
            raise CheckpointError(
                f"{path}: tensor {name!r} has dtype {dtype}; weights must be floating point "
                f"({', '.join(WEIGHT_DTYPES)})"
            )
        try:
            tensor = handle.get_tensor(name)
        except (SafetensorError, OSError, ValueError) as e:
            raise CheckpointError(f"{path}: cannot read tensor {name!r} ({e})") from e
        if nonfinite(tensor):
            raise CheckpointError(f"{path}: tensor {name!r} holds NaN or infinite values")
        return tensor


def _place(array: np.ndarray, sharding) -> jax.Array:
    """On this process's first device, or at `sharding` (which may span several processes: each one, holding the
    same file, copies only its devices' shards)."""
    return jax.device_put(array) if sharding is None else place_tree(array, sharding)


def load_hf(
    path: str | os.PathLike,
    *,
    config: ModelConfig | None = None,
    shardings: Any = None,
    **config_overrides,
) -> tuple[Params, ModelConfig]:
    """Loads a Hugging Face checkpoint folder into our params pytree.

    Args:
        path: a folder with `config.json` and `model.safetensors` or `model.safetensors.index.json` + shards.
        config: the model config; read from `config.json` (with `config_overrides`) when None.
        shardings: None (default device), or a pytree matching the params whose leaves are
            `jax.sharding.Sharding` (or None for the default device).
        **config_overrides: passed to `ModelConfig.from_hf`, e.g. `param_dtype="bfloat16"`.

    Returns:
        `(params, config)`; params in `config.param_dtype`, placed with `shardings`.

    Raises:
        CheckpointError: missing shard, missing/truncated file, missing tensor, wrong shape, a dtype that is not
            floating point, NaN or infinite values (the message names the file and the first such tensor).
        ValueError: unknown architecture in `config.json`.
    """
    folder = os.fspath(path)
    if config is None:
        config = ModelConfig.from_hf(folder, **config_overrides)
    index = _TensorIndex(folder)
    dtype = np.dtype(jnp.dtype(config.param_dtype))
    params: dict = {}
    for m in tensor_mappings(config):
        sharding = None if shardings is None else get_path(shardings, m.path)
        set_path(params, m.path, _place(_read_param(index, m, config, dtype), sharding))
    return params, config


def _read_param(index: _TensorIndex, m: TensorMapping, config: ModelConfig, dtype: np.dtype) -> np.ndarray:
    """One parameter as a host array of our shape (stacked layers assembled in place)."""
    if not m.stacked:
        return np.ascontiguousarray(m.to_ours(index.read(m.hf_name, m.hf_shape)).astype(dtype))
    out = np.empty((config.num_layers, *m.shape), dtype)
    for i in range(config.num_layers):
        out[i] = m.to_ours(index.read(m.hf_name.format(i=i), m.hf_shape))
    return out


def export_hf(
    params: Params | None,
    model_config: ModelConfig,
    out_dir: str | os.PathLike,
    tokenizer_dir: str | os.PathLike | None = None,
    *,
    max_shard_bytes: int = 4 * 2**30,
    extra_config: Mapping[str, Any] | None = None,
) -> str:
    """Writes params as a Hugging Face folder that `transformers.AutoModelForCausalLM.from_pretrained` loads.

    Params with LoRA adapters (`model_config.lora_rank`) are written merged (`lora.merge`), as the base
    architecture. Tensors are written in `model_config.param_dtype`, sharded into files of at most
    `max_shard_bytes` (with `model.safetensors.index.json` when there is more than one). Everything goes to a
    temporary folder in the same parent, renamed into place at the end; an existing `out_dir` is replaced only then.

    Args:
        params: the params pytree (any placement; each leaf is fetched to host one at a time), or None for a
            folder without weights (config and tokenizer only: what an engine that receives its weights from
            the trainer, such as `VLLMEngine` with `load_format="dummy"`, starts from).
        model_config: the model config (written as `config.json`).
        out_dir: destination folder.
        tokenizer_dir: a folder whose tokenizer files (tokenizer.json, tokenizer_config.json, chat template,
            ...) are copied, or None.
        max_shard_bytes: largest safetensors file.
        extra_config: keys added to `config.json`.

    Returns:
        The destination folder.
    """
    if model_config.lora_rank:  # LoRA adapters folded into their kernels: a plain model of the base's shape
        from feynrl_jax.models import lora

        if params is not None:  # on the host's CPU, like the rest of the export
            with jax.default_device(jax.local_devices(backend="cpu")[0]):
                params = lora.merge(params, model_config)
        model_config = model_config.without_lora()
    out_dir = os.path.abspath(os.fspath(out_dir))
    parent = os.path.dirname(out_dir)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(out_dir)}.tmp-", dir=parent)
    try:
        if params is not None:
            _write_tensors(params, model_config, tmp, max_shard_bytes)
        hf_config = {**model_config.to_hf(), **dict(extra_config or {})}
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(hf_config, f, indent=2, sort_keys=True)
        if tokenizer_dir is not None:
            copied = [n for n in TOKENIZER_FILES if os.path.isfile(os.path.join(tokenizer_dir, n))]
            if not any(n in copied for n in ("tokenizer.json", "tokenizer.model", "vocab.json")):
                raise FileNotFoundError(f"tokenizer_dir {tokenizer_dir} holds no tokenizer files ({TOKENIZER_FILES})")
            for name in copied:
                shutil.copy2(os.path.join(tokenizer_dir, name), os.path.join(tmp, name))
        _swap_into_place(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def _swap_into_place(tmp: str, out_dir: str) -> None:
    """Renames `tmp` to `out_dir`; an existing `out_dir` is moved aside first and deleted after."""
    if not os.path.exists(out_dir):
        os.rename(tmp, out_dir)
        return
    old = tempfile.mkdtemp(prefix=f".{os.path.basename(out_dir)}.old-", dir=os.path.dirname(out_dir))
    os.rmdir(old)
    os.rename(out_dir, old)
    try:
        os.rename(tmp, out_dir)
    except BaseException:
        os.rename(old, out_dir)
        raise
    shutil.rmtree(old, ignore_errors=True)


def _write_tensors(params: Params, config: ModelConfig, folder: str, max_shard_bytes: int) -> None:
    dtype = np.dtype(jnp.dtype(config.param_dtype))
    shard: dict[str, np.ndarray] = {}
    shard_bytes = 0
    files: list[dict[str, Any]] = []
    weight_map: dict[str, int] = {}

    def flush():
        nonlocal shard, shard_bytes
        if shard:
            files.append(_save_shard(shard, folder, len(files)))
            shard, shard_bytes = {}, 0

    for name, tensor in hf_tensors(params, config, dtype):
        if shard_bytes + tensor.nbytes > max_shard_bytes:
            flush()
        shard[name] = tensor
        shard_bytes += tensor.nbytes
        weight_map[name] = len(files)
    flush()
    if len(files) == 1:
        os.rename(os.path.join(folder, files[0]["file"]), os.path.join(folder, SINGLE_FILE))
        return
    names = [f"model-{i + 1:05d}-of-{len(files):05d}.safetensors" for i in range(len(files))]
    for info, name in zip(files, names):
        os.rename(os.path.join(folder, info["file"]), os.path.join(folder, name))
    index = {
        "metadata": {"format": "pt", "total_size": sum(info["bytes"] for info in files)},
        "weight_map": {tensor: names[i] for tensor, i in sorted(weight_map.items())},
    }
    with open(os.path.join(folder, INDEX_FILE), "w") as f:
        json.dump(index, f, indent=2)


def _save_shard(shard: dict[str, np.ndarray], folder: str, number: int) -> dict[str, Any]:
    file = f"shard-{number}.safetensors"
    save_file(shard, os.path.join(folder, file), metadata={"format": "pt"})
    return {"file": file, "bytes": sum(t.nbytes for t in shard.values())}
