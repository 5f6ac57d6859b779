"""Rotary position embeddings (RoPE) and their context-extension variants.

References:
    Su et al., "RoFormer: Enhanced Transformer with Rotary Position Embedding", 2021 (arXiv:2104.09864).
    Chen et al., "Extending Context Window of Large Language Models via Positional Interpolation", 2023
    (arXiv:2306.15595): the "linear" variant.
    Peng et al., "YaRN: Efficient Context Window Extension of Large Language Models", 2023 (arXiv:2309.00071).
    Llama 3 team, "The Llama 3 Herd of Models", 2024 (arXiv:2407.21783): the "llama3" frequency smoothing.

The rotation pairs dimension `i` with `i + Dh/2` (the "rotate half" layout of Hugging Face checkpoints), not
adjacent dimensions as in the paper; GGUF files store q/k rows permuted for the interleaved layout, and the
GGUF importer undoes that permutation.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

from feynrl_jax.models.config import ModelConfig


def inverse_frequencies(config: ModelConfig) -> tuple[np.ndarray, float]:
    """The RoPE inverse frequencies and the cos/sin scale (YaRN's attention factor, else 1).

    Computed in float32 exactly as transformers does, so positions rotate identically.

    Args:
        config: the model config (`head_dim`, `rope_theta`, `rope_scaling`).

    Returns:
        `(inv_freq [Dh/2] float32, attention_factor)`.
    """
    dim = config.head_dim
    base = np.float32(config.rope_theta)
    exponents = np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / np.float32(dim)
    inv_freq = (np.float32(1.0) / (base**exponents)).astype(np.float32)
    scaling = config.rope_scaling_dict()
    if scaling is None:
        return inv_freq, 1.0
    rope_type = scaling["rope_type"]
    if rope_type == "linear":
        return (inv_freq / np.float32(scaling["factor"])).astype(np.float32), 1.0
    if rope_type == "llama3":
        return _llama3_frequencies(inv_freq, scaling), 1.0
    if rope_type == "yarn":
        return _yarn_frequencies(config, scaling)
    raise ValueError(f"unsupported rope_type {rope_type!r}")


def _llama3_frequencies(inv_freq: np.ndarray, scaling: dict) -> np.ndarray:
    """Llama 3.1: long wavelengths divided by `factor`, short kept, the band between smoothly interpolated."""
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = (2 * math.pi / inv_freq).astype(np.float32)
    scaled = np.where(wavelen > low_wavelen, inv_freq / np.float32(factor), inv_freq).astype(np.float32)
    smooth = ((old_len / wavelen - low) / (high - low)).astype(np.float32)
    smoothed = (1 - smooth) * scaled / np.float32(factor) + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def _yarn_frequencies(config: ModelConfig, scaling: dict) -> tuple[np.ndarray, float]:
    """YaRN: ramp between interpolated and extrapolated frequencies; cos/sin scaled by the attention factor."""
    dim, base = config.head_dim, config.rope_theta
    factor = scaling.get("factor")
    old_len = scaling["original_max_position_embeddings"]
    if factor is None:
        factor = config.max_position_embeddings / old_len

    def mscale(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attention_factor = mscale(factor, m) / mscale(factor, m_all) if (m and m_all) else mscale(factor)
    beta_fast = scaling.get("beta_fast") or 32
    beta_slow = scaling.get("beta_slow") or 1

    def correction_dim(rotations):
        return (dim * math.log(old_len / (rotations * 2 * math.pi))) / (2 * math.log(base))

    lo, hi = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, dim - 1)
    if lo == hi:
        hi += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - lo) / (hi - lo), 0, 1).astype(np.float32)
    pos_freqs = np.float32(base) ** (np.arange(0, dim, 2).astype(np.float32) / np.float32(dim))
    extrapolation = 1 - ramp
    inv = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv.astype(np.float32), float(attention_factor)


def rope_cos_sin(positions: jnp.ndarray, config: ModelConfig) -> tuple[jnp.ndarray, jnp.ndarray]:
    """cos and sin tables for the given positions.

    Args:
        positions: `[B, T]` int32.
        config: the model config.

    Returns:
        `(cos, sin)`, each `[B, T, Dh]` float32 (the half-width table repeated twice).
    """
    inv_freq, attention_factor = inverse_frequencies(config)
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)[None, None, :]
    angles = jnp.concatenate([angles, angles], axis=-1)
    return jnp.cos(angles) * attention_factor, jnp.sin(angles) * attention_factor


def apply_rope(x: jnp.ndarray, cos: jnp.ndarray, sin: jnp.ndarray) -> jnp.ndarray:
    """Rotates query or key heads.

    Args:
        x: `[B, T, N, Dh]` (N heads), any float dtype.
        cos, sin: `[B, T, Dh]` float32 from `rope_cos_sin`.

    Returns:
        `[B, T, N, Dh]` in the dtype of `x`, computed in float32 (or wider) and rounded once: in bfloat16 each of the
        rotation's operations had rounded to bfloat16, and XLA:CPU widened and narrowed around every one of them
        (`decoder.rms_norm` has the figures).
    """
    half = x.shape[-1] // 2
    wide = x.astype(jnp.promote_types(x.dtype, jnp.float32))
    rotated = jnp.concatenate([-wide[..., half:], wide[..., :half]], axis=-1)
    return (wide * cos[:, :, None, :] + rotated * sin[:, :, None, :]).astype(x.dtype)
