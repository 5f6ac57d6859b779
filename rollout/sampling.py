"""Token sampling from logits, returning each token's log-probability under the exact distribution used.

The distribution of one step is built as in Hugging Face `generate` and vLLM: logits / temperature, then
top-k (Fan et al., 2018, "Hierarchical Neural Story Generation"), then top-p / nucleus sampling over the
renormalised top-k distribution (Holtzman et al., 2020, "The Curious Case of Neural Text Degeneration").
The returned log-probability is `log q(token)` where `q` is that truncated, renormalised distribution, i.e.
the behaviour policy an off-policy correction needs. With top-k and top-p off it equals the model's
log-softmax at the temperature, which is what the trainer computes (`feynrl_jax.models.sequence_logprobs`).

Departures, on purpose:
  - Ties at the top-k boundary keep exactly k tokens (Hugging Face keeps every token tied with the k-th);
    ties at the top-p boundary are all kept (the nucleus is {p >= t*}, see `_top_p_mask`).
  - Sampling draws one uniform number per row and inverts the cumulative distribution, instead of adding one
    Gumbel variable per vocabulary entry: far fewer random bits per step for a large vocabulary.
  - Greedy decoding reports `log softmax(logits / temperature)` of the argmax token (the model's
    log-probability), not log 1 = 0 of the degenerate distribution, so a greedy rollout can still be compared
    with the trainer.

Randomness is per row: `row_keys` folds the seed, the request (prompt) index and the sample index into a key,
and `step_keys` folds in the decode step. A sequence therefore draws the same numbers whichever batch slot it
lands in and whatever runs beside it, which keeps continuous batching deterministic.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

_NEG_INF = -jnp.inf


ROW_KEY_BUCKET = 64
"""`row_keys` folds the keys of up to this many rows in one compiled program, of more in one per power of two."""


def row_keys(seed: int, request_ids: Sequence[int] | np.ndarray, sample_ids: Sequence[int] | np.ndarray) -> np.ndarray:
    """Per-sequence base keys: `fold_in(fold_in(PRNGKey(seed), request_id), sample_id)` for each row.

    The rows are padded to `ROW_KEY_BUCKET` (or the power of two above) and folded by one jitted program, so an
    engine compiles it once, not once per batch size: folded eagerly, the two `fold_in`s of every new row count
    were two programs compiled in the middle of a generation (six in a demo run, each taking 0.6-5.7 s on 2 busy
    cores). Each row's key depends on its own ids only, so the padding changes no key.

    Args:
      seed: the sampling seed.
      request_ids: `[B]` non-negative ints, index of each row's prompt.
      sample_ids: `[B]` non-negative ints, index of each row among the samples of its prompt.

    Returns:
      `[B, 2]` uint32 raw keys (on the host).
    """
    request_ids, sample_ids = np.asarray(request_ids, np.uint32), np.asarray(sample_ids, np.uint32)
    if request_ids.shape != sample_ids.shape or request_ids.ndim != 1:
        raise ValueError(f"row_keys: request_ids {request_ids.shape} and sample_ids {sample_ids.shape} must be [B]")
    rows = len(request_ids)
    width = max(ROW_KEY_BUCKET, 1 << max(rows - 1, 0).bit_length())
    pad = lambda ids: np.pad(ids, (0, width - rows))  # noqa: E731
    return np.asarray(_fold_rows(jax.random.PRNGKey(seed), pad(request_ids), pad(sample_ids)))[:rows]


@jax.jit
def _fold_rows(base: jax.Array, request_ids: jax.Array, sample_ids: jax.Array) -> jax.Array:
    fold = lambda r, s: jax.random.fold_in(jax.random.fold_in(base, r), s)  # noqa: E731
    return jax.vmap(fold)(request_ids, sample_ids)


def step_keys(keys: jax.Array, steps: jax.Array) -> jax.Array:
    """Folds each row's decode step (tokens generated so far) into its base key: `[B, 2]`, `[B]` -> `[B, 2]`."""
    return jax.vmap(jax.random.fold_in)(keys, jnp.asarray(steps, jnp.uint32))


