"""QLoRA's frozen 4-bit base: NF4 block quantization of the projection kernels, dequantized where they are used.

QLoRA (Dettmers et al., 2023, "QLoRA: Efficient Finetuning of Quantized LLMs", arXiv:2305.14314) trains LoRA
adapters on a base whose weights are stored in 4-bit NormalFloat (NF4): each block of `block` consecutive weights
is divided by its absolute maximum and every value is replaced by the nearest of 16 levels, the quantiles of a
standard normal distribution rescaled to [-1, 1] with an exact zero (`NF4_LEVELS`, the paper's table). The
adapters, the embedding, the norms and the LM head stay in their dtype; the block scales (`absmax`) are float32 (the
paper's second quantization of the scales is not applied: it saves 0.37 bits per weight more).

Layout (`model.lora.quantize_base = "nf4"`, `ModelConfig.lora_quantize_base`): each of the seven projection kernels
`[L, *inputs, *outputs]` is replaced by

| leaf | shape | dtype | logical axes |
|---|---|---|---|
| `kernel_nf4` | `[L, *inputs, *outputs[:-1], last / 2]` | uint8, two 4-bit codes per byte | the kernel's |
| `kernel_absmax` | `[L, *inputs, *outputs[:-1], last / block]` | float32 | the kernel's, the last `quant_blocks` |

with blocks along the last output axis (`last`), `block` its largest divisor up to 64 (QLoRA's block size). A
weight costs 4 + 32 / block bits (4.5 at block 64) instead of 16 (bfloat16) or 32. The model dequantizes a kernel
inside the layer that uses it (`dequantize`, under the scanned layers: one layer's kernel at a time, in the compute
dtype); at rest (state, checkpoints, weight syncs) the base is NF4. In a train step without rematerialisation the
backward pass keeps each layer's dequantized kernels as residuals; `remat` "dots" or "full" recomputes them.
Gradients reach the adapters only.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

NF4_LEVELS = np.array(
    [
        -1.0,
        -0.6961928009986877,
        -0.5250730514526367,
        -0.39491748809814453,
        -0.28444138169288635,
        -0.18477343022823334,
        -0.09105003625154495,
        0.0,
        0.07958029955625534,
        0.16093020141124725,
        0.24611230194568634,
        0.33791524171829224,
        0.44070982933044434,
        0.5626170039176941,
        0.7229568362236023,
        1.0,
    ],
    np.float32,
)
"""The 16 NF4 levels of QLoRA (Dettmers et al., 2023, appendix E): normal quantiles scaled to [-1, 1], zero exact."""

QUANTIZATIONS = ("nf4",)
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""The kernels a quantized base stores in NF4 (every projection of a layer; embedding, norms and LM head stay)."""
MAX_BLOCK = 64


def block_size(last: int) -> int:
    """The NF4 block of a kernel whose last axis has `last` entries: its largest divisor up to 64."""
    return max(b for b in range(1, min(MAX_BLOCK, last) + 1) if last % b == 0)


