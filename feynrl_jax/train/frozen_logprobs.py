"""Log-probabilities without gradients, on the training mesh, in bounded memory.

Two uses in RL: the reference model's log-probabilities (``TrainBatch.ref_logprobs``, for a KL penalty) and the
current params' log-probabilities before the update (``TrainBatch.old_logprobs``, the denominator of the PPO
ratio when the behaviour policy's own log-probabilities are not used). Both are a forward pass over the batch;
the batch is processed ``chunk_rows`` rows at a time in a ``lax.map`` so activation memory does not grow with
``B``, and every chunk is spread over all batch-sharded devices (rows are dealt out, see ``microbatch``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding

from feynrl_jax.models import ModelConfig, SegmentBounds, init_params, logical_axes, sequence_logprobs
from feynrl_jax.models.logprobs import CHUNK_SIZE
from feynrl_jax.sharding import batch_size_multiple, param_shardings, replicated
from feynrl_jax.sharding.rules import Rules, batch_pspec
from feynrl_jax.train.microbatch import check_divisible, merge_microbatches, split_microbatches
from feynrl_jax.train.step import mesh_chunk_tokens


def make_logprob_fn(
    config: ModelConfig,
    mesh: Mesh,
    rules: Rules,
    *,
    chunk_rows: int,
    temperature: float = 1.0,
    with_entropy: bool = False,
    seq_chunk_size: int = CHUNK_SIZE,
    first_column: int = 1,
    segment_bounds: SegmentBounds | None = None,
    compiler_options: Mapping[str, Any] | None = None,
) -> Callable[..., tuple[jax.Array, jax.Array | None]]:
    """Builds ``fn(params, tokens, positions, segment_ids) -> (logprobs [B, T] f32, entropy [B, T] f32 | None)``.

    Args:
        config: the model config (the reference model's own config for reference log-probabilities).
        mesh: the mesh the params live on.
        rules: the rules table they are sharded by.
        chunk_rows: rows per forward pass; ``B`` must be a multiple of it and it a multiple of ``data * fsdp``.
        temperature: the sampling temperature (logits are divided by it), as in the train step.
        with_entropy: also return the entropy.
        seq_chunk_size: the most sequence columns per chunk of the output projection; a chunk also holds at most
            ``models.logprobs.CHUNK_TOKENS`` token slots on each batch shard (``train.step.mesh_chunk_tokens``).
        first_column: no token before this column is scored (the shared-prefix layout's prompt width).
        segment_bounds: static bounds on the rows' segments (``models.SegmentBounds``), or None.
        compiler_options: XLA options for the program (see ``make_train_step``).

    Returns:
        A jitted function; its outputs are sharded like the batch, and no gradient flows through them.
    """
    shards = batch_size_multiple(mesh)
    if chunk_rows < 1 or chunk_rows % shards:
        raise ValueError(f"chunk_rows={chunk_rows} must be a positive multiple of data x fsdp = {shards}")
    shapes = jax.eval_shape(functools.partial(init_params, config), jax.random.key(0))
    p_shardings = param_shardings(logical_axes(config), mesh, rules, shapes=shapes)
    rows = NamedSharding(mesh, batch_pspec(2))

    def one_chunk(params: Any, chunk: tuple[jax.Array, jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
        tokens, positions, segment_ids = (jax.lax.with_sharding_constraint(x, rows) for x in chunk)
        lp, ent = sequence_logprobs(
            params,
            tokens,
            positions,
            config=config,
            segment_ids=segment_ids,
            temperature=temperature,
            with_entropy=with_entropy,
            chunk_size=seq_chunk_size,
            chunk_tokens=mesh_chunk_tokens(mesh),
            first_column=first_column,
            segment_bounds=segment_bounds,
        )
        return lp, (ent if with_entropy else jnp.zeros((), jnp.float32))

    def fn(params: Any, tokens: jax.Array, positions: jax.Array, segment_ids: jax.Array):
        params = jax.lax.stop_gradient(params)
        num = tokens.shape[0] // chunk_rows
        chunks = split_microbatches((tokens, positions, segment_ids), num)
        lp, ent = jax.lax.map(functools.partial(one_chunk, params), chunks)
        lp = merge_microbatches(lp)
        return lp, (merge_microbatches(ent) if with_entropy else None)

    jitted = jax.jit(
        fn,
        in_shardings=(p_shardings, rows, rows, rows),
        out_shardings=(rows, rows if with_entropy else replicated(mesh)),
        compiler_options=dict(compiler_options) if compiler_options else None,
    )

    def call(params: Any, tokens: jax.Array, positions: jax.Array, segment_ids: jax.Array):
        if tokens.ndim != 2 or positions.shape != tokens.shape or segment_ids.shape != tokens.shape:
            raise ValueError(
                f"tokens, positions and segment_ids must share one [B, T] shape, got {tokens.shape}, "
                f"{positions.shape}, {segment_ids.shape}"
            )
        if tokens.shape[0] % chunk_rows:
            raise ValueError(f"batch of {tokens.shape[0]} rows is not a multiple of chunk_rows={chunk_rows}")
        check_divisible(tokens.shape[0], tokens.shape[0] // chunk_rows, 1, shards)
        return jitted(params, tokens, positions, segment_ids)

    return call