def mask_tokens(logits: jax.Array, token_ids: jax.Array, banned: jax.Array) -> jax.Array:
    """Sets `logits[b, token_ids]` to -inf on rows where `banned[b]` (e.g. stop tokens before min_new_tokens).

    Args:
      logits: `[B, V]` float32.
      token_ids: `[S]` int32 ids to mask (may be empty).
      banned: `[B]` bool.

    Returns:
      `[B, V]` float32.
    """
    if token_ids.shape[0] == 0:
        return logits
    current = logits[:, token_ids]
    return logits.at[:, token_ids].set(jnp.where(banned[:, None], _NEG_INF, current))


_BLOCK = 128


def _inclusive_cumsum(x: jax.Array) -> jax.Array:
    """Cumulative sum over the last axis as a matmul with a triangular matrix.

    XLA lowers `jnp.cumsum` to a quadratic reduce-window on CPU; a `[n, n]` triangular matmul over a short axis
    is far cheaper and adds exact zeros for masked entries, so the CDF stays flat across them.
    """
    n = x.shape[-1]
    upper = jnp.triu(jnp.ones((n, n), x.dtype))
    return jnp.matmul(x, upper, precision=jax.lax.Precision.HIGHEST)


def _last_positive(mass: jax.Array) -> jax.Array:
    """`[B, n]` -> `[B]` index of the last entry with positive mass."""
    positions = jnp.arange(mass.shape[-1], dtype=jnp.int32)
    return jnp.max(jnp.where(mass > 0, positions[None], 0), axis=-1)


