"""The native engine on a tiny random model: log-prob parity with the trainer, stops, refill, sharding."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from feynrl_jax.compile_clock import compile_clock
from feynrl_jax.models import (
    KVCache,
    ModelConfig,
    as_param_dtype,
    forward,
    init_params,
    logical_axes,
    logits,
    lora,
    placeholder_params,
    sequence_logprobs,
    unstack_layers,
)
from feynrl_jax.rollout import sampling
from feynrl_jax.rollout.native_engine import NativeEngine
from feynrl_jax.rollout.slots import insert_prefix
from feynrl_jax.rollout.types import FINISH_LENGTH, FINISH_STOP, RolloutEngine, Rollouts, SamplingParams

CONFIG = ModelConfig(
    vocab_size=96, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16
)
PROMPTS = [[5, 6, 7], [11, 12, 13, 14, 15, 16, 17, 18, 19, 20], [42], [30, 31, 32, 33, 34, 35], [70, 71]]
SLOTS = 3


@pytest.fixture(scope="module")
def params():
    raw = init_params(CONFIG, jax.random.PRNGKey(0))
    # Scale the matrices up so the model has peaked, prompt-dependent distributions.
    return jax.tree.map(lambda x: x * 8.0 if x.ndim > 2 else x, raw)


@pytest.fixture(scope="module")
def engine(params):
    return NativeEngine(CONFIG, params, num_slots=SLOTS, cache_len=48, decode_steps_per_dispatch=4)


def _sequences(rollouts: Rollouts):
    """Prompt + completion per row, right-padded to one shape (one compile): tokens, positions, segment ids."""
    rows, width = rollouts.prompt_ids.shape[0], rollouts.prompt_ids.shape[1] + rollouts.completion_ids.shape[1]
    tokens = np.zeros((rows, width), np.int32)
    for i in range(rows):
        p, c = rollouts.prompt_lengths[i], rollouts.completion_lengths[i]
        tokens[i, : p + c] = np.concatenate([rollouts.prompt_ids[i, :p], rollouts.completion_ids[i, :c]])
    lengths = rollouts.prompt_lengths + rollouts.completion_lengths
    segment_ids = (np.arange(width)[None] < lengths[:, None]).astype(np.int32)
    positions = np.broadcast_to(np.arange(width, dtype=np.int32), (rows, width))
    return jnp.asarray(tokens), jnp.asarray(positions), jnp.asarray(segment_ids)


def _trainer_logprobs(params, rollouts: Rollouts, temperature: float) -> list[np.ndarray]:
    """log p(completion token | prefix) from the training code path, per row."""
    tokens, positions, segment_ids = _sequences(rollouts)
    lp, _ = sequence_logprobs(
        params, tokens, positions, config=CONFIG, segment_ids=segment_ids, temperature=temperature
    )
    lp = np.asarray(lp)
    starts, lengths = rollouts.prompt_lengths, rollouts.completion_lengths
    return [lp[i, starts[i] : starts[i] + lengths[i]] for i in range(lp.shape[0])]


def test_engine_satisfies_protocol(engine):
    assert isinstance(engine, RolloutEngine)


def test_behavior_logprobs_equal_trainer_logprobs(engine, params):
    sampling_params = SamplingParams(temperature=0.7, max_new_tokens=14, n=2, seed=11)
    rollouts = engine.generate(PROMPTS, sampling_params)
    assert rollouts.completion_ids.shape == (10, 14)
    np.testing.assert_array_equal(rollouts.group_id, np.repeat(np.arange(5), 2))
    assert np.all(rollouts.finish_reason == FINISH_LENGTH) and np.all(rollouts.completion_lengths == 14)
    for i, ref in enumerate(_trainer_logprobs(params, rollouts, 0.7)):
        np.testing.assert_allclose(rollouts.behavior_logprobs[i, :14], ref, atol=1e-5, rtol=0)
    # The two samples of each prompt share its prefill but are different draws.
    assert engine.last_stats["prefills"] == len(PROMPTS)
    comps = rollouts.completions()
    assert sum(comps[2 * g] != comps[2 * g + 1] for g in range(5)) >= 4


def test_sampling_does_not_depend_on_slot_assignment(engine):
    sampling_params = SamplingParams(temperature=1.0, max_new_tokens=9, n=2, seed=5, stop_token_ids=(3, 9))
    with_refill = engine.generate(PROMPTS, sampling_params)
    engine.continuous_refill = False
    try:
        static = engine.generate(PROMPTS, sampling_params)
    finally:
        engine.continuous_refill = True
    np.testing.assert_array_equal(with_refill.completion_ids, static.completion_ids)
    np.testing.assert_allclose(with_refill.behavior_logprobs, static.behavior_logprobs, atol=1e-6)
    other_seed = engine.generate(PROMPTS, SamplingParams(temperature=1.0, max_new_tokens=9, n=2, seed=6))
    assert not np.array_equal(other_seed.completion_ids, with_refill.completion_ids)


def test_truncated_sampling_reports_exact_truncated_logprob(engine, params):
    rollouts = engine.generate(PROMPTS[:2], SamplingParams(temperature=0.9, top_k=5, top_p=0.8, max_new_tokens=6))
    tokens, positions, segment_ids = _sequences(rollouts)
    hidden, _ = forward(params, tokens, positions, config=CONFIG, segment_ids=segment_ids)
    all_logits = logits(params, hidden, config=CONFIG)
    for i in range(2):
        p, c = rollouts.prompt_lengths[i], rollouts.completion_lengths[i]
        step_logits = all_logits[i, p - 1 : p + c - 1]
        logq = np.asarray(sampling.sampling_distribution(step_logits, temperature=0.9, top_k=5, top_p=0.8))
        chosen = logq[np.arange(c), rollouts.completion_ids[i, :c]]
        assert np.all(np.isfinite(chosen)), "sampled a token outside the top-k/top-p set"
        np.testing.assert_allclose(rollouts.behavior_logprobs[i, :c], chosen, atol=1e-5)
    # Truncation renormalises: the behaviour log-prob is above the untruncated model log-prob.
    untruncated = _trainer_logprobs(params, rollouts, 0.9)
    assert all(np.all(rollouts.behavior_logprobs[i, : len(u)] >= u - 1e-6) for i, u in enumerate(untruncated))


def test_stop_tokens_and_min_new_tokens(engine):
    # Stop on the 12 most common first tokens so most sequences stop early.
    probe = engine.generate(PROMPTS, SamplingParams(temperature=1.5, max_new_tokens=16, n=4, seed=1))
    common = np.bincount(probe.completion_ids[:, :8].ravel(), minlength=CONFIG.vocab_size).argsort()[-12:]
    stop = tuple(int(t) for t in common)
    sampling_params = SamplingParams(
        temperature=1.5, max_new_tokens=16, min_new_tokens=3, n=4, seed=1, stop_token_ids=stop
    )
    rollouts = engine.generate(PROMPTS, sampling_params)
    lengths = rollouts.completion_lengths
    assert (rollouts.finish_reason == FINISH_STOP).sum() >= 5
    for i, comp in enumerate(rollouts.completions()):
        assert not set(comp[:3]) & set(stop), f"row {i}: stop token before min_new_tokens: {comp}"
        assert not set(comp[:-1]) & set(stop), f"row {i}: generation went on after a stop token: {comp}"
        if rollouts.finish_reason[i] == FINISH_STOP:
            assert comp[-1] in stop and lengths[i] >= 4
        else:
            assert lengths[i] == 16
    assert np.all(rollouts.completion_mask.sum(1) == lengths)
    assert np.all(rollouts.completion_ids[rollouts.completion_mask == 0] == 0)
    assert np.all(rollouts.behavior_logprobs[rollouts.completion_mask == 0] == 0)


def test_stop_strings_truncate_after_the_completing_token(engine):
    letters = "abcdefgh"
    detokenize = lambda ids: "".join(letters[t % 8] for t in ids)
    engine.detokenize = detokenize
    try:
        rollouts = engine.generate(
            PROMPTS, SamplingParams(temperature=1.5, max_new_tokens=20, n=3, seed=2, stop_strings=("ab", "hh"))
        )
    finally:
        engine.detokenize = None
    stopped = 0
    for i, comp in enumerate(rollouts.completions()):
        text = detokenize(comp)
        if rollouts.finish_reason[i] == FINISH_STOP:
            stopped += 1
            assert text.endswith("ab") or text.endswith("hh"), text
            assert "ab" not in text[:-1] and "hh" not in text[:-1], text
        else:
            assert len(comp) == 20 and "ab" not in text and "hh" not in text, text
    assert stopped >= 3


def test_per_prompt_length_caps_and_policy_version(engine, params):
    engine.load_params(params, version=7)
    try:
        rollouts = engine.generate(PROMPTS, SamplingParams(max_new_tokens=10, seed=3), max_new_tokens=[1, 10, 4, 2, 7])
    finally:
        engine.load_params(params, version=0)
    np.testing.assert_array_equal(rollouts.completion_lengths, [1, 10, 4, 2, 7])
    assert np.all(rollouts.finish_reason == FINISH_LENGTH)
    assert np.all(rollouts.policy_version == 7)
    np.testing.assert_array_equal(rollouts.prompt_lengths, [len(p) for p in PROMPTS])
    assert rollouts.prompt_ids[2, 0] == 42 and np.all(rollouts.prompt_ids[2, 1:] == 0)


def test_changing_sampling_scalars_does_not_recompile(engine):
    engine.generate(PROMPTS[:2], SamplingParams(temperature=0.5, max_new_tokens=5))
    before = engine._decode._cache_size()
    engine.generate(PROMPTS[:3], SamplingParams(temperature=1.3, max_new_tokens=8, min_new_tokens=2, seed=9))
    assert engine._decode._cache_size() == before


@pytest.mark.parametrize("traced_greedy", [False, True])
def test_traced_greedy_runs_the_decode_programs_of_a_sampled_request(params, traced_greedy):
    """`traced_greedy`: after a sampled batch, a greedy batch of the same shapes compiles no decode program (without
    it, one of its own), and either way each of its tokens is the argmax of the training code's logits over the
    prefix."""
    engine = NativeEngine(
        CONFIG, params, num_slots=SLOTS, cache_len=48, decode_steps_per_dispatch=4, traced_greedy=traced_greedy
    )
    engine.generate(PROMPTS, SamplingParams(temperature=1.0, max_new_tokens=10, seed=2))
    compiled, rollouts = _compiled_during(
        lambda: engine.generate(PROMPTS, SamplingParams(greedy=True, max_new_tokens=10))
    )
    assert ("jit(dispatch)" in compiled) != traced_greedy, compiled
    tokens, positions, segment_ids = _sequences(rollouts)
    hidden, _ = forward(params, tokens, positions, config=CONFIG, segment_ids=segment_ids)
    scores = np.asarray(logits(params, hidden, config=CONFIG), np.float64)
    for i in range(len(PROMPTS)):
        start, length = rollouts.prompt_lengths[i], rollouts.completion_lengths[i]
        predicted = scores[i, start - 1 : start + length - 1]  # the logits each completion token was chosen from
        top2 = np.sort(predicted, axis=-1)[:, -2:]
        assert np.all(top2[:, 1] - top2[:, 0] > 1e-3), "a near-tie: pick other prompts"  # float32 vs float32 paths
        np.testing.assert_array_equal(rollouts.completion_ids[i, :length], predicted.argmax(-1))
    for i, ref in enumerate(_trainer_logprobs(params, rollouts, 1.0)):
        np.testing.assert_allclose(rollouts.behavior_logprobs[i, : len(ref)], ref, atol=1e-5, rtol=0)


@pytest.mark.parametrize(
    "prompts, kwargs, match",
    [
        ([], {}, "prompts is empty"),
        ([[]], {}, "prompt 0 is empty"),
        ([[1, 2], [96]], {}, r"prompt 1 has token ids outside \[0, 96\)"),
        ([[1] * 40], {}, "prompt 0 has 40 tokens"),
        ([[1, 2]], {"max_new_tokens": [11]}, r"max_new_tokens\[0\] = 11"),
        ([[1, 2]], {"stop_strings": ("x",)}, "needs a NativeEngine built with detokenize"),
        ([[1, 2]], {"stop_token_ids": (500,)}, "SamplingParams.stop_token_ids"),
    ],
)
def test_bad_requests_name_the_problem(engine, prompts, kwargs, match):
    caps = kwargs.pop("max_new_tokens", None)
    with pytest.raises(ValueError, match=match):
        engine.generate(prompts, SamplingParams(max_new_tokens=10, **kwargs), max_new_tokens=caps)


def test_tensor_parallel_engine_matches_single_device(engine, params):
    from feynrl_jax.sharding import RULES, make_mesh
    from feynrl_jax.sharding import param_shardings as make_param_shardings

    mesh = make_mesh(data=4, fsdp=1, tensor=2)
    shardings = make_param_shardings(logical_axes(CONFIG), mesh, RULES["fsdp_tp"], shapes=params)
    cache_sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(None, None, "tensor", None, None))
    sharded = NativeEngine(
        CONFIG,
        params,
        num_slots=4,  # a different slot count too: results must not depend on it
        cache_len=48,
        decode_steps_per_dispatch=3,
        param_shardings=shardings,
        cache_sharding=cache_sharding,
    )
    assert sharded.decode_widths == [4, 1]  # the slot axis is not sharded: the tail narrows
    slot_sharded = NativeEngine(
        CONFIG,
        params,
        num_slots=4,
        cache_len=48,
        param_shardings=shardings,
        cache_sharding=jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(None, "data", None, None, None)),
    )
    assert slot_sharded.decode_widths == [4]  # a narrower batch might not split over "data": whole batches only
    layer_sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(None, "tensor", None, None))
    assert all(k.sharding.is_equivalent_to(layer_sharding, 4) for k in sharded._state.cache.k)  # one per layer
    q_kernel = sharded._params["layers"][0]["q_proj"]["kernel"]  # [D, H, Dh]: the engine splits the layers
    assert q_kernel.addressable_shards[0].data.shape[1] == CONFIG.num_heads // 2
    sampling_params = SamplingParams(temperature=0.8, max_new_tokens=10, n=2, seed=4)
    got = sharded.generate(PROMPTS, sampling_params)
    want = engine.generate(PROMPTS, sampling_params)
    np.testing.assert_array_equal(got.completion_ids, want.completion_ids)
    np.testing.assert_allclose(got.behavior_logprobs, want.behavior_logprobs, atol=1e-5)
    # Inserting prompts (one program per layer) and decoding keep every layer's cache on its sharding.
    for arrays in (sharded._state.cache.k, sharded._state.cache.v):
        assert all(a.sharding.is_equivalent_to(layer_sharding, 4) for a in arrays)


def test_an_engine_on_the_trainers_mesh_keeps_its_state_there_from_the_start(engine, params):
    """With `param_shardings` and no `cache_sharding` (the trainer's evaluation engine) the decode state lives on the
    params' mesh from the start, each layer's cache heads on the K projection's heads axis ("tensor"), the per-slot
    fields replicated. So a warmed-up engine compiles nothing for its batch, before or after `release_memory`: a
    fresh state on one device compiled every dispatch a second time once the first had moved the state onto the
    mesh."""
    from feynrl_jax.sharding import RULES, make_mesh
    from feynrl_jax.sharding import param_shardings as make_param_shardings

    mesh = make_mesh(data=4, fsdp=1, tensor=2)
    shardings = make_param_shardings(logical_axes(CONFIG), mesh, RULES["fsdp_tp"], shapes=params)
    sharded = NativeEngine(
        CONFIG, params, num_slots=4, cache_len=48, decode_steps_per_dispatch=3, param_shardings=shardings
    )
    layer_sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(None, "tensor", None, None))
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    assert all(k.sharding.is_equivalent_to(layer_sharding, 4) for k in sharded._state.cache.k)
    assert sharded._state.tokens.sharding.is_equivalent_to(replicated, 1)
    sampling_params = SamplingParams(temperature=0.8, max_new_tokens=10, n=2, seed=4)
    sharded.warm_up([len(p) for p in PROMPTS], sampling_params)
    compiled, got = _compiled_during(lambda: sharded.generate(PROMPTS, sampling_params))
    assert compiled == [], f"the warmed-up engine compiled {compiled}"
    sharded.release_memory()
    sharded.load_params(params, 1)
    compiled, again = _compiled_during(lambda: sharded.generate(PROMPTS, sampling_params))
    assert compiled == [], f"the engine compiled {compiled} after release_memory"
    want = engine.generate(PROMPTS, sampling_params)
    for rollouts in (got, again):
        np.testing.assert_array_equal(rollouts.completion_ids, want.completion_ids)
        np.testing.assert_allclose(rollouts.behavior_logprobs, want.behavior_logprobs, atol=1e-5)
    # One sample per prompt: 4 prompts enter the 4 slots together and prefill as one batch, into the sharded cache.
    once = dataclasses.replace(sampling_params, n=1)
    assert sharded.warm_up([len(p) for p in PROMPTS], once)["batched_prefill_buckets"] == 1
    compiled, got = _compiled_during(lambda: sharded.generate(PROMPTS, once))
    assert compiled == [] and sharded.last_stats["prefill_calls"] == 2, (compiled, sharded.last_stats)
    want = engine.generate(PROMPTS, once)
    np.testing.assert_array_equal(got.completion_ids, want.completion_ids)
    np.testing.assert_allclose(got.behavior_logprobs, want.behavior_logprobs, atol=1e-5)


def test_the_cache_follows_the_k_projections_heads_axis_on_the_params_mesh():
    """`_cache_sharding_like`: the stacked cache's heads axis (2) on the mesh axis of the K projection kernel's heads
    axis (a plain or an NF4 kernel), the rest replicated; one sharding for every param gives a replicated cache; no
    mesh shardings, none."""
    from feynrl_jax.rollout.native_engine import _cache_sharding_like

    mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(2, 2, 2), ("data", "fsdp", "tensor"))
    spec = jax.sharding.PartitionSpec

    def tree(name: str, kernel_spec) -> dict:
        return {"layers": {"k_proj": {name: jax.sharding.NamedSharding(mesh, kernel_spec)}}}

    for name in ("kernel", "kernel_nf4"):
        got = _cache_sharding_like(tree(name, spec(None, "fsdp", "tensor", None)))
        assert got.mesh == mesh and got.spec == spec(None, None, "tensor")
        assert _cache_sharding_like(tree(name, spec(None, "fsdp"))).spec == spec(None, None, None)
    assert _cache_sharding_like(jax.sharding.NamedSharding(mesh, spec())).spec == spec()
    assert _cache_sharding_like(None) is None
    assert _cache_sharding_like({"layers": {}}) is None
    single = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    assert _cache_sharding_like({"layers": {"k_proj": {"kernel": single}}}) is None


def test_engine_recovers_after_an_error_mid_generation(engine):
    sampling_params = SamplingParams(temperature=1.0, max_new_tokens=6, seed=8)
    want = engine.generate(PROMPTS, sampling_params)

    def broken_detokenize(ids):
        raise RuntimeError("tokenizer failed")

    engine.detokenize = broken_detokenize
    try:
        with pytest.raises(RuntimeError, match="tokenizer failed"):
            engine.generate(PROMPTS, SamplingParams(max_new_tokens=6, stop_strings=("x",)))
    finally:
        engine.detokenize = None
    got = engine.generate(PROMPTS, sampling_params)  # slots left active by the failed call are freed
    np.testing.assert_array_equal(got.completion_ids, want.completion_ids)


def test_the_tail_decodes_in_a_narrower_batch_with_the_same_tokens(params):
    """Once no sequence waits and one may run two more dispatches, the live slots move into a batch of a quarter,
    then a sixteenth, of the slots (free
    slots filling the rows they leave): the same tokens (each row keeps its own PRNG stream; this tiny model has no
    near ties), the trainer's log-probs, fewer slot-steps, and the engine's whole-width state back for the next
    call, also after a call that failed while narrowed."""
    kwargs = dict(num_slots=16, cache_len=48, decode_steps_per_dispatch=2)
    narrow, wide = NativeEngine(CONFIG, params, **kwargs), NativeEngine(CONFIG, params, narrow_tail=False, **kwargs)
    assert narrow.decode_widths == [16, 4, 1] and wide.decode_widths == [16]
    prompts = (PROMPTS * 4)[:16]
    # One sample each: after the first dispatch 3 rows run (16 -> 4 rows, one of them a filler), after the third
    # one row (4 -> 1).
    caps = [2] * 13 + [6, 6, 12]
    sampling_params = SamplingParams(temperature=1.0, max_new_tokens=12, seed=3)
    out = {}
    for name, engine in (("narrow", narrow), ("wide", wide)):
        out[name] = engine.generate(prompts, sampling_params, max_new_tokens=caps)
    stats = {"narrow": narrow.last_stats, "wide": wide.last_stats}
    assert stats["wide"]["narrowings"] == 0 and stats["narrow"]["narrowings"] == 2, stats
    # Slot-steps: 16 rows x 2 steps, then 4 x 4 (to step 6), then 1 x 6; the wide engine 16 x 12.
    assert stats["narrow"]["slot_utilisation"] == sum(caps) / (16 * 2 + 4 * 4 + 1 * 6)
    assert stats["wide"]["slot_utilisation"] == sum(caps) / (16 * 12)
    np.testing.assert_array_equal(out["narrow"].completion_ids, out["wide"].completion_ids)
    np.testing.assert_array_equal(out["narrow"].completion_lengths, caps)
    np.testing.assert_array_equal(out["narrow"].finish_reason, out["wide"].finish_reason)
    np.testing.assert_allclose(out["narrow"].behavior_logprobs, out["wide"].behavior_logprobs, atol=1e-5, rtol=0)
    for i, ref in enumerate(_trainer_logprobs(params, out["narrow"], 1.0)):
        np.testing.assert_allclose(out["narrow"].behavior_logprobs[i, : len(ref)], ref, atol=1e-5, rtol=0)
    # A short tail (the longest live row has less than two dispatches left) stays in the whole batch.
    narrow.generate(prompts, sampling_params, max_new_tokens=[2] * 13 + [4, 4, 5])
    assert narrow.last_stats["narrowings"] == 0
    # The next call starts from the whole-width state again, and samples the same rows the same way.
    again = narrow.generate(prompts, sampling_params, max_new_tokens=caps)
    np.testing.assert_array_equal(again.completion_ids, out["narrow"].completion_ids)
    assert narrow._state.cache.k[0].shape[0] == 16
    # Stop strings end rows after narrowing (the slot is freed on the device too), and an error while narrowed
    # leaves the whole-width state for the next call.
    with_stop = dataclasses.replace(sampling_params, stop_strings=("x",))
    narrow.detokenize = lambda ids: "x" if len(ids) >= 9 else "a"  # the cap-12 row stops at 9 tokens, when alone
    try:
        stopped = narrow.generate(prompts, with_stop, max_new_tokens=caps)
        assert narrow.last_stats["narrowings"] == 2
        assert stopped.completion_lengths[-1] == 9 and stopped.finish_reason[-1] == FINISH_STOP
        np.testing.assert_array_equal(stopped.completion_ids[-1, :9], out["narrow"].completion_ids[-1, :9])

        def broken(ids):  # only the last row reaches 7 tokens, after the batch narrowed to it
            if len(ids) >= 7:
                raise RuntimeError("tokenizer failed")
            return "a"

        narrow.detokenize = broken
        with pytest.raises(RuntimeError, match="tokenizer failed"):
            narrow.generate(prompts, with_stop, max_new_tokens=caps)
    finally:
        narrow.detokenize = None
    assert narrow._state.cache.k[0].shape[0] == 16
    np.testing.assert_array_equal(
        narrow.generate(prompts, sampling_params, max_new_tokens=caps).completion_ids, out["narrow"].completion_ids
    )


def test_engine_splits_its_weights_with_one_program_for_every_layer():
    """The engine's per-layer weights equal `unstack_layers(as_param_dtype(...))` exactly (here float32 masters of
    a bfloat16 model), made by one compiled program that serves every layer: a program over all layers compiled
    a kernel per layer, seconds at the start of every run (`benchmarks/bench_engine_start.py`)."""
    config = dataclasses.replace(CONFIG, num_layers=3, param_dtype="bfloat16", compute_dtype="bfloat16")
    masters = init_params(dataclasses.replace(config, param_dtype="float32"), jax.random.PRNGKey(4))
    engine = NativeEngine(config, masters, num_slots=2, cache_len=32)
    expected = unstack_layers(as_param_dtype(masters, config))
    assert jax.tree.structure(engine._params) == jax.tree.structure(expected)
    for got, want in zip(jax.tree.leaves(engine._params), jax.tree.leaves(expected), strict=True):
        assert got.dtype == want.dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    engine.load_params(jax.tree.map(lambda a: a * 2, masters), 1)
    assert engine._layer_of._cache_size() == 1


def test_inserting_a_prompt_writes_its_slot_of_one_layer_and_nothing_else():
    """Row 1 of a prefill batch of 3, layer 2, into slot 1."""
    layers, slots, heads, dh, cache_len, bucket, batch = 3, 4, 2, 5, 12, 8, 3
    keys = jax.random.split(jax.random.PRNGKey(5), 4)
    k = jax.random.normal(keys[0], (slots, heads, dh, cache_len))
    v = jax.random.normal(keys[1], (slots, heads, cache_len, dh))
    prefix = KVCache(
        k=jax.random.normal(keys[2], (layers, batch, heads, dh, bucket)),
        v=jax.random.normal(keys[3], (layers, batch, heads, bucket, dh)),
    )
    new_k, new_v = jax.jit(insert_prefix)(k, v, prefix, jnp.int32(2), jnp.int32(1), jnp.int32(1))
    want_k, want_v = np.array(k), np.array(v)
    want_k[1, :, :, :bucket] = prefix.k[2, 1]
    want_v[1, :, :bucket] = prefix.v[2, 1]
    np.testing.assert_array_equal(new_k, want_k)
    np.testing.assert_array_equal(new_v, want_v)


def test_prompts_entering_together_prefill_in_batches_and_sample_the_same(engine, params):
    """Prompts of one prefill bucket that enter the slots together, one sample each, are prefilled `prefill_batch`
    at a time while more than half a batch is left (padding rows fill a short batch), the rest one at a time: 7
    one-sample prompts of one bucket in 8 slots take a batch of 4 and one of 3 padded to 4. The completions are those
    of an engine that prefills one prompt at a time (log-probabilities to float32 rounding: the prefill's matrix
    products have another row count)."""
    prompts = [[3 + i, 4 + i, 5 + i, 6 + i] for i in range(7)]
    sampling_params = SamplingParams(temperature=0.8, max_new_tokens=6, seed=9)
    batched = NativeEngine(CONFIG, params, num_slots=8, cache_len=48, decode_steps_per_dispatch=3)
    single = NativeEngine(CONFIG, params, num_slots=8, cache_len=48, decode_steps_per_dispatch=3, prefill_batch=1)
    got, want = batched.generate(prompts, sampling_params), single.generate(prompts, sampling_params)
    assert (batched.last_stats["prefills"], batched.last_stats["prefill_calls"]) == (7, 2)
    assert (single.last_stats["prefills"], single.last_stats["prefill_calls"]) == (7, 7)
    np.testing.assert_array_equal(got.completion_ids, want.completion_ids)
    np.testing.assert_allclose(got.behavior_logprobs, want.behavior_logprobs, atol=1e-5)
    # Two prompts are not more than half a batch: one at a time.
    engine.generate(prompts[:2], sampling_params)
    assert engine.last_stats["prefill_calls"] == 2
    # With several samples per prompt one prefill serves them all already: one at a time, and none warmed up.
    batched.generate(prompts, dataclasses.replace(sampling_params, n=2))
    assert (batched.last_stats["prefills"], batched.last_stats["prefill_calls"]) == (7, 7)
    assert batched.warm_up([4] * 7, dataclasses.replace(sampling_params, n=2))["batched_prefill_buckets"] == 0
    assert batched.warm_up([4] * 7, sampling_params)["batched_prefill_buckets"] == 1


def test_one_insert_program_serves_every_layer_and_slot(params):
    engine = NativeEngine(CONFIG, params, num_slots=SLOTS, cache_len=48, decode_steps_per_dispatch=4)
    engine.generate(PROMPTS, SamplingParams(n=2, max_new_tokens=3))
    assert engine._insert_prefix._cache_size() == 1
    assert engine._insert._cache_size() == 1


@pytest.mark.parametrize("program, failing_call", [("_insert_prefix", 2), ("_insert", 1), ("_decode", 1)])
def test_a_call_interrupted_inside_a_step_leaves_a_working_engine(params, program, failing_call):
    """Inserting a prompt runs one program per layer, then one on the slot's fields, each donating the arrays it is
    given: an interruption right after one of them ran (its donated inputs deleted, its result lost) must leave an
    engine whose next call samples what it would have."""
    engine = NativeEngine(CONFIG, params, num_slots=SLOTS, cache_len=48, decode_steps_per_dispatch=4)
    sampling_params = SamplingParams(temperature=0.9, max_new_tokens=6, n=2, seed=3)
    want = engine.generate(PROMPTS, sampling_params)
    real, calls = getattr(engine, program), []

    def interrupted(*args, **kwargs):
        result = real(*args, **kwargs)
        calls.append(1)
        if len(calls) == failing_call:
            jax.block_until_ready(result)
            raise KeyboardInterrupt(f"interrupted after {program}")
        return result

    setattr(engine, program, interrupted)
    with pytest.raises(KeyboardInterrupt):
        engine.generate(PROMPTS, sampling_params)
    setattr(engine, program, real)
    got = engine.generate(PROMPTS, sampling_params)  # the same programs on the same inputs: the same bits
    np.testing.assert_array_equal(got.completion_ids, want.completion_ids)
    np.testing.assert_array_equal(got.behavior_logprobs, want.behavior_logprobs)


def test_params_with_another_layer_count_are_refused(params):
    engine = NativeEngine(CONFIG, params, num_slots=SLOTS, cache_len=48)
    three = dataclasses.replace(CONFIG, num_layers=3)
    with pytest.raises(ValueError, match=r"params' layers hold \[3\] layers, the model config 2"):
        engine.load_params(init_params(three, jax.random.PRNGKey(1)), 1)
    # The held params were released first: the engine refuses to generate until a load succeeds.
    with pytest.raises(RuntimeError, match="no params loaded"):
        engine.generate(PROMPTS[:1], SamplingParams(max_new_tokens=2))
    engine.load_params(params, 2)
    assert engine.generate(PROMPTS[:1], SamplingParams(max_new_tokens=2)).policy_version.tolist() == [2]


def _compiled_during(call) -> tuple[list[str], object]:
    """The programs this thread compiled while running `call()` (a persistent-cache hit counts), and its result."""
    clock = compile_clock()
    before = len(clock.names())
    result = call()
    return clock.names()[before:], result


WARM_KWARGS = dict(num_slots=16, cache_len=48, decode_steps_per_dispatch=2)


def test_a_warmed_up_engine_compiles_nothing_for_its_batch_and_samples_the_same(params):
    """`warm_up` on placeholder weights compiles every program a batch of these prompt lengths runs, the narrowed
    tail's widths and both attend lengths included: after loading the real weights, that batch compiles nothing, and
    it returns exactly what an engine that never warmed up returns (which compiled on its way)."""
    prompts = (PROMPTS * 4)[:16]
    # One sample each. caps: after the first dispatch 3 rows run (16 -> 4 rows), after the third one row (4 -> 1),
    # which reaches 3 + 28 positions (attend length 48; the first dispatches attend to 32).
    caps = [2] * 13 + [6, 6, 30]
    sampling_params = SamplingParams(temperature=1.0, max_new_tokens=30, seed=3)
    warm = NativeEngine(CONFIG, placeholder_params(CONFIG), policy_version=-1, **WARM_KWARGS)
    stats = warm.warm_up([len(p) for p in prompts], sampling_params)
    assert stats["dispatch_programs"] == 3 * 2 and stats["prefill_buckets"] == 1, stats  # widths 16, 4, 1 x 32, 48
    assert stats["complete"] == 1.0
    warm.load_params(params, 1)
    cold = NativeEngine(CONFIG, params, policy_version=1, **WARM_KWARGS)
    warm_compiles, out = _compiled_during(lambda: warm.generate(prompts, sampling_params, max_new_tokens=caps))
    cold_compiles, expected = _compiled_during(lambda: cold.generate(prompts, sampling_params, max_new_tokens=caps))
    assert warm.last_stats["narrowings"] == 2 and warm.last_stats["prefills"] == 16, warm.last_stats
    assert warm_compiles == [], warm_compiles
    assert cold_compiles.count("jit(dispatch)") >= 3 and "jit(prefill)" in cold_compiles, cold_compiles
    np.testing.assert_array_equal(out.completion_ids, expected.completion_ids)
    np.testing.assert_array_equal(out.completion_lengths, caps)
    np.testing.assert_array_equal(out.behavior_logprobs, expected.behavior_logprobs)
    np.testing.assert_array_equal(out.policy_version, np.ones(16))


@pytest.mark.parametrize(
    ("lengths", "n", "max_new_tokens", "caps", "programs", "stop"),
    [
        # 4 rows fit in a quarter of the 16 slots: the batch narrows before its first dispatch (4 -> 1 later).
        # Widths 16, 4, 1 x attend lengths 32, 48 (the 40-token prompt).
        ([3, 40], 2, 5, [5, 3], 3 * 2, False),
        # 8 rows, 5 new tokens: no room for two dispatches after the first, so the whole width only.
        ([3, 40, 5, 7], 2, 5, [5, 5, 5, 5], 1 * 2, False),
        # 20 rows in 16 slots: a refill empties the queue (the last prompt's rows, at their whole cap), then the
        # third prompt's rows narrow to 4 and a stop string ends them there. Widths 16, 4, 1 x attend length 32.
        ([3, 10, 6, 2, 8], 4, 8, [2, 2, 8, 2, 2], 3 * 1, True),
    ],
)
def test_every_batch_shape_finds_its_programs_warmed_up(params, lengths, n, max_new_tokens, caps, programs, stop):
    prompts = [[(7 * i + j) % 90 + 1 for j in range(length)] for i, length in enumerate(lengths)]
    sampling_params = SamplingParams(temperature=1.0, max_new_tokens=max_new_tokens, n=n, seed=5)
    if stop:  # a row stops once its text holds 5 tokens: in the narrowed tail
        sampling_params = dataclasses.replace(sampling_params, stop_strings=("x",))
    detokenize = lambda ids: "x" if len(ids) >= 5 else "a"  # noqa: E731
    engine = NativeEngine(CONFIG, placeholder_params(CONFIG), detokenize=detokenize, **WARM_KWARGS)
    stats = engine.warm_up(lengths, sampling_params)
    assert stats["dispatch_programs"] == programs, stats
    engine.load_params(params, 1)
    compiled, out = _compiled_during(lambda: engine.generate(prompts, sampling_params, max_new_tokens=caps))
    assert compiled == [], compiled
    assert (engine.last_stats["narrowings"] > 0) == (programs != 2), engine.last_stats
    if stop:
        assert (out.finish_reason[8:12] == FINISH_STOP).all() and (out.completion_lengths[8:12] == 5).all()
    expected = NativeEngine(CONFIG, params, detokenize=detokenize, **WARM_KWARGS).generate(
        prompts, sampling_params, max_new_tokens=caps
    )
    np.testing.assert_array_equal(out.completion_ids, expected.completion_ids)
    np.testing.assert_array_equal(out.finish_reason, expected.finish_reason)


def test_a_warm_up_changes_nothing_an_engine_returns_and_can_be_cut_short(engine, params):
    """A warm-up of an engine in use leaves what it returns unchanged; one whose `stop()` answers True at once
    compiles the whole width and prefill only, and the batch then compiles the rest itself."""
    sampling_params = SamplingParams(temperature=0.9, max_new_tokens=12, n=2, seed=21)
    before = engine.generate(PROMPTS, sampling_params)
    assert engine.warm_up([len(p) for p in PROMPTS], sampling_params)["complete"] == 1.0
    after = engine.generate(PROMPTS, sampling_params)
    np.testing.assert_array_equal(after.completion_ids, before.completion_ids)
    np.testing.assert_array_equal(after.behavior_logprobs, before.behavior_logprobs)

    fresh = NativeEngine(CONFIG, params, **WARM_KWARGS)
    prompts = (PROMPTS * 4)[:16]
    stats = fresh.warm_up([len(p) for p in prompts], SamplingParams(max_new_tokens=30), stop=lambda: True)
    assert stats["complete"] == 0.0 and stats["dispatch_programs"] == 2, stats  # the whole width's 32 and 48
    compiled, _ = _compiled_during(
        lambda: fresh.generate(prompts, SamplingParams(max_new_tokens=30), max_new_tokens=[2] * 13 + [6, 6, 30])
    )
    assert compiled.count("jit(dispatch)") >= 2 and "jit(prefill)" not in compiled, compiled


def test_a_warm_up_cut_short_is_finished_later_and_the_batch_then_compiles_nothing(params):
    """`finish_warm_up` compiles what a warm-up cut short left (going on from where a second `stop()` ended it, and
    keeping it while the engine holds no params): the batch whose tail narrows to every width then compiles
    nothing and samples what an engine that never warmed up samples."""
    prompts = (PROMPTS * 4)[:16]
    sampling_params = SamplingParams(temperature=1.0, max_new_tokens=30, seed=3)
    caps = [2] * 13 + [6, 6, 30]  # 16 rows, then 3 (width 4), then 1 (width 1)
    engine = NativeEngine(CONFIG, placeholder_params(CONFIG), **WARM_KWARGS)
    assert engine.warm_up([len(p) for p in prompts], sampling_params, stop=lambda: True)["complete"] == 0.0
    # Widths 4 and 1: the gathers 16->4, 16->1 and 4->1, and each width's dispatch at attend lengths 32 and 48.
    assert engine.warm_up_left == 7
    engine.release_memory()
    assert engine.finish_warm_up() == {"seconds": pytest.approx(0, abs=1), "dispatch_programs": 0.0, "complete": 0.0}
    assert engine.warm_up_left == 7
    engine.load_params(placeholder_params(CONFIG), 0)
    answers = iter([False, False, True])  # the gather into width 4 and one of its dispatches, then stop
    part = engine.finish_warm_up(stop=lambda: next(answers))
    assert part["complete"] == 0.0 and part["dispatch_programs"] == 1.0 and engine.warm_up_left == 5
    rest = engine.finish_warm_up()
    assert rest["complete"] == 1.0 and rest["dispatch_programs"] == 3.0 and engine.warm_up_left == 0
    assert engine.finish_warm_up()["dispatch_programs"] == 0.0  # nothing left

    engine.load_params(params, 1)
    compiled, out = _compiled_during(lambda: engine.generate(prompts, sampling_params, max_new_tokens=caps))
    assert compiled == [] and engine.last_stats["narrowings"] == 2, (compiled, engine.last_stats)
    expected = NativeEngine(CONFIG, params, **WARM_KWARGS).generate(prompts, sampling_params, max_new_tokens=caps)
    np.testing.assert_array_equal(out.completion_ids, expected.completion_ids)
    np.testing.assert_array_equal(out.behavior_logprobs, expected.behavior_logprobs)


def test_a_warm_up_for_prompts_too_long_for_the_cache_is_refused(engine):
    with pytest.raises(ValueError, match="a prompt of 48 tokens leaves no room"):
        engine.warm_up([48], SamplingParams(max_new_tokens=5))
    with pytest.raises(ValueError, match="prompt lengths must be >= 1"):
        engine.warm_up([], SamplingParams(max_new_tokens=5))


@pytest.mark.parametrize(
    "changes",
    [
        {},
        {"lora_rank": 4, "lora_targets": ("q_proj", "down_proj")},
        {"lora_rank": 4, "lora_targets": ("q_proj",), "param_dtype": "bfloat16"},  # adapters in bfloat16 too
        {"base_quantization": "nf4"},
    ],
)
def test_placeholder_params_have_the_shapes_and_dtypes_the_model_computes_with(changes):
    config = dataclasses.replace(CONFIG, **changes)
    placeholder = placeholder_params(config)
    real = as_param_dtype(init_params(config, jax.random.PRNGKey(1)), config)
    assert jax.tree.structure(placeholder) == jax.tree.structure(real)
    for a, b in zip(jax.tree.leaves(placeholder), jax.tree.leaves(real)):
        assert isinstance(a, np.ndarray) and (a.shape, a.dtype) == (b.shape, b.dtype) and not a.any()


def test_release_memory_frees_params_and_cache_and_a_reload_generates_the_same(params):
    """`release_memory` drops the held params and decode state (the trainer's evaluation engine, between
    evaluations); the engine refuses to generate until a load, then returns exactly what it returned before."""
    engine = NativeEngine(CONFIG, params, num_slots=SLOTS, cache_len=48, decode_steps_per_dispatch=4)
    sampling_params = SamplingParams(temperature=0.7, max_new_tokens=9, n=2, seed=3)
    want = engine.generate(PROMPTS, sampling_params)
    engine.release_memory()
    assert engine._params is None and engine._state is None  # nothing held but the compiled programs
    for call in (
        lambda: engine.generate(PROMPTS[:1], sampling_params),
        lambda: engine.warm_up([3], sampling_params),
    ):
        with pytest.raises(RuntimeError, match="no params loaded .* or release_memory freed them"):
            call()
    engine.load_params(params, 4)
    got = engine.generate(PROMPTS, sampling_params)
    np.testing.assert_array_equal(got.completion_ids, want.completion_ids)
    np.testing.assert_array_equal(got.behavior_logprobs, want.behavior_logprobs)
    assert set(got.policy_version.tolist()) == {4}


def test_adapters_alone_are_refused_once_the_base_was_released():
    lora_config = dataclasses.replace(CONFIG, lora_rank=4, lora_targets=("q_proj", "v_proj"))
    lora_params = init_params(lora_config, jax.random.PRNGKey(2))
    engine = NativeEngine(lora_config, lora_params, num_slots=SLOTS, cache_len=48)
    engine.release_memory()
    with pytest.raises(RuntimeError, match="load_adapters: no params loaded"):
        engine.load_adapters(lora.adapters_of(lora_params), 1)
    engine.load_params(lora_params, 2)
    engine.load_adapters(lora.adapters_of(lora_params), 3)
    assert set(engine.generate(PROMPTS[:2], SamplingParams(max_new_tokens=2)).policy_version.tolist()) == {3}
