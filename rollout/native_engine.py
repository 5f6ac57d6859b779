"""The native JAX rollout engine: bucketed prefill, slot insertion, multi-step batched decode, continuous refill.

The design follows JetStream (Google's JAX inference engine) and the continuous batching of Orca (Yu et al.,
2022, "Orca: A Distributed Serving System for Transformer-Based Generative Models", OSDI):

  - a fixed number of decode slots share one KV cache (per layer, `[slots, K, ., .]`); shapes never change, so
    the decode step compiles once;
  - a prompt is prefilled once (padded to a power-of-two bucket) and its KV is inserted into as many slots as it
    has samples (`n`), when slots free up;
  - one jitted dispatch advances every live slot `decode_steps_per_dispatch` tokens (`lax.scan`), attending
    only to the power-of-two prefix of the cache that the live sequences reach (with oneDNN's float32 decode products
    on a CPU, read where it lies in the cache: `onednn.cache_dot`);
  - between dispatches the host collects the new tokens, checks stop strings, and refills every finished slot
    with the next waiting sequence at once (continuous refill), instead of waiting for the whole batch;
  - once no sequence waits and the longest live one may run two more dispatches, the live slots are gathered into a
    narrower batch whenever they fit in a quarter of the current one (`narrow_tail`): the long tail of an RL batch,
    a few sequences still running after most have stopped, then decodes with products of a few rows instead of all
    of them (vLLM schedules only running sequences to the same effect). Each row keeps its own PRNG stream
    (`sampling.row_keys`), so its random draws do not depend on the batch it decodes in, and its tokens neither, up
    to a near tie that products of another width round differently.

The engine shares the trainer's model code (`feynrl_jax.models.forward`), so its behaviour log-probabilities
equal `feynrl_jax.models.sequence_logprobs` at the same temperature to float tolerance when top-k/top-p are
off. With top-k or top-p on they differ by design: the engine reports the exact truncated, renormalised
distribution it sampled from (see `sampling.py`).

Sharding: pass `param_shardings` (a pytree of `jax.sharding.Sharding` matching the params, e.g. from the
logical-axis rules of `feynrl_jax.sharding`) and `cache_sharding` (a `NamedSharding` for the cache as if it were
stacked: `[L, slots, K, Dh, S]` keys, `[L, slots, K, S, Dh]` values; typically `P(None, None, "tensor", None,
None)` for tensor parallelism over KV heads; the layer axis must not be sharded, since the engine keeps one array
per layer); the compiled steps are then partitioned by XLA (GSPMD) over that mesh.

Speed: the engine holds its params and cache split per layer (`unstack_layers`, `KVCache.unstack`) and
`forward` runs the layers in a Python loop, so no step copies a layer's weights or cache out of a stacked
array (a CPU decode step takes 0.75-0.9x as long; `benchmarks/bench_decode_step.py`).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from feynrl_jax.models import KVCache, ModelConfig, as_param_dtype, lora
from feynrl_jax.rollout import sampling as sampling_lib
from feynrl_jax.rollout.decode import decode_dispatch
from feynrl_jax.rollout.prefill import bucket_lengths, pick_bucket, prefill
from feynrl_jax.rollout.slots import DecodeState, deactivate, init_state, insert, insert_prefix, take
from feynrl_jax.rollout.stop_strings import StopStringMatcher
from feynrl_jax.rollout.types import FINISH_LENGTH, FINISH_STOP, Rollouts, SamplingParams, assemble_rollouts

PREFILL_BATCH = 4
"""Prompts per batched prefill, where each prompt is sampled once (an evaluation). Prefill runs each prompt's tokens
through the model, and one prompt's ~30 tokens make too small a matrix product for the CPU: SmolLM2-135M, float32,
28-token prompts in a 32-token bucket, on the 2-core Intel Xeon took 85 ms per prompt one at a time, 43 ms in batches of
4, 36 ms of 8 and 29 ms of 32 (a profiling script, not kept); the demo's evaluation, 64 prompts, went from 7.32 to 5.44
s (1.35x; 1.31x in a second run, `benchmarks/bench_prefill_batch.py`). With several samples per prompt one prefill
already serves them all: a demo rollout (8 samples each, 4 new prompts at a time) gained 0.28 s of 3.38, while compiling
the second prefill program lengthened the rollout worker's warm-up from 12-16 s to 19-20 s and the first step by about 3
s on 2 cores (`benchmarks/learning_vs_trl.py`, seeds 0 and 1), so those prompts are prefilled one at a time."""


class NativeEngine:
    """Continuous-batching generation with the project's own model (implements `RolloutEngine`).

    Args:
      config: the model config.
      params: the model params (placed with `param_shardings` when given).
      num_slots: sequences decoded together (the decode batch).
      cache_len: KV cache length S per slot; every prompt length + `max_new_tokens` must fit.
      decode_steps_per_dispatch: decode steps per jitted dispatch (host round trip).
      min_prefill_bucket: the smallest prefill bucket (a power of two).
      continuous_refill: refill a finished slot at once (True) or only when every slot is free (False, "static
        batching", kept for benchmarks).
      narrow_tail: once no sequence waits and a live one may run two more dispatches (its length cap), decode the
        live slots in a batch of `num_slots / 4^k` rows when they fit (each width compiles its own dispatch);
        False keeps every dispatch at `num_slots` rows (benchmarks). Off where `cache_sharding` shards the slot
        axis. A short tail (the demo's 16 new tokens, 8 steps per dispatch) stays in the whole batch: its first
        step had paid for compiling the narrower dispatches without gaining from them.
      prefill_batch: with one sample per prompt, prompts of one prefill bucket that enter the slots together are
        prefilled this many at a time while more than half of such a batch is left (one compiled prefill more per
        bucket); 1: one at a time (benchmarks). See `PREFILL_BATCH`.
      detokenize: token ids -> text; needed for `SamplingParams.stop_strings`.
      param_shardings: optional pytree of shardings matching `params`.
      cache_sharding: optional sharding of the KV cache as if stacked (k `[L, slots, K, Dh, S]`, v `[L, slots, K,
        S, Dh]`), the layer axis unsharded; each layer's array gets it without the layer axis. None with
        `param_shardings` on a mesh: the cache's heads axis sharded as the K projection's heads axis, the rest
        replicated (`_cache_sharding_like`).
      policy_version: version of `params`.
      traced_greedy: `SamplingParams.greedy` is a traced input of the decode dispatch instead of a static one, and a
        greedy request takes the static sampling mode of top-k and top-p off (`_decode_inputs`): for an engine that
        serves greedy evaluations and sampled rollouts alike (a colocated run's, `rollout.colocate`), whose two
        then run one set of decode programs instead of compiling one each. Each program then holds both branches
        (a `lax.cond` in `sampling.sample`), so an engine that only ever gets one kind compiles more for nothing:
        `benchmarks/bench_greedy_dispatch.py`. At a temperature other than 1 its sampled log-probs may be a float32
        rounding apart from a static program's (`tests/test_sampling.py`).

    Attributes:
      last_stats: figures of the last `generate` call (tokens, dispatches, prefills, seconds).
    """

    def __init__(
        self,
        config: ModelConfig,
        params: Any,
        *,
        num_slots: int = 8,
        cache_len: int = 1024,
        decode_steps_per_dispatch: int = 8,
        min_prefill_bucket: int = 16,
        continuous_refill: bool = True,
        narrow_tail: bool = True,
        prefill_batch: int = PREFILL_BATCH,
        detokenize: Callable[[list[int]], str] | None = None,
        param_shardings: Any = None,
        cache_sharding: jax.sharding.Sharding | None = None,
        policy_version: int = 0,
        traced_greedy: bool = False,
    ):
        for name, value, low in (
            ("num_slots", num_slots, 1),
            ("cache_len", cache_len, 2),
            ("decode_steps_per_dispatch", decode_steps_per_dispatch, 1),
            ("prefill_batch", prefill_batch, 1),
        ):
            if not isinstance(value, int) or value < low:
                raise ValueError(f"NativeEngine: {name} must be an int >= {low}, got {value!r}")
        if cache_sharding is None:
            cache_sharding = _cache_sharding_like(param_shardings)
        self.config = config
        self.num_slots = num_slots
        self.cache_len = cache_len
        self.decode_steps_per_dispatch = decode_steps_per_dispatch
        self.continuous_refill = continuous_refill
        self.prefill_batch = prefill_batch
        slot_axis_sharded = cache_sharding is not None and len(cache_sharding.spec) > 1 and cache_sharding.spec[1]
        # The decode batch widths, widest first: num_slots, a quarter of it, ... (one compiled dispatch each).
        self.decode_widths = [num_slots]
        while narrow_tail and not slot_axis_sharded and self.decode_widths[-1] >= _NARROWING:
            self.decode_widths.append(self.decode_widths[-1] // _NARROWING)
        self.detokenize = detokenize
        self.buckets = bucket_lengths(min(min_prefill_bucket, _floor_pow2(cache_len)), cache_len)
        # Decode attends to a power-of-two prefix of the cache that holds every live position (one compiled
        # decode program per length; the smallest is 128 to keep their number down).
        self.attend_buckets = bucket_lengths(min(_MIN_ATTEND_LEN, _floor_pow2(cache_len)), cache_len)
        self.param_shardings = param_shardings
        self.last_stats: dict[str, float] = {}
        # What a `warm_up` cut short by `stop()` left for `finish_warm_up`: its sampling and narrowed-tail work.
        self._warmup_left: tuple[SamplingParams, list[tuple]] | None = None

        state_shardings = None
        if cache_sharding is not None:
            replicated = jax.sharding.NamedSharding(cache_sharding.mesh, jax.sharding.PartitionSpec())
            layer_sharding = _per_layer_sharding(cache_sharding)
            layers = (layer_sharding,) * config.num_layers
            state_shardings = DecodeState(
                cache=KVCache(k=layers, v=layers),
                tokens=replicated,
                positions=replicated,
                active=replicated,
                generated=replicated,
                max_new=replicated,
                keys=replicated,
            )
        self._state_shardings = state_shardings

        def constrain(state):
            return state if state_shardings is None else jax.lax.with_sharding_constraint(state, state_shardings)

        self._init_state = jax.jit(
            functools.partial(init_state, config, num_slots, cache_len), out_shardings=state_shardings
        )
        self._prefill = jax.jit(functools.partial(prefill, config=config))
        # XLA:CPU compiles a kernel of its own for every array a program writes. Splitting the weights per layer
        # and writing a prompt's KV into every layer's cache, each as one program over SmolLM2-135M's 30 layers,
        # cost seconds of compiling at the start of every run (`benchmarks/bench_engine_start.py`). So each is one
        # program that serves every layer (the layer index traced), run once per layer.
        # Programs on the per-slot fields take the state without its cache (`_without_cache`) instead of passing 60
        # arrays through. The narrowing gather stays one program over the state: per layer it compiled no faster.
        field_shardings = None if state_shardings is None else state_shardings._replace(cache=None)
        layer_sharding = None if state_shardings is None else state_shardings.cache.k[0]

        def constrain_fields(fields):
            return fields if field_shardings is None else jax.lax.with_sharding_constraint(fields, field_shardings)

        def constrain_layer(array):
            return array if layer_sharding is None else jax.lax.with_sharding_constraint(array, layer_sharding)

        self._insert = jax.jit(lambda fields, *args: constrain_fields(insert(fields, *args)), donate_argnums=0)
        self._deactivate = jax.jit(lambda fields, done: constrain_fields(deactivate(fields, done)), donate_argnums=0)
        self._take = jax.jit(lambda state, slots: constrain(take(state, slots)))
        self._insert_prefix = jax.jit(
            lambda k, v, *args: jax.tree.map(constrain_layer, insert_prefix(k, v, *args, config=config)),
            donate_argnums=(0, 1),
        )
        self._layer_of = jax.jit(
            lambda layers, index: as_param_dtype(
                jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, index, keepdims=False), layers), config
            )
        )
        self._in_param_dtype = jax.jit(lambda params: as_param_dtype(params, config))
        self._layer_indices = [jnp.int32(i) for i in range(config.num_layers)]

        def dispatch(params, state, *args, **static):
            state, *outputs = decode_dispatch(
                params, state, *args, config=config, steps=decode_steps_per_dispatch, **static
            )
            return constrain(state), *outputs

        self.traced_greedy = traced_greedy
        static_names = ("top_k", "use_top_p", "attend_len") + (() if traced_greedy else ("greedy",))
        self._decode = jax.jit(dispatch, static_argnames=static_names, donate_argnums=1)
        self._state = self._init_state()
        self.load_params(params, policy_version)

    def load_params(self, params: Any, version: int) -> None:
        """Replaces the params used by later `generate` calls; their rollouts carry `policy_version=version`.

        The engine keeps the layers split into per-layer arrays (`unstack_layers`, one copy made here), which
        prefill and decode read without the per-layer slice copies of a scan over stacked layers, in the model's
        `param_dtype` (wider params, a trainer's float32 master weights, are rounded in that copy). The params held
        before are released first.
        """
        # The held copy goes first, so that the new one can take its memory (one copy held, not two; on a host that
        # backs fresh memory slowly, pages already touched are the fast ones). Until the new copy is in place the
        # engine holds no params: `generate` refuses to run, and a failed load leaves it so.
        self._params = None
        if self.param_shardings is not None:
            params = jax.device_put(params, self.param_shardings)
        self._params = self._unstack_layers(params)
        self.policy_version = int(version)

    def release_memory(self) -> None:
        """Frees the held params and the decode state (its KV cache); the compiled programs stay.

        For an engine that runs now and then beside other work in one process (the trainer's held-out evaluation,
        between updates): until the next `load_params` it holds no memory of its own, so the memory it used is free
        for that work, and nothing it keeps splits the process's heap between that work's large buffers. The next
        `load_params` places the params again (as every load does) and the next `generate` builds a fresh state
        (zeros; a free slot's cache is never read, so the results are the same). Until then `generate` and
        `warm_up` refuse to run, and `load_adapters` too (a LoRA engine's next load must carry the base).
        """
        self._params = None
        self._state = None

    def load_adapters(self, adapters: Any, version: int) -> None:
        """Replaces only the LoRA adapters of the held params (`feynrl_jax.models.lora`); their rollouts carry
        `policy_version=version`.

        The base weights stay as they are on the device (no copy, no transfer): only the adapters, a few MB, are
        placed and split per layer; prefill and decode apply them at every target projection.

        Args:
            adapters: `{"layers": {target: {"lora_a", "lora_b"}}}` (stacked layers), e.g. `lora.adapters_of(params)`.
            version: the policy version.

        Raises:
            ValueError: the engine's model config has no adapters (`lora_rank` 0), or these do not fit its params.
        """
        if not self.config.lora_rank:
            raise ValueError("load_adapters: this engine's model config has no LoRA adapters (lora_rank=0)")
        self._require_params("load_adapters")  # the base the adapters combine with
        if self.param_shardings is not None:
            shardings = self.param_shardings  # one sharding for every param, or a tree of them
            if not isinstance(shardings, jax.sharding.Sharding):
                shardings = lora.adapters_of(shardings)
            adapters = jax.device_put(adapters, shardings)
        base = lora.base_params(self._params)
        self._params = lora.combine(base, self._unstack_layers(adapters))
        self.policy_version = int(version)

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        sampling: SamplingParams,
        *,
        max_new_tokens: Sequence[int] | None = None,
    ) -> Rollouts:
        """Samples `sampling.n` completions per prompt.

        Args:
          prompts: token ids per prompt (no padding).
          sampling: the sampling settings.
          max_new_tokens: optional per-prompt completion caps, each in [1, `sampling.max_new_tokens`]
            (requests of one batch that should stop at different lengths).

        Returns:
          `Rollouts` with `N = len(prompts) * n` rows, prompt-major, and `C = sampling.max_new_tokens` columns.

        Raises:
          ValueError: an empty prompt, a token id outside the vocabulary, a prompt too long for the cache, stop
            strings without `detokenize` (each message names the prompt or setting).
        """
        start_time = time.perf_counter()
        self._require_params("generate")
        prompts = [list(map(int, p)) for p in prompts]
        caps = self._check_request(prompts, sampling, max_new_tokens)
        n = sampling.n
        rows = [(p, s) for p in range(len(prompts)) for s in range(n)]
        keys = sampling_lib.row_keys(sampling.seed, [p for p, _ in rows], [s for _, s in rows])
        stop_set = set(sampling.stop_token_ids)
        matcher = StopStringMatcher(sampling.stop_strings, self.detokenize) if sampling.stop_strings else None
        decode_args, decode_static = _decode_inputs(sampling, self.traced_greedy)

        out_tokens: list[list[int]] = [[] for _ in rows]
        out_logprobs: list[list[float]] = [[] for _ in rows]
        finish = np.full(len(rows), FINISH_LENGTH, np.int32)
        checked = [0] * len(rows)
        waiting = collections.deque(range(len(rows)))
        prefixes: dict[int, _Prefix] = {}  # prompt index -> its prefix KV while samples are left to insert
        slot_row: list[int | None] = [None] * self.num_slots
        stats = collections.Counter()

        # Slots left active by an interrupted call are freed; the state is stored back even on an error, since
        # every jitted step donates (invalidates) the state it was given. While a narrower batch decodes the tail,
        # the whole-width state is kept (not donated) for the next call. A call interrupted inside a step (an
        # insert runs one program per layer) may have left arrays that were donated: then a fresh state replaces
        # it, which changes nothing, since every slot is freed here and a free slot's cache is never read.
        state = self._usable_state()
        state = self._on_fields(self._deactivate, state, jnp.ones((self.num_slots,), bool))
        whole = None
        try:
            while True:
                free = [s for s in range(len(slot_row)) if slot_row[s] is None]
                if self.continuous_refill or len(free) == len(slot_row):
                    taken = [waiting.popleft() for _ in range(min(len(free), len(waiting)))]
                    self._prefill_prompts([rows[row][0] for row in taken], prompts, prefixes, stats, n)
                    for slot, row in zip(free, taken):
                        state = self._insert_row(state, slot, row, rows, prompts, caps, keys, prefixes)
                        slot_row[slot] = row
                if all(r is None for r in slot_row):
                    break
                # The longest a live row may still run; a narrower batch only pays (its compiled dispatch, the
                # gather) over at least two more dispatches.
                left = max(caps[rows[row][0]] - len(out_tokens[row]) for row in slot_row if row is not None)
                if not waiting and left >= 2 * self.decode_steps_per_dispatch:
                    narrowed, slot_row = self._narrow(state, slot_row)
                    if narrowed is not state:
                        whole = state if whole is None else whole
                        state = narrowed
                        stats["narrowings"] += 1
                # A slot at position p reaches p + steps - 1 in this dispatch; p = prompt length - 1 + emitted.
                reach = max(len(prompts[rows[row][0]]) + len(out_tokens[row]) for row in slot_row if row is not None)
                attend_len = pick_bucket(
                    self.attend_buckets, min(reach - 1 + self.decode_steps_per_dispatch, self.cache_len)
                )
                state, tokens, logprobs, emitted = self._decode(
                    self._params, state, *decode_args, **decode_static, attend_len=attend_len
                )
                tokens, logprobs, emitted, active = jax.device_get((tokens, logprobs, emitted, state.active))
                stats["dispatches"] += 1
                stats["slot_steps"] += len(slot_row) * self.decode_steps_per_dispatch
                killed = np.zeros(len(slot_row), bool)
                for slot, row in enumerate(slot_row):
                    if row is None:
                        continue
                    keep = emitted[slot]
                    out_tokens[row].extend(tokens[slot][keep].tolist())
                    out_logprobs[row].extend(logprobs[slot][keep].tolist())
                    done = not active[slot]
                    if matcher is not None:
                        floor = max(checked[row], sampling.min_new_tokens - 1, 0)
                        end = matcher.first_stop(out_tokens[row], floor)
                        checked[row] = len(out_tokens[row])
                        if end is not None:
                            del out_tokens[row][end:], out_logprobs[row][end:]
                            finish[row] = FINISH_STOP
                            killed[slot] = not done
                            done = True
                            slot_row[slot] = None
                            continue
                    if done:
                        finish[row] = FINISH_STOP if out_tokens[row][-1] in stop_set else FINISH_LENGTH
                        slot_row[slot] = None
                if killed.any():
                    state = self._release(state, killed)
        finally:
            self._state = state if whole is None else whole

        pad = self.config.pad_token_id if self.config.pad_token_id is not None else 0
        result = assemble_rollouts(
            prompts,
            rows,
            out_tokens,
            out_logprobs,
            finish,
            width=sampling.max_new_tokens,
            pad_id=pad,
            policy_version=self.policy_version,
        )
        generated = int(result.completion_mask.sum())
        self.last_stats = {
            "seconds": time.perf_counter() - start_time,
            "generated_tokens": generated,
            "dispatches": stats["dispatches"],
            "prefills": stats["prefills"],
            "prefill_calls": stats["prefill_calls"],
            "slot_utilisation": generated / max(stats["slot_steps"], 1),
            "narrowings": stats["narrowings"],
        }
        return result

    def warm_up(
        self, prompt_lengths: Sequence[int], sampling: SamplingParams, *, stop: Callable[[], bool] | None = None
    ) -> dict[str, float]:
        """Compiles, before the first batch, the programs that a batch of prompts of `prompt_lengths` sampled with
        `sampling` runs (the model warm-up of JetStream and vLLM), on whatever params the engine holds: placeholder
        weights serve (`feynrl_jax.models.placeholder_params`), since a program depends on shapes only. In order:

          - the whole-width decode dispatch for each attend length the batch can reach (`lower().compile()`, which
            fills the jit's cache; nothing runs);
          - a real one-token generation of one dummy prompt per prefill bucket of these lengths, `sampling.n`
            samples each: prefill, the KV insertion and the other small programs, run once (it also touches the
            cache's memory once); with one sample per prompt, each of these buckets' batched prefill and its
            insertion (`_batched_prefill_buckets`); the program of the rows' sampling keys (`sampling.row_keys`);
            with stop strings, the release of a slot;
          - where the batch's tail can narrow (`narrow_tail`, see `_narrows`): the gathers from each width to
            each narrower one, each narrower width's dispatches (attend lengths as above) and, with stop strings,
            its slot release. `stop()` (say, a generation is waiting for the engine) ends the warm-up before
            each of these programs: what is left, `warm_up_left` programs, `finish_warm_up` compiles later (else a
            batch compiles what it first needs).

        The engine afterwards holds the same params, version and free slots as before: a later `generate` returns
        what it would have returned without the warm-up. A batch that reaches other prefill buckets or attend
        lengths compiles those when it first needs them, as without a warm-up.

        Returns:
            `{"seconds", "dispatch_programs", "prefill_buckets", "batched_prefill_buckets", "complete"}`: the decode
            programs compiled, the buckets prefilled (one prompt, and a batch of them), and 1.0 unless `stop()` cut
            the warm-up short.
        """
        t0 = time.perf_counter()
        self._require_params("warm_up")
        lengths = sorted({int(n) for n in prompt_lengths})
        if not lengths or lengths[0] < 1:
            raise ValueError(f"NativeEngine.warm_up: prompt lengths must be >= 1, got {list(prompt_lengths)}")
        caps = min(sampling.max_new_tokens, self.cache_len - lengths[-1])
        if caps < 1:
            raise ValueError(
                f"NativeEngine.warm_up: a prompt of {lengths[-1]} tokens leaves no room in the cache of "
                f"{self.cache_len} positions"
            )
        steps = self.decode_steps_per_dispatch
        rows = len(prompt_lengths) * sampling.n
        # A dispatch attends to `reach - 1 + steps` positions, `reach` the longest live row's prompt and emitted
        # tokens; a live row has emitted a multiple of `steps` tokens, at most `caps - 1`.
        emitted = steps * ((caps - 1) // steps)
        low = pick_bucket(self.attend_buckets, min(lengths[0] - 1 + steps, self.cache_len))
        high = pick_bucket(self.attend_buckets, min(lengths[-1] + emitted - 1 + steps, self.cache_len))
        attend = [a for a in self.attend_buckets if low <= a <= high]
        self._state = self._usable_state()
        for attend_len in attend:
            self._compile_dispatch(self._state, sampling, attend_len)
        by_bucket = {pick_bucket(self.buckets, max(n - 1, 1)): n for n in lengths}  # the longest of each bucket
        pad = self.config.pad_token_id if self.config.pad_token_id is not None else 0
        kept_stats = self.last_stats
        self.generate([[pad] * n for n in by_bucket.values()], sampling, max_new_tokens=[1] * len(by_bucket))
        self.last_stats = kept_stats
        batched = self._batched_prefill_buckets(prompt_lengths, sampling.n)
        for bucket in batched:  # that bucket's batched prefill and its insert (any layer: one program serves all)
            prefix = self._prefill_padded([], bucket, self.prefill_batch)
            ks, vs = list(self._state.cache.k), list(self._state.cache.v)
            zero = jnp.int32(0)  # slot 0 is free: its cache is never read
            ks[0], vs[0] = self._insert_prefix(ks[0], vs[0], prefix, self._layer_indices[0], zero, zero)
            self._state = self._state._replace(cache=KVCache(k=tuple(ks), v=tuple(vs)))
        ids = np.zeros(rows, np.int32)
        sampling_lib.row_keys(sampling.seed, ids, ids)  # its program: one for every row count up to its bucket
        if sampling.stop_strings:  # a stop string frees its slot (here none: every slot is free already)
            self._state = self._release(self._state, np.zeros(self.num_slots, bool))
        compiled, complete = len(attend), True
        self._warmup_left = None
        if self._narrows(rows, caps):
            done, left = self._warm_narrow_tail(sampling, self._narrow_tail_work(attend, sampling), stop)
            compiled, complete = compiled + done, not left
            self._warmup_left = (sampling, left) if left else None
        return {
            "seconds": time.perf_counter() - t0,
            "dispatch_programs": float(compiled),
            "prefill_buckets": float(len(by_bucket)),
            "batched_prefill_buckets": float(len(batched)),
            "complete": float(complete),
        }

    @property
    def warm_up_left(self) -> int:
        """How many of its narrowed tail's programs the last `warm_up` left because `stop()` cut it short: those
        that `finish_warm_up` compiles (0 once it has)."""
        return len(self._warmup_left[1]) if self._warmup_left else 0

    def finish_warm_up(self, *, stop: Callable[[], bool] | None = None) -> dict[str, float]:
        """Compiles what the last `warm_up` left when `stop()` cut it short (the narrowed tail's gathers, slot
        releases and dispatches, `warm_up_left` of them), on the params the engine holds now; `stop()` ends it
        again before any of these programs, and a later call goes on from there. A rollout worker calls it while
        it waits for work, so that a batch whose tail first narrows in a later step does not compile there.

        The engine afterwards holds the same params, version and free slots as before (as after `warm_up`). Where
        it holds no params (`release_memory`), it compiles nothing and keeps the work for later.

        Returns:
            `{"seconds", "dispatch_programs", "complete"}`: the dispatch programs compiled, and 1.0 once nothing
            is left.
        """
        t0 = time.perf_counter()
        compiled = 0
        if self._warmup_left is not None and self._params is not None:
            sampling, work = self._warmup_left
            self._state = self._usable_state()
            compiled, left = self._warm_narrow_tail(sampling, work, stop)
            self._warmup_left = (sampling, left) if left else None
        return {
            "seconds": time.perf_counter() - t0,
            "dispatch_programs": float(compiled),
            "complete": float(self._warmup_left is None),
        }

    def _narrow_tail_work(self, attend: Sequence[int], sampling: SamplingParams) -> list[tuple]:
        """The narrowed tail's programs that `warm_up` compiles, in order: for each width narrower than the whole,
        the gathers into it from each wider width (`("take", width, wider)`), with stop strings its slot release
        (`("release", width)`), and its dispatch at each attend length (`("dispatch", width, attend_len)`)."""
        work: list[tuple] = []
        for width in self.decode_widths[1:]:
            work += [("take", width, wider) for wider in self.decode_widths if wider > width]
            work += [("release", width)] if sampling.stop_strings else []
            work += [("dispatch", width, attend_len) for attend_len in attend]
        return work

    def _warm_narrow_tail(
        self, sampling: SamplingParams, work: list[tuple], stop: Callable[[], bool] | None
    ) -> tuple[int, list[tuple]]:
        """Runs `work` (`_narrow_tail_work`) in order on states gathered from the held whole-width state, until
        `stop()` answers True before one of them. Returns the dispatch programs compiled and the work left."""
        states = {self.num_slots: self._state}

        def state(width: int) -> DecodeState:  # a width gathered by work done in an earlier call: gathered again
            if width not in states:
                states[width] = self._gather(self._state, list(range(width)))
            return states[width]

        compiled = 0
        for i, (kind, width, *rest) in enumerate(work):
            if stop is not None and stop():
                return compiled, work[i:]
            if kind == "take":
                states[width] = self._gather(state(rest[0]), list(range(width)))
            elif kind == "release":  # a stop string frees its slot in the narrowed batch
                states[width] = self._release(state(width), np.zeros(width, bool))
            else:
                self._compile_dispatch(state(width), sampling, rest[0])
                compiled += 1
        return compiled, []

    def _compile_dispatch(self, state: DecodeState, sampling: SamplingParams, attend_len: int) -> None:
        """Compiles the decode dispatch for `state`'s width, `sampling` and `attend_len` (`lower().compile()`,
        which fills the jit's cache; nothing runs)."""
        decode_args, decode_static = _decode_inputs(sampling, self.traced_greedy)
        self._decode.lower(self._params, state, *decode_args, **decode_static, attend_len=attend_len).compile()

    def _batched_prefill_buckets(self, prompt_lengths: Sequence[int], n: int) -> list[int]:
        """The prefill buckets whose batched prefill `warm_up` compiles for prompts of `prompt_lengths`, `n` samples
        each: with one sample per prompt, every bucket of these lengths, where the slots hold more than half a
        prefill batch (`_prefill_batches`). Every bucket, not only those with enough prompts here: a rollout worker
        warms up on the first batch, and a later batch may bring more prompts of a bucket."""
        if self.prefill_batch == 1 or n > 1 or self.num_slots <= self.prefill_batch // 2:
            return []
        return sorted({pick_bucket(self.buckets, max(int(k) - 1, 1)) for k in prompt_lengths})

    def _narrows(self, rows: int, caps: int) -> bool:
        """Whether a batch of `rows` rows capped at `caps` new tokens can narrow its tail (`generate`): only while
        the longest live row may run two more dispatches, and only once the live rows fit in a quarter of the
        slots. That is before the first dispatch where the whole batch fits; after a refill emptied the queue
        (more rows than slots), its rows starting with their whole cap; else after the first dispatch, which left
        `caps - steps` at most."""
        steps = self.decode_steps_per_dispatch
        if len(self.decode_widths) == 1:
            return False
        if rows > self.num_slots or rows <= self.decode_widths[1]:
            return caps >= 2 * steps
        return caps >= 3 * steps

    def _narrow(self, state: DecodeState, slot_row: list[int | None]) -> tuple[DecodeState, list[int | None]]:
        """The state and slot map of the narrowest width in `decode_widths` that holds the live slots: live slots
        first, then free (inactive) ones as filler rows; `state` itself where no narrower width holds them."""
        live = [slot for slot, row in enumerate(slot_row) if row is not None]
        width = min(w for w in self.decode_widths if w >= len(live) or w == self.num_slots)
        if width >= len(slot_row):
            return state, slot_row
        slots = live + [slot for slot, row in enumerate(slot_row) if row is None][: width - len(live)]
        return self._gather(state, slots), [slot_row[slot] for slot in slots]

    def _gather(self, state: DecodeState, slots: list[int]) -> DecodeState:
        """The state of the rows `slots` of `state`, in that order (narrowing; its warm-up passes the slots the same
        way, so both run one compiled program per pair of widths)."""
        return self._take(state, jnp.asarray(slots, jnp.int32))

    def _release(self, state: DecodeState, done: np.ndarray) -> DecodeState:
        """`state` with the slots where `done` (host bools, one per row) freed (a stop string; its warm-up passes
        the mask the same way)."""
        return self._on_fields(self._deactivate, state, jnp.asarray(done))

    def _require_params(self, caller: str) -> None:
        if self._params is None:
            raise RuntimeError(
                f"NativeEngine.{caller}: no params loaded (the last load_params failed, or release_memory freed "
                "them); call load_params first"
            )

    def _usable_state(self) -> DecodeState:
        """The held state, or a fresh one where none is held (`release_memory`) or a call interrupted inside a step
        left donated arrays in it."""
        if self._state is None or any(leaf.is_deleted() for leaf in jax.tree.leaves(self._state)):
            return self._init_state()
        return self._state

    @staticmethod
    def _on_fields(program, state: DecodeState, *args) -> DecodeState:
        """`state` with its per-slot fields replaced by `program(fields, *args)` (the fields donated); the cache
        stays as it is."""
        return program(_without_cache(state), *args)._replace(cache=state.cache)

    def _unstack_layers(self, params: Any) -> Any:
        """`unstack_layers(as_param_dtype(params))`, one layer per call of one compiled program."""
        held = sorted({leaf.shape[0] for leaf in jax.tree.leaves(params["layers"])})
        if held != [self.config.num_layers]:
            want = self.config.num_layers
            raise ValueError(f"NativeEngine: the params' layers hold {held} layers, the model config {want}")
        # Host arrays (a rollout worker's numpy params) are placed once here, not once per layer by each call;
        # `device_put` (not `jnp.asarray`, which copies) lets a CPU use the host buffers as they are.
        params = jax.tree.map(lambda a: a if isinstance(a, jax.Array) else jax.device_put(a), params)
        rest = self._in_param_dtype({key: value for key, value in params.items() if key != "layers"})
        layers = tuple(self._layer_of(params["layers"], index) for index in self._layer_indices)
        return {**rest, "layers": layers}

    def _check_request(self, prompts, sampling: SamplingParams, max_new_tokens) -> list[int]:
        if not isinstance(sampling, SamplingParams):
            raise TypeError(f"sampling must be a SamplingParams, got {type(sampling).__name__}")
        if not prompts:
            raise ValueError("prompts is empty: nothing to generate")
        if sampling.stop_strings and self.detokenize is None:
            raise ValueError("SamplingParams.stop_strings needs a NativeEngine built with detokenize=...")
        for token in sampling.stop_token_ids:
            if token >= self.config.vocab_size:
                raise ValueError(f"SamplingParams.stop_token_ids: {token} >= vocab_size {self.config.vocab_size}")
        if max_new_tokens is None:
            caps = [sampling.max_new_tokens] * len(prompts)
        else:
            caps = [int(c) for c in max_new_tokens]
            if len(caps) != len(prompts):
                raise ValueError(f"max_new_tokens has {len(caps)} entries for {len(prompts)} prompts")
            for i, cap in enumerate(caps):
                if not 1 <= cap <= sampling.max_new_tokens:
                    raise ValueError(
                        f"max_new_tokens[{i}] = {cap} is outside [1, SamplingParams.max_new_tokens="
                        f"{sampling.max_new_tokens}]"
                    )
        for i, prompt in enumerate(prompts):
            if not prompt:
                raise ValueError(f"prompt {i} is empty")
            bad = [t for t in prompt if not 0 <= t < self.config.vocab_size]
            if bad:
                raise ValueError(f"prompt {i} has token ids outside [0, {self.config.vocab_size}): {bad[:5]}")
            if len(prompt) + caps[i] > self.cache_len:
                raise ValueError(
                    f"prompt {i} has {len(prompt)} tokens; with max_new_tokens={caps[i]} it needs "
                    f"{len(prompt) + caps[i]} cache positions, the engine's cache_len is {self.cache_len}"
                )
        return caps

    def _prefill_prompts(
        self,
        indices: list[int],
        prompts: list[list[int]],
        prefixes: dict[int, _Prefix],
        stats: collections.Counter,
        n: int,
    ) -> None:
        """Prefills the prompts among `indices` (the prompts of the rows about to be inserted) whose prefix KV is not
        held yet, into `prefixes` (each held until its `n` samples are inserted).

        With one sample per prompt (`n`), prompts of one prefill bucket go `prefill_batch` at a time (padding rows
        of length 0 fill a short batch) while more than half a batch of them is left, the rest one at a time
        (`_prefill_batches`). A one-token prompt has an empty prefix: prefilling zero tokens writes nothing (segment
        id 0), and going through the same compiled prefill/insert keeps the number of programs down.
        """
        new = list(dict.fromkeys(i for i in indices if i not in prefixes))
        by_bucket: dict[int, list[int]] = {}
        for index in new:
            by_bucket.setdefault(pick_bucket(self.buckets, max(len(prompts[index]) - 1, 1)), []).append(index)
        for bucket, group in by_bucket.items():
            for batch in self._prefill_batches(group, n):
                size = self.prefill_batch if len(batch) > 1 else 1
                prefix = self._prefill_padded([prompts[index][:-1] for index in batch], bucket, size)
                stats["prefills"] += len(batch)
                stats["prefill_calls"] += 1
                for j, index in enumerate(batch):
                    prefixes[index] = _Prefix(prefix, jnp.int32(j), n)

    def _prefill_padded(self, prefixes: list[list[int]], bucket: int, size: int) -> KVCache:
        """The KV of `prefixes` (token ids, each at most `bucket` long) prefilled in one batch of `size` rows, rows
        of length 0 filling it: the one place host arrays are made for `_prefill` (`generate` and `warm_up`), since
        staging each shape onto the device compiles a program of its own."""
        padded = np.zeros((size, bucket), np.int32)
        lengths = np.zeros(size, np.int32)
        for j, tokens in enumerate(prefixes):
            lengths[j] = len(tokens)
            padded[j, : len(tokens)] = tokens
        return self._prefill(self._params, jnp.asarray(padded), jnp.asarray(lengths))

    def _prefill_batches(self, group: list, n: int) -> list[list]:
        """`group` (prompts of one bucket, `n` samples each) cut into prefill batches: with one sample per prompt,
        `prefill_batch` at a time while more than half of one is left (a batch costs about as much as half its rows
        prefilled one at a time), then one at a time; with several, one at a time (see `PREFILL_BATCH`)."""
        batches, size = [], self.prefill_batch if n == 1 else 1
        while size > 1 and len(group) > size // 2:
            batches.append(group[:size])
            group = group[size:]
        return batches + [[index] for index in group]

    def _insert_row(self, state, slot, row, rows, prompts, caps, keys, prefixes) -> DecodeState:
        prompt_index, _ = rows[row]
        prompt = prompts[prompt_index]
        held = prefixes[prompt_index]
        slot_index = jnp.int32(slot)
        fields_args = (jnp.int32(prompt[-1]), jnp.int32(len(prompt)), jnp.int32(caps[prompt_index]), keys[row])
        ks, vs = list(state.cache.k), list(state.cache.v)
        for layer, index in enumerate(self._layer_indices):
            ks[layer], vs[layer] = self._insert_prefix(ks[layer], vs[layer], held.kv, index, slot_index, held.row)
        fields = self._insert(_without_cache(state), slot_index, *fields_args)
        state = fields._replace(cache=KVCache(k=tuple(ks), v=tuple(vs)))
        held.left -= 1
        if held.left == 0:
            del prefixes[prompt_index]  # every sample inserted: free this prompt's hold on the prefix KV
        return state


_MIN_ATTEND_LEN = 128


def _decode_inputs(sampling: SamplingParams, traced_greedy: bool = False) -> tuple[tuple, dict[str, Any]]:
    """The decode dispatch's traced sampling inputs (stop ids, temperature, top-p, minimum length) and its static
    ones (greedy, top-k, top-p on).

    `traced_greedy`: greedy is a traced input instead (a bool scalar after the others), and a greedy request has the
    statics of sampling at top-k and top-p off, so that it runs the programs of a sampled request at the defaults (a
    `lax.cond` in `sampling.sample` picks the branch; see `NativeEngine`'s `traced_greedy`).
    """
    args = (
        jnp.asarray(np.array(sampling.stop_token_ids, np.int32).reshape(-1)),
        jnp.float32(sampling.temperature),
        jnp.float32(sampling.top_p),
        jnp.int32(sampling.min_new_tokens),
    )
    static = dict(
        top_k=0 if sampling.greedy else sampling.top_k,
        use_top_p=(not sampling.greedy) and sampling.top_p < 1.0,
    )
    if traced_greedy:
        return (*args, jnp.bool_(sampling.greedy)), static
    return args, static | {"greedy": sampling.greedy}


@dataclasses.dataclass
class _Prefix:
    """A prompt's prefix KV during a `generate` call: `kv` (a prefill's output, shared by the prompts prefilled
    together), the prompt's `row` in it, and its samples still to insert (`left`)."""

    kv: KVCache
    row: jax.Array
    left: int


def _without_cache(state: DecodeState) -> DecodeState:
    """The state's per-slot fields: the state without its cache (`cache=None`)."""
    return state._replace(cache=None)


def _cache_sharding_like(param_shardings: Any) -> jax.sharding.NamedSharding | None:
    """The KV cache's sharding for params placed on a mesh (the trainer's evaluation engine): its heads axis on the
    mesh axis of the K projection's heads axis (an NF4 kernel's too), where XLA puts the keys a prefill computes,
    the rest replicated on that mesh; replicated where one sharding is given for every param; None where the params
    carry no mesh shardings.

    Left unplaced, a fresh decode state lived on one device until its first programs moved it onto the mesh, so each
    of those programs compiled twice: once for each placement (a warmed-up engine compiled again after
    `release_memory`)."""
    if isinstance(param_shardings, jax.sharding.NamedSharding):  # one sharding for every param: replicated
        return jax.sharding.NamedSharding(param_shardings.mesh, jax.sharding.PartitionSpec())
    try:
        k_proj = param_shardings["layers"]["k_proj"]
        kernel = k_proj["kernel"] if "kernel" in k_proj else k_proj["kernel_nf4"]  # [L, D, K, Dh] (NF4: Dh / 2)
    except (KeyError, TypeError):
        return None
    if not isinstance(kernel, jax.sharding.NamedSharding):
        return None
    spec = tuple(kernel.spec) + (None,) * (4 - len(kernel.spec))
    return jax.sharding.NamedSharding(kernel.mesh, jax.sharding.PartitionSpec(None, None, spec[2]))


def _per_layer_sharding(cache_sharding: jax.sharding.Sharding) -> jax.sharding.NamedSharding:
    """The sharding of one layer's cache (`[slots, K, ., .]`) from that of the stacked `[L, slots, K, ., .]`."""
    spec = tuple(cache_sharding.spec) + (None,) * (5 - len(cache_sharding.spec))
    if spec[0] is not None:
        raise ValueError(f"NativeEngine: cache_sharding must not shard the layer axis, got {cache_sharding.spec}")
    return jax.sharding.NamedSharding(cache_sharding.mesh, jax.sharding.PartitionSpec(*spec[1:]))


_NARROWING = 4
"""Each narrower decode batch holds a quarter of the previous one's rows. Halving instead (more widths, more
compiled dispatches, more gathers of the cache) gained less in `benchmarks/bench_rollout.py`'s narrow-tail leg:
1.15x against 1.31x over the whole batch (2-core Intel Xeon, float32, SmolLM2-135M)."""


def _floor_pow2(x: int) -> int:
    return 1 << (x.bit_length() - 1)
