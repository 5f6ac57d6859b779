"""The batched decode step: every live slot advances several tokens per dispatch (`lax.scan`).

One dispatch runs `steps` decode steps for all slots at once; each step feeds every slot's last token at its
own position (the KV cache rule of docs/CONTRACTS.md makes rows independent), samples the next token, and
updates the slot's bookkeeping on device. A slot that finishes inside a dispatch (a stop token, or its length
cap) becomes inactive at once: its later steps neither emit tokens nor write to the cache. The host only looks
at the results between dispatches, which amortises dispatch and transfer overhead (JetStream's "decode steps
per dispatch", vLLM's multi-step scheduling).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from feynrl_jax.models import ModelConfig, forward, logits
from feynrl_jax.rollout import sampling
from feynrl_jax.rollout.slots import DecodeState


def decode_dispatch(
    params,
    state: DecodeState,
    stop_token_ids: jax.Array,
    temperature: jax.Array,
    top_p: jax.Array,
    min_new_tokens: jax.Array,
    greedy: bool | jax.Array = False,
    *,
    config: ModelConfig,
    steps: int,
    top_k: int,
    use_top_p: bool,
    attend_len: int | None = None,
) -> tuple[DecodeState, jax.Array, jax.Array, jax.Array]:
    """Runs `steps` decode steps for every slot (jit with keyword arguments static and the state donated).

    Args:
      params: model params, layers stacked or per layer (`feynrl_jax.models.unstack_layers`; with the state's
        per-layer cache, no step copies a layer's weights or cache).
      state: the decode state.
      stop_token_ids: `[S]` int32 (may be empty); sampling one finishes the sequence with reason "stop".
      temperature, top_p, min_new_tokens: scalars (traced: changing them does not recompile).
      greedy: take the argmax; a Python bool (static) or a traced bool scalar, with which greedy and sampled
        requests run one program (see `sampling.sample`).
      config: model config.
      steps: decode steps per dispatch.
      top_k, use_top_p: static sampling mode (see `sampling.sample`).
      attend_len: attend to the first `attend_len` cache positions only; every active slot must stay below it
        during the dispatch (position + steps <= attend_len). None: the whole cache.

    Returns:
      `(state, tokens [slots, steps] int32, logprobs [slots, steps] f32, emitted [slots, steps] bool)`:
      `emitted[s, i]` says whether slot `s` produced `tokens[s, i]` at step `i` (it was active).
    """

    def step(state: DecodeState, _):
        hidden, cache = forward(
            params,
            state.tokens[:, None],
            state.positions[:, None],
            config=config,
            segment_ids=state.active.astype(jnp.int32)[:, None],
            cache=state.cache,
            attend_len=attend_len,
        )
        next_logits = logits(params, hidden, config=config)[:, 0]
        next_logits = sampling.mask_tokens(next_logits, stop_token_ids, state.generated < min_new_tokens)
        keys = sampling.step_keys(state.keys, state.generated)
        token, logprob = sampling.sample(
            next_logits, keys, temperature=temperature, top_k=top_k, top_p=top_p, use_top_p=use_top_p, greedy=greedy
        )
        emitted = state.active
        generated = state.generated + emitted.astype(jnp.int32)
        stopped = jnp.any(token[:, None] == stop_token_ids[None, :], axis=-1)
        finished = emitted & (stopped | (generated >= state.max_new))
        state = DecodeState(
            cache=cache,
            tokens=jnp.where(emitted, token, state.tokens),
            positions=state.positions + emitted.astype(jnp.int32),
            active=state.active & ~finished,
            generated=generated,
            max_new=state.max_new,
            keys=state.keys,
        )
        return state, (token, logprob, emitted)

    state, (tokens, logprobs, emitted) = jax.lax.scan(step, state, None, length=steps)
    return state, tokens.T, logprobs.T, emitted.T
