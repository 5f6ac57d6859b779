"""Checkpoint I/O: Hugging Face safetensors in and out, GGUF import, local tokenizers.

`load_hf`, `export_hf`, `convert_gguf`, `find_smollm2_gguf`, `smollm2_checkpoint_dir`, `load_tokenizer`.
The orbax train-state checkpoints live in their own module.
"""

from feynrl_jax.checkpoints.gguf_import import convert_gguf, find_smollm2_gguf, smollm2_checkpoint_dir
from feynrl_jax.checkpoints.hf_names import TensorMapping, tensor_mappings
from feynrl_jax.checkpoints.hf_safetensors import CheckpointError, export_hf, load_hf
from feynrl_jax.checkpoints.tokenizer import load_tokenizer

__all__ = [
    "CheckpointError",
    "TensorMapping",
    "convert_gguf",
    "export_hf",
    "find_smollm2_gguf",
    "load_hf",
    "load_tokenizer",
    "smollm2_checkpoint_dir",
    "tensor_mappings",
]
