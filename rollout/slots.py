"""The batched decode state: a KV cache with one row ("slot") per running sequence, and slot insertion.

A slot holds one sequence at a time. Inserting a sequence copies its prefilled prompt KV (all prompt tokens but
the last) into the slot's cache row and sets the slot's next input to the last prompt token at its position;
the first decode step then feeds that token and samples the first completion token. Cache entries beyond the
prompt that a previous occupant left behind are never read: a query at position `p` attends to cache indices
`<= p` only, and every index up to `p` has been rewritten by the new occupant by then (the KV cache rule of
docs/CONTRACTS.md).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from feynrl_jax.models import KVCache, ModelConfig, init_cache, write_cache


class DecodeState(NamedTuple):
    """Everything the decode step carries, for `num_slots` slots (a pytree).

    Attributes:
      cache: `KVCache` per layer (`KVCache.unstack`): k a tuple of `L` arrays `[slots, K, Dh, S]`, v of `L`
        arrays `[slots, K, S, Dh]`. Separate arrays let every decode step update and read a layer's cache in
        place; slicing a stacked cache copies the slice.
      tokens: `[slots]` int32, the next input token of each slot (the last sampled one).
      positions: `[slots]` int32, the position of `tokens`.
      active: `[slots]` bool, the slot holds an unfinished sequence.
      generated: `[slots]` int32, completion tokens sampled so far.
      max_new: `[slots]` int32, the completion length cap of the slot's sequence.
      keys: `[slots, 2]` uint32, the sequence's base PRNG key (`sampling.row_keys`).
    """

    cache: KVCache
    tokens: jax.Array
    positions: jax.Array
    active: jax.Array
    generated: jax.Array
    max_new: jax.Array
    keys: jax.Array


def init_state(config: ModelConfig, num_slots: int, cache_len: int) -> DecodeState:
    """An empty state: every slot inactive, the cache zeroed."""
    zeros = jnp.zeros((num_slots,), jnp.int32)
    return DecodeState(
        cache=init_cache(config, num_slots, cache_len).unstack(),
        tokens=zeros,
        positions=zeros,
        active=jnp.zeros((num_slots,), bool),
        generated=zeros,
        max_new=zeros,
        keys=jnp.zeros((num_slots, 2), jnp.uint32),
    )


def insert(
    state: DecodeState,
    slot: jax.Array,
    last_token: jax.Array,
    prompt_length: jax.Array,
    max_new: jax.Array,
    key: jax.Array,
) -> DecodeState:
    """Makes `slot` hold one sequence whose prompt KV is in place (`insert_prefix`, every layer); jit with the state
    donated, or only its per-slot fields (`cache=None`: the native engine's way, so the program writes no cache
    array). The slot index is traced: no recompiles.

    Args:
      state: the decode state, or its per-slot fields (`cache=None`).
      slot: scalar int32.
      last_token: scalar int32, the prompt's last token.
      prompt_length: scalar int32, prompt tokens (>= 1).
      max_new: scalar int32, completion length cap.
      key: `[2]` uint32, the sequence's base key.

    Returns:
      The state with the slot active.
    """
    return state._replace(
        tokens=state.tokens.at[slot].set(last_token),
        positions=state.positions.at[slot].set(prompt_length - 1),
        active=state.active.at[slot].set(True),
        generated=state.generated.at[slot].set(0),
        max_new=state.max_new.at[slot].set(max_new),
        keys=state.keys.at[slot].set(key),
    )


def insert_prefix(
    k: jax.Array,
    v: jax.Array,
    prefix: KVCache,
    layer: jax.Array,
    slot: jax.Array,
    row: jax.Array,
    config: ModelConfig | None = None,
) -> tuple[jax.Array, jax.Array]:
    """One layer's cache with that layer of a prompt's KV (row `row` of a prefill's batch) written into row `slot`
    (jit with `k`, `v` donated; the layer, slot and row are traced, so one compiled program serves every layer, slot
    and row of a prefill batch's size).

    One program for every layer, run once per layer: with `insert` beside it, inserting compiled in 0.16 s, where one
    program writing all 30 layers of SmolLM2-135M (and the fields) compiled each write as a kernel of its own: 1.46 s
    at the start of every run (`benchmarks/bench_engine_start.py`, 2-core Intel Xeon).

    Args:
      k: `[slots, K, Dh, S]` the layer's keys; v: `[slots, K, S, Dh]` its values.
      prefix: KV of prompts without their last token, k `[L, B, K, Dh, bucket]` and v `[L, B, K, bucket, Dh]`
        (entries at or beyond `prompt_length - 1` are ignored).
      layer: scalar int32, the layer.
      slot: scalar int32.
      row: scalar int32, the prompt's row in `prefix`.
      config: the model's config, needed for a bfloat16 cache on a CPU: `models.write_cache` writes it (in place by
        the kernel where `cache_dtype` gave it), since XLA:CPU widens a bfloat16 dynamic-update-slice's whole operand
        to float32 and back: the layer's whole cache at every insert.

    Returns:
      `(k, v)` updated.
    """
    new_k = jax.lax.dynamic_slice_in_dim(jax.lax.dynamic_index_in_dim(prefix.k, layer, keepdims=False), row, 1)
    new_v = jax.lax.dynamic_slice_in_dim(jax.lax.dynamic_index_in_dim(prefix.v, layer, keepdims=False), row, 1)
    if k.dtype == jnp.bfloat16 and jax.default_backend() == "cpu":
        if config is None:
            raise ValueError("insert_prefix: a bfloat16 cache on a CPU needs the model's config")
        # [1, K, Dh, P] and [1, K, P, Dh] as [1, P, K, Dh] rows, written at positions 0..P-1 of row `slot`
        written = jnp.arange(new_k.shape[-1], dtype=jnp.int32)[None]
        rows = jnp.reshape(slot, (1,))
        k = write_cache(k, new_k.transpose(0, 3, 1, 2), written, keys=True, config=config, rows=rows)
        v = write_cache(v, new_v.transpose(0, 2, 1, 3), written, keys=False, config=config, rows=rows)
        return k, v
    start = (slot, 0, 0, 0)
    k = jax.lax.dynamic_update_slice(k, new_k.astype(k.dtype), start)
    v = jax.lax.dynamic_update_slice(v, new_v.astype(v.dtype), start)
    return k, v


def deactivate(state: DecodeState, finished: jax.Array) -> DecodeState:
    """Marks slots finished on the host (a stop string) as free: `finished [slots]` bool."""
    return state._replace(active=state.active & ~finished)


def take(state: DecodeState, slots: jax.Array) -> DecodeState:
    """The state of `slots [W]` int32 only, in that order (a gather along every leaf's slot axis): a narrower state
    that decodes the same sequences with smaller products. A slot may repeat; a repeated inactive slot is a filler
    row, since inactive rows neither emit tokens nor write to the cache."""
    return jax.tree.map(lambda leaf: jnp.take(leaf, slots, axis=0), state)
