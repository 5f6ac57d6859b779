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

import jax
import jax.numpy as jnp

from feynrl_jax.kernels import onednn
from feynrl_jax.models.segments import prefix_visible

_MASKED = -1e30


def packed_mask(positions: jnp.ndarray, segment_ids: jnp.ndarray | None, window: jnp.ndarray | None) -> jnp.ndarray:
    """The mask of a forward pass without a cache: causal, within one segment, inside the window.

    A continuation segment (one whose positions do not start at 0, `feynrl_jax.models.segments`) also sees the
    tokens of its shared prefix.

    Args:
        positions: `[B, T]` int32, restarting at 0 in every segment (a continuation goes on from its prefix).
        segment_ids: `[B, T]` int32 (0 = padding, never attended to), or None (one segment per row).
        window: scalar int32; keys with `q_pos - k_pos >= window` are masked. A huge value disables it.

    Returns:
        `[B, T, T]` bool, True where query `t` (axis 1) may attend to key `s` (axis 2).
    """
    t = positions.shape[1]
    idx = jnp.arange(t)
    mask = (idx[None, :] <= idx[:, None])[None]
    if segment_ids is not None:
        same = (segment_ids[:, :, None] == segment_ids[:, None, :]) & (segment_ids[:, None, :] != 0)
        mask = mask & (same | prefix_visible(positions, segment_ids))
    if window is not None:
        mask = mask & within_window(positions, window)
    return mask


def within_window(positions: jnp.ndarray, window: jnp.ndarray, key_positions: jnp.ndarray | None = None) -> jnp.ndarray:
    """`[B, T, S]` bool: key `s` is less than `window` positions behind query `t` (sliding-window attention); the
    keys are the queries (`S = T`) unless `key_positions [B, S]` are given."""
    keys = positions if key_positions is None else key_positions
    return (positions[:, :, None] - keys[:, None, :]) < window


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


def round_to(x: jnp.ndarray, dtype) -> jnp.ndarray:
    """`x` rounded to the precision of the narrower float `dtype`, kept in its own dtype. `lax.reduce_precision`,
    not a pair of casts: XLA may drop a narrowing cast that is cast back (`xla_allow_excess_precision`)."""
    info = jnp.finfo(dtype)
    return jax.lax.reduce_precision(x, exponent_bits=info.nexp, mantissa_bits=info.nmant)


def attend(
    q: jnp.ndarray,
    k: jnp.ndarray,
    v: jnp.ndarray,
    mask: jnp.ndarray,
    use_onednn: bool = False,
    length: int | None = None,
) -> jnp.ndarray:
    """Scaled dot-product attention; the softmax runs in float32.

    Args:
        q: `[B, T, H, Dh]` queries (RoPE applied).
        k: `[B, K, Dh, S]` keys, transposed (the KV cache's layout), K dividing H (query head `h` uses key head
            `h // (H / K)`); q's dtype or a wider one (`decoder.cache_dtype`) holding values of q's dtype.
        v: `[B, K, S, Dh]` values, in k's dtype.
        mask: `[B, T, S]` bool, True where attending is allowed (`[B, T, length]` with `length`).
        use_onednn: the two batched products run in oneDNN (`feynrl_jax.kernels.onednn`, the decoder's
            `model.cpu_matmul` choice) when q, k and v share one dtype (bfloat16 or float32): scores accumulate in
            float32 as XLA's do (bfloat16 on the CPU's bf16 instructions instead of XLA:CPU's float32 rate). A wider
            cache than q keeps XLA.
        length: attend to the first `length` of the S positions of k and v only (static; a KV cache of which the
            queries reach no further), or None: all S. oneDNN's float32 products read that prefix where it lies
            (`onednn.cache_dot`); XLA's, and oneDNN's bfloat16 ones, read a copy of it. (On the AVX2 EPYC, oneDNN
            ran the strided float32 products with the same implementation as dense ones; bfloat16 products run only on
            CPUs with bf16 instructions, where reading them strided has not been measured.)

    Returns:
        `[B, T, H, Dh]` in the dtype of `q`.
    """
    b, t, h, dh = q.shape
    kv_heads = k.shape[1]
    g = h // kv_heads
    # [B, K, G*T, Dh] x [B, K, Dh, S]: one batched matrix product per KV head, the G query heads that share it
    # stacked along the rows. Head-major operands let XLA:CPU run plain batched GEMMs, forward and backward
    # (about 2x faster than the equivalent 5-D einsum on CPU; keys as [Dh, S] halve decode attention again).
    q = q.reshape(b, t, kv_heads, g, dh).transpose(0, 2, 3, 1, 4).reshape(b, kv_heads, g * t, dh)
    kernel = use_onednn and q.dtype == k.dtype == v.dtype
    in_place = kernel and q.dtype == jnp.float32 and length is not None and length < k.shape[3]
    if length is not None and not in_place:
        k, v = k[..., :length], v[..., :length, :]
    s = length if in_place else k.shape[3]
    q = q * jnp.asarray(dh**-0.5, q.dtype)
    if in_place:
        scores = onednn.cache_dot(q, k, s, True, jnp.float32)
    elif kernel:
        scores = onednn.dot(q, k, False, jnp.float32)
    else:
        scores = jnp.matmul(q, k, preferred_element_type=jnp.float32)
    scores = scores.reshape(b, kv_heads, g, t, s)
    scores = jnp.where(mask[:, None, None, :, :], scores, _MASKED)
    # The max is only a shift for stability: it cancels in the softmax, so it needs no gradient.
    shift = jax.lax.stop_gradient(jnp.max(scores, axis=-1, keepdims=True))
    probs = jnp.exp(scores - shift)
    probs = probs / jnp.sum(probs, axis=-1, keepdims=True)
    probs = probs.reshape(b, kv_heads, g * t, s)
    # The probabilities are rounded to the compute dtype (q's) also against a wider cache (`decoder.cache_dtype`: a
    # float32 cache of bfloat16 values on a CPU), so the product equals bfloat16 operands widened by XLA:CPU.
    probs = probs.astype(v.dtype) if v.dtype == q.dtype else round_to(probs, q.dtype)
    if in_place:
        out = onednn.cache_dot(probs, v, s, False)
    else:
        out = onednn.dot(probs, v, False, v.dtype) if kernel else jnp.matmul(probs, v)
    return out.reshape(b, kv_heads, g, t, dh).transpose(0, 3, 1, 2, 4).reshape(b, t, h, dh).astype(q.dtype)
