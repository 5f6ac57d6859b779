"""Grouped-query attention with the two masks the decoder needs: packed sequences and the KV cache.

References:
    Vaswani et al., "Attention Is All You Need", 2017 (arXiv:1706.03762).
    Ainslie et al., "GQA: Training Generalized Multi-Query Transformer Models from Multi-Head Checkpoints",
    2023 (arXiv:2305.13245).
    Beltagy et al., "Longformer", 2020 (arXiv:2004.05150): sliding-window attention as used by Mistral.

Masked scores get a large finite negative value rather than -inf, so a query with nothing to attend to (a
padding token) yields a finite, ignored output instead of NaN (which would poison gradients).
"""

from __future__ import annotations

import jax.numpy as jnp

_MASKED = -1e30


def packed_mask(positions: jnp.ndarray, segment_ids: jnp.ndarray | None, window: jnp.ndarray | None) -> jnp.ndarray:
    """The mask of a forward pass without a cache: causal, within one segment, inside the window.

    Args:
        positions: `[B, T]` int32, restarting at 0 in every segment.
        segment_ids: `[B, T]` int32 (0 = padding, never attended to), or None (one segment per row).
        window: scalar int32; keys with `q_pos - k_pos >= window` are masked. A huge value disables it.

    Returns:
        `[B, T, T]` bool, True where query `t` (axis 1) may attend to key `s` (axis 2).
    """
    t = positions.shape[1]
    idx = jnp.arange(t)
    mask = (idx[None, :] <= idx[:, None])[None]
    if segment_ids is not None:
        same = segment_ids[:, :, None] == segment_ids[:, None, :]
        mask = mask & same & (segment_ids[:, None, :] != 0)
    if window is not None:
        mask = mask & ((positions[:, :, None] - positions[:, None, :]) < window)
    return mask


def cache_mask(positions: jnp.ndarray, cache_len: int, window: jnp.ndarray | None) -> jnp.ndarray:
    """The mask against a KV cache: a query at position `p` sees cache indices `<= p` (inside the window).

    Args:
        positions: `[B, T]` int32 positions of the queries (= their cache indices).
        cache_len: S, the cache length.
        window: scalar int32 sliding window, or None.

    Returns:
        `[B, T, S]` bool.
    """
    idx = jnp.arange(cache_len)[None, None, :]
    mask = idx <= positions[:, :, None]
    if window is not None:
        mask = mask & ((positions[:, :, None] - idx) < window)
    return mask


def attend(q: jnp.ndarray, k: jnp.ndarray, v: jnp.ndarray, mask: jnp.ndarray) -> jnp.ndarray:
    """Scaled dot-product attention; the softmax runs in float32.

    Args:
        q: `[B, T, H, Dh]` queries (RoPE applied).
        k: `[B, S, K, Dh]` keys, K dividing H (query head `h` uses key head `h // (H / K)`).
        v: `[B, S, K, Dh]` values.
        mask: `[B, T, S]` bool, True where attending is allowed.

    Returns:
        `[B, T, H, Dh]` in the dtype of `q`.
    """
    b, t, h, dh = q.shape
    kv_heads = k.shape[2]
    q = q.reshape(b, t, kv_heads, h // kv_heads, dh)
    scores = jnp.einsum("btkgd,bskd->bkgts", q, k, preferred_element_type=jnp.float32)
    scores = scores * (dh**-0.5)
    scores = jnp.where(mask[:, None, None, :, :], scores, _MASKED)
    probs = jnp.exp(scores - jnp.max(scores, axis=-1, keepdims=True))
    probs = probs / jnp.sum(probs, axis=-1, keepdims=True)
    out = jnp.einsum("bkgts,bskd->btkgd", probs.astype(v.dtype), v)
    return out.reshape(b, t, h, dh)