def _sample_from_logits(logits: jax.Array, uniforms: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Inverse-CDF draw from `softmax(logits)` per row: `[B, V]`, `[B]` -> (index `[B]`, log q `[B]`).

    Two levels (blocks of `_BLOCK` entries, then entries inside the chosen block) keep the work linear in V.
    The first entry whose CDF exceeds `u` always has positive mass (the CDF is flat across zero-mass entries);
    the clamps only guard against rounding pushing `u` past the last positive entry.
    """
    batch, vocab = logits.shape
    logq = jax.nn.log_softmax(logits, axis=-1)
    blocks = -(-vocab // _BLOCK)
    probs = jnp.pad(jnp.exp(logq), ((0, 0), (0, blocks * _BLOCK - vocab))).reshape(batch, blocks, _BLOCK)
    block_mass = probs.sum(axis=-1)  # [B, blocks]
    block_cdf = _inclusive_cumsum(block_mass)
    u = uniforms * block_cdf[:, -1]
    block = jnp.minimum(jnp.sum(block_cdf <= u[:, None], axis=-1).astype(jnp.int32), _last_positive(block_mass))
    inner = jnp.take_along_axis(probs, block[:, None, None], axis=1)[:, 0]  # [B, _BLOCK]
    below = jnp.take_along_axis(block_cdf - block_mass, block[:, None], axis=1)[:, 0]
    inner_cdf = _inclusive_cumsum(inner)
    offset = jnp.sum(inner_cdf <= (u - below)[:, None], axis=-1).astype(jnp.int32)
    offset = jnp.minimum(offset, _last_positive(inner))
    index = block * _BLOCK + offset
    return index, jnp.take_along_axis(logq, index[:, None], axis=-1)[:, 0]


def _top_p_mask(logits: jax.Array, top_p: jax.Array) -> jax.Array:
    """Nucleus truncation: keeps every entry whose probability is >= t*, -inf elsewhere. `[B, V]` -> `[B, V]`.

    t* is the largest probability value such that the entries with probability >= t* hold mass >= top_p, i.e.
    the smallest most-likely set reaching `top_p` (ties with its last member kept). Found exactly, without
    sorting the vocabulary, by bisection on the float32 bit pattern (monotone for non-negative floats): 31
    masked sums instead of a full sort, which XLA on CPU makes very slow for large vocabularies.
    """
    probs = jax.nn.softmax(logits, axis=-1)
    bits = jax.lax.bitcast_convert_type(probs, jnp.int32)
    batch = logits.shape[0]
    lo = jnp.zeros((batch,), jnp.int32)  # mass(p >= lo) >= top_p always (lo = 0 keeps everything)
    hi = jnp.full((batch,), jax.lax.bitcast_convert_type(jnp.float32(1.0), jnp.int32) + 1)  # mass(>= hi) = 0

    def halve(_, bounds):
        lo, hi = bounds
        mid = lo + (hi - lo) // 2
        enough = jnp.sum(jnp.where(bits >= mid[:, None], probs, 0.0), axis=-1) >= top_p
        return jnp.where(enough, mid, lo), jnp.where(enough, hi, mid)

    lo, _ = jax.lax.fori_loop(0, 31, halve, (lo, hi))
    return jnp.where(bits >= lo[:, None], logits, _NEG_INF)


def sample(
    logits: jax.Array,
    keys: jax.Array,
    *,
    temperature: float | jax.Array = 1.0,
    top_k: int = 0,
    top_p: float | jax.Array = 1.0,
    use_top_p: bool | None = None,
    greedy: bool | jax.Array = False,
) -> tuple[jax.Array, jax.Array]:
    """Samples one token per row and returns its log-probability under the exact sampling distribution.

    Args:
      logits: `[B, V]` float32 next-token logits (already masked, e.g. by `mask_tokens`).
      keys: `[B, 2]` uint32, one key per row (see `step_keys`).
      temperature: scalar > 0 (may be traced).
      top_k: static; keep the k most likely tokens, 0 = off.
      top_p: scalar in (0, 1] (may be traced); nucleus mass.
      use_top_p: static; whether to apply top-p. Defaults to `top_p < 1` (then `top_p` must be a Python float).
      greedy: take the argmax. A Python bool is static; a traced bool scalar compiles both ways into one program
        and runs the one it says (`lax.cond`), so that greedy and sampled requests share their programs.

    Returns:
      tokens: `[B]` int32.
      logprobs: `[B]` float32, `log q(token)` with q the distribution described in the module docstring.
    """
    if use_top_p is None:
        use_top_p = float(top_p) < 1.0
    scaled = logits.astype(jnp.float32) / temperature
    if isinstance(greedy, bool):
        return _argmax(scaled) if greedy else _draw(scaled, keys, top_k, top_p, use_top_p)
    draw = functools.partial(_draw, top_k=top_k, top_p=top_p, use_top_p=use_top_p)
    return jax.lax.cond(greedy, lambda scaled, _: _argmax(scaled), draw, scaled, keys)


def _argmax(scaled: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Greedy: the argmax of `[B, V]` tempered logits and its log-probability under their softmax."""
    tokens = jnp.argmax(scaled, axis=-1).astype(jnp.int32)
    logq = jax.nn.log_softmax(scaled, axis=-1)
    return tokens, jnp.take_along_axis(logq, tokens[:, None], axis=-1)[:, 0]


def _draw(
    scaled: jax.Array, keys: jax.Array, top_k: int, top_p: float | jax.Array, use_top_p: bool
) -> tuple[jax.Array, jax.Array]:
    """A draw from `[B, V]` tempered logits truncated by top-k and top-p, and its log q (see `sample`)."""
    uniforms = jax.vmap(lambda k: jax.random.uniform(k, dtype=jnp.float32))(keys)
    if top_k and top_k < scaled.shape[-1]:
        values, ids = jax.lax.top_k(scaled, top_k)
        if use_top_p:
            values = _top_p_mask(values, top_p)
        index, logq = _sample_from_logits(values, uniforms)
        return jnp.take_along_axis(ids, index[:, None], axis=-1)[:, 0].astype(jnp.int32), logq
    if use_top_p:
        scaled = _top_p_mask(scaled, top_p)
    index, logq = _sample_from_logits(scaled, uniforms)
    return index.astype(jnp.int32), logq


def sampling_distribution(
    logits: jax.Array,
    *,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
) -> jax.Array:
    """The full sampling distribution `q` that `sample` draws from: `[B, V]` logits -> `[B, V]` log q.

    Entries outside the top-k / top-p set are -inf. Used to check `sample` and to inspect a distribution; the
    engine itself never materialises it for the whole vocabulary.
    """
    scaled = logits.astype(jnp.float32) / temperature
    vocab = scaled.shape[-1]
    rows = jnp.arange(scaled.shape[0])[:, None]
    if top_k and top_k < vocab:
        values, ids = jax.lax.top_k(scaled, top_k)
        scaled = jnp.full_like(scaled, _NEG_INF).at[rows, ids].set(values)
    if top_p < 1.0:
        scaled = _top_p_mask(scaled, top_p)
    return jax.nn.log_softmax(scaled, axis=-1)
