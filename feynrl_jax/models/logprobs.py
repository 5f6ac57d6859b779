"""Per-token log-probabilities (and entropy) of given tokens, without a full float32 `[B, T, V]` array.

The output projection, log-softmax and gather run over chunks of the sequence inside `lax.map`; each chunk
is wrapped in `jax.checkpoint`, so the backward pass recomputes a chunk's logits instead of storing them:
peak memory holds one `[B, chunk, V]` float32 block, not `[B, T, V]`.

A chunk spans all `B` rows and `chunk_positions` columns: at most `chunk_size` columns and at most `chunk_tokens`
token slots (`B x chunk`; at least one column), so its logits stop growing with the rows and columns a pass holds.
Chunks run along the sequence, never across rows, so a batch sharded over its rows stays sharded. These functions see
the global rows: the train step, the RL trainer and the no-grad passes, whose rows are split over a mesh's batch
shards, pass `CHUNK_TOKENS x data x fsdp` (`train.step.mesh_chunk_tokens`), so each batch shard's chunk holds at most
`CHUNK_TOKENS` slots. Measured with XLA's `memory_analysis()` of a SmolLM2-135M forward and backward pass on one
device (32 rows, 96 prompt and 128 or 256 completion columns, `benchmarks/bench_logprob_chunks.py`): 2.00 and 3.80
GiB of temporary buffers with 256-column chunks of all rows, 1.03 and 1.76 GiB with chunks of 1,024 token slots.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from feynrl_jax.models.block_attention import SegmentBounds
from feynrl_jax.models.config import ModelConfig
from feynrl_jax.models.decoder import Params, forward, logits
from feynrl_jax.models.segments import predecessor_index

CHUNK_SIZE = 256
"""The most columns of one chunk of the output projection by default."""
CHUNK_TOKENS = 1024
"""The most token slots (rows x columns) of one chunk of the output projection on one batch shard: 1,024 x a
49,152-token vocabulary is 192 MiB of float32 logits per copy. The functions here take it for all rows together;
callers on a mesh pass `train.step.mesh_chunk_tokens(mesh)`."""


def chunk_positions(rows: int, n: int, chunk_size: int = CHUNK_SIZE, chunk_tokens: int = CHUNK_TOKENS) -> int:
    """Columns per chunk of `token_logprobs_from_hidden` for `rows` rows of `n` columns: at most `chunk_size`
    columns and `chunk_tokens` token slots, at least one column."""
    return max(1, min(chunk_size, n, chunk_tokens // max(rows, 1)))


def token_logprobs_from_hidden(
    params: Params,
    hidden: jax.Array,
    targets: jax.Array,
    *,
    config: ModelConfig,
    temperature: float | jax.Array = 1.0,
    with_entropy: bool = False,
    chunk_size: int = CHUNK_SIZE,
    chunk_tokens: int = CHUNK_TOKENS,
) -> tuple[jax.Array, jax.Array | None]:
    """log p(target | hidden) for every position, chunked over the sequence.

    Args:
        params: the params pytree.
        hidden: `[B, N, D]` final hidden states.
        targets: `[B, N]` int32, the token predicted from each hidden state.
        config: the model config.
        temperature: logits are divided by it before the softmax.
        with_entropy: also return the entropy of each predictive distribution.
        chunk_size: the most positions per chunk.
        chunk_tokens: the most token slots (`B x positions`, all shards together) per chunk (`chunk_positions`).

    Returns:
        `(logprobs [B, N] f32, entropy [B, N] f32 or None)`.
    """
    b, n, d = hidden.shape
    chunk = chunk_positions(b, n, chunk_size, chunk_tokens)
    num_chunks = -(-n // chunk)
    pad = num_chunks * chunk - n
    hidden = jnp.pad(hidden, ((0, 0), (0, pad), (0, 0)))
    targets = jnp.pad(targets, ((0, 0), (0, pad)))
    hidden = hidden.reshape(b, num_chunks, chunk, d).swapaxes(0, 1)
    targets = targets.reshape(b, num_chunks, chunk).swapaxes(0, 1)

    @jax.checkpoint
    def one_chunk(h, t):
        z = logits(params, h, config=config) / temperature
        lse = jax.nn.logsumexp(z, axis=-1)
        lp = jnp.take_along_axis(z, t[..., None], axis=-1)[..., 0] - lse
        if not with_entropy:
            return lp, jnp.zeros_like(lp)
        probs = jnp.exp(z - lse[..., None])
        return lp, lse - jnp.sum(probs * z, axis=-1)

    lp, ent = jax.lax.map(lambda xs: one_chunk(*xs), (hidden, targets))
    lp = lp.swapaxes(0, 1).reshape(b, num_chunks * chunk)[:, :n]
    ent = ent.swapaxes(0, 1).reshape(b, num_chunks * chunk)[:, :n]
    return lp, (ent if with_entropy else None)


def predecessor_hidden(
    hidden: jax.Array, positions: jax.Array, segment_ids: jax.Array | None, first_column: int = 1
) -> tuple[jax.Array, jax.Array]:
    """The hidden state that predicts each token from column `first_column` on, and whether there is one.

    Args:
        hidden: `[B, T, D]` from `forward`.
        positions: `[B, T]` int32.
        segment_ids: `[B, T]` int32 (0 = padding), or None (one segment per row).
        first_column: the first column to return (at least 1).

    Returns:
        `(source [B, T - first_column, D], valid [B, T - first_column] bool)`: inside a segment the previous
        column's state; for the first token of a shared-prefix continuation its prefix's last state
        (`feynrl_jax.models.segments`).
    """
    b, t = positions.shape
    if segment_ids is None:
        return hidden[:, first_column - 1 : -1], jnp.ones((b, t - first_column), bool)
    index = predecessor_index(positions, segment_ids)[:, first_column:]
    source = jnp.take_along_axis(hidden, jnp.maximum(index, 0)[..., None], axis=1)
    return source, index >= 0


def sequence_logprobs(
    params: Params,
    tokens: jax.Array,
    positions: jax.Array,
    *,
    config: ModelConfig,
    segment_ids: jax.Array | None = None,
    temperature: float | jax.Array = 1.0,
    with_entropy: bool = False,
    chunk_size: int = CHUNK_SIZE,
    chunk_tokens: int = CHUNK_TOKENS,
    remat: str | None = None,
    first_column: int = 1,
    dropout_rng: jax.Array | None = None,
    segment_bounds: SegmentBounds | None = None,
    grad_sink: Params | None = None,
) -> tuple[jax.Array, jax.Array | None]:
    """Log-probabilities of `tokens` under the model, aligned with `tokens`.

    `logprobs[b, t] = log p(tokens[b, t] | its context)` at `temperature`: the tokens before it in its segment,
    behind its shared prefix for a continuation segment (`feynrl_jax.models.segments`). Entry 0, the first
    token of every ordinary packed segment, padding (segment id 0) and the columns before `first_column` hold 0.
    `entropy[b, t]` is the entropy of the distribution that token `t` was drawn from, aligned (and zeroed) the
    same way.

    Args:
        params: the params pytree.
        tokens: `[B, T]` int32.
        positions: `[B, T]` int32.
        config: the model config.
        segment_ids: `[B, T]` int32 (0 = padding) or None.
        temperature: logits are divided by it before the softmax.
        with_entropy: also compute the entropy.
        chunk_size: the most sequence positions per chunk of the output projection.
        chunk_tokens: the most token slots (rows x positions, all shards together) per chunk (`chunk_positions`).
        remat: rematerialisation policy passed to `forward`.
        first_column: static; no token before this column is scored (an RL batch whose completions all start
            at or after a known column skips the output projection over its prompts).
        dropout_rng: `forward`'s LoRA dropout key (training passes), or None.
        segment_bounds: `forward`'s static bounds on the rows' segments (blocked attention), or None.
        grad_sink: `forward`'s accumulator of the layers' gradient (one training pass under `jax.grad`), or None.

    Returns:
        `(logprobs [B, T] f32, entropy [B, T] f32 or None)`.
    """
    hidden, _ = forward(
        params,
        tokens,
        positions,
        config=config,
        segment_ids=segment_ids,
        remat=remat,
        dropout_rng=dropout_rng,
        segment_bounds=segment_bounds,
        grad_sink=grad_sink,
    )
    b, t = tokens.shape
    start = max(1, first_column)
    if t <= start:
        zeros = jnp.zeros((b, t), jnp.float32)
        return zeros, (zeros if with_entropy else None)
    source, valid = predecessor_hidden(hidden, positions, segment_ids, start)
    lp, ent = token_logprobs_from_hidden(
        params,
        source,
        tokens[:, start:],
        config=config,
        temperature=temperature,
        with_entropy=with_entropy,
        chunk_size=chunk_size,
        chunk_tokens=chunk_tokens,
    )
    first = jnp.zeros((b, start), jnp.float32)
    lp = jnp.concatenate([first, jnp.where(valid, lp, 0.0)], axis=1)
    if with_entropy:
        ent = jnp.concatenate([first, jnp.where(valid, ent, 0.0)], axis=1)
    return lp, ent