def quantized_shapes(kernel_shape: tuple[int, ...]) -> dict[str, tuple[int, ...]]:
    """`{"kernel_nf4": shape, "kernel_absmax": shape}` of a kernel of `kernel_shape` (last axis even)."""
    *lead, last = kernel_shape
    return {"kernel_nf4": (*lead, last // 2), "kernel_absmax": (*lead, last // block_size(last))}


def is_quantized(proj: dict) -> bool:
    """Whether a projection's params hold an NF4 kernel."""
    return "kernel_nf4" in proj


def quantize(kernel: jax.Array) -> dict[str, jax.Array]:
    """NF4 codes (two per byte) and float32 block scales of `kernel` (blocks along its last axis).

    Each block is divided by its absolute maximum (a block of zeros by 1) and each value takes the code of the
    nearest NF4 level; the low nibble of a byte holds the even entry.
    """
    *lead, last = kernel.shape
    block = block_size(last)
    x = kernel.astype(jnp.float32).reshape(*lead, last // block, block)
    absmax = jnp.max(jnp.abs(x), axis=-1)
    scaled = x / jnp.where(absmax > 0, absmax, 1.0)[..., None]
    midpoints = jnp.asarray((NF4_LEVELS[1:] + NF4_LEVELS[:-1]) / 2)
    codes = jnp.searchsorted(midpoints, scaled.reshape(*lead, last)).astype(jnp.uint8)
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return {"kernel_nf4": packed, "kernel_absmax": absmax}


def dequantize(proj: dict, dtype: Any) -> jax.Array:
    """The kernel of an NF4 projection (`quantize`'s leaves) in `dtype`: level times block scale."""
    packed, absmax = proj["kernel_nf4"], proj["kernel_absmax"]
    *lead, half = packed.shape
    last = 2 * half
    codes = jnp.stack([packed & 15, packed >> 4], axis=-1).reshape(*lead, last)
    values = jnp.asarray(NF4_LEVELS)[codes.astype(jnp.int32)]
    blocks = absmax.shape[-1]
    kernel = values.reshape(*lead, blocks, last // blocks) * absmax[..., None].astype(jnp.float32)
    return kernel.reshape(*lead, last).astype(dtype)


def kernel(proj: dict, dtype: Any) -> jax.Array:
    """A projection's kernel in `dtype`, dequantized when it is stored in NF4."""
    if is_quantized(proj):
        return dequantize(proj, dtype)
    return proj["kernel"].astype(dtype)


def quantize_base(params: dict) -> dict:
    """`params` with every projection kernel replaced by its NF4 leaves (other leaves, adapters included, kept)."""
    layers = dict(params["layers"])
    for name in PROJECTIONS:
        proj = dict(layers[name])
        proj.update(quantize(proj.pop("kernel")))
        layers[name] = proj
    return {**params, "layers": layers}


def dequantize_base(params: dict, dtype: Any) -> dict:
    """`params` with every NF4 kernel dequantized to a `kernel` in `dtype` (the inverse layout of `quantize_base`;
    the values are the NF4 levels times the block scales). Params without NF4 kernels are returned as they are."""
    layers = params.get("layers")
    if not isinstance(layers, dict) or not any(is_quantized(p) for p in layers.values() if isinstance(p, dict)):
        return params
    layers = dict(layers)
    for name, proj in layers.items():
        if isinstance(proj, dict) and is_quantized(proj):
            rest = {k: v for k, v in proj.items() if k not in ("kernel_nf4", "kernel_absmax")}
            layers[name] = {**rest, "kernel": dequantize(proj, dtype)}
    return {**params, "layers": layers}


def kernel_shardings(shardings: dict) -> dict:
    """The shardings of a quantized base's params (`quantize_base`'s layout) for the same params dequantized: each
    projection's `kernel_nf4` sharding becomes its `kernel`'s (the same logical axes, and a split that divides the
    halved last axis divides the whole one), `kernel_absmax` goes. Unquantized shardings are returned as they are."""
    layers = shardings.get("layers")
    if not isinstance(layers, dict) or not any(is_quantized(p) for p in layers.values() if isinstance(p, dict)):
        return shardings
    layers = dict(layers)
    for name, proj in layers.items():
        if isinstance(proj, dict) and is_quantized(proj):
            rest = {k: v for k, v in proj.items() if k not in ("kernel_nf4", "kernel_absmax")}
            layers[name] = {**rest, "kernel": proj["kernel_nf4"]}
    return {**shardings, "layers": layers}


def is_quant_path(path: tuple[Any, ...]) -> bool:
    """Whether a params key path is an NF4 leaf (`kernel_nf4` or `kernel_absmax`)."""
    last = path[-1] if path else None
    return getattr(last, "key", None) in ("kernel_nf4", "kernel_absmax")
