"""Prompt prefill over length buckets.

A prompt's KV is computed by one forward pass over the prompt minus its last token (the decode step feeds the
last token and samples the first completion token, so every sampled token comes from the same code path).
The pass is padded to a bucket length, a power of two, so only a handful of shapes is ever compiled.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from feynrl_jax.models import KVCache, ModelConfig, forward, init_cache


def bucket_lengths(min_bucket: int, max_len: int) -> tuple[int, ...]:
    """Powers of two from `min_bucket` up to the first one >= `max_len`, the last capped at `max_len`.

    Args:
      min_bucket: smallest bucket, a power of two >= 1.
      max_len: longest prefix to prefill (the cache length).

    Returns:
      Increasing bucket lengths; the last equals `max_len` when `max_len` is not a power of two.
    """
    if min_bucket < 1 or min_bucket & (min_bucket - 1):
        raise ValueError(f"min_bucket must be a power of two >= 1, got {min_bucket}")
    buckets = []
    length = min_bucket
    while length < max_len:
        buckets.append(length)
        length *= 2
    buckets.append(max_len)
    return tuple(buckets)


def pick_bucket(buckets: tuple[int, ...], length: int) -> int:
    """The smallest bucket holding `length` tokens."""
    for bucket in buckets:
        if bucket >= length:
            return bucket
    raise ValueError(f"a prefix of {length} tokens exceeds the largest prefill bucket {buckets[-1]}")


def prefill(params, tokens: jax.Array, lengths: jax.Array, *, config: ModelConfig) -> KVCache:
    """KV of right-padded prompt prefixes (jit with `config` static; one compile per bucket and batch size).

    Args:
      params: model params.
      tokens: `[B, bucket]` int32 prefix tokens, right-padded.
      lengths: `[B]` int32 real tokens per row (padding is not written to the cache).

    Returns:
      `KVCache` with k `[L, B, K, Dh, bucket]` and v `[L, B, K, bucket, Dh]`; entries at or beyond `lengths` are zero.
    """
    batch, bucket = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(bucket, dtype=jnp.int32), (batch, bucket))
    segment_ids = (positions < lengths[:, None]).astype(jnp.int32)
    _, cache = forward(
        params, tokens, positions, config=config, segment_ids=segment_ids, cache=init_cache(config, batch, bucket)
    )
    return cache
