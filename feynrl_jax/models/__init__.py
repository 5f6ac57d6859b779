"""Decoder-only transformers (Llama, Qwen2, Qwen3, Mistral, SmolLM2) as pure JAX functions over a params dict.

The API (docs/CONTRACTS.md): `ModelConfig`, `init_params`, `placeholder_params`, `forward`, `KVCache`, `init_cache`,
`cache_dtype`, `write_cache` (keys and values into a cache at rows and positions, as `forward` writes them),
`logits`, `sequence_logprobs`, `logical_axes`, `unstack_layers`, `as_param_dtype`, `SegmentBounds` (blocked attention
over packed rows of short segments), `sinks_layer_grads` (whether `forward` can add the layers' gradient into an
accumulator in place, its `grad_sink`).
"""

from feynrl_jax.models.block_attention import SegmentBounds
from feynrl_jax.models.config import ModelConfig
from feynrl_jax.models.decoder import (
    KVCache,
    Params,
    as_param_dtype,
    cache_dtype,
    forward,
    init_cache,
    init_params,
    logits,
    param_shapes,
    placeholder_params,
    sinks_layer_grads,
    unstack_layers,
    write_cache,
)
from feynrl_jax.models.logprobs import predecessor_hidden, sequence_logprobs, token_logprobs_from_hidden
from feynrl_jax.models.partitioning import logical_axes

__all__ = [
    "KVCache",
    "ModelConfig",
    "Params",
    "SegmentBounds",
    "as_param_dtype",
    "cache_dtype",
    "forward",
    "init_cache",
    "init_params",
    "logical_axes",
    "logits",
    "param_shapes",
    "placeholder_params",
    "predecessor_hidden",
    "sequence_logprobs",
    "sinks_layer_grads",
    "token_logprobs_from_hidden",
    "write_cache",
    "unstack_layers",
]
