"""The decoder on tiny random models, without transformers: config, masks, cache, log-probabilities, remat."""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

from feynrl_jax.models import (
    ModelConfig,
    cache_dtype,
    forward,
    init_cache,
    init_params,
    logical_axes,
    logits,
    param_shapes,
    sequence_logprobs,
    unstack_layers,
)
from feynrl_jax.models.logprobs import chunk_positions

TINY = ModelConfig(
    vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8
)


_forward = jax.jit(forward, static_argnames=("config", "remat"))
_logits = jax.jit(logits, static_argnames=("config",))
_sequence_logprobs = jax.jit(sequence_logprobs, static_argnames=("config", "with_entropy", "chunk_size", "remat"))


def _scaled_params(config, seed=0, scale=10.0):
    """Random params with kernels large enough for non-trivial logits."""
    params = init_params(config, jax.random.key(seed))
    return jax.tree_util.tree_map_with_path(
        lambda path, x: (
            x * scale if "kernel" in jax.tree_util.keystr(path) or "embedding" in jax.tree_util.keystr(path) else x
        ),
        params,
    )


def _tokens(b, t, seed=1, vocab=64):
    return jax.random.randint(jax.random.key(seed), (b, t), 0, vocab, dtype=jnp.int32)


def _positions(b, t):
    return jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))


# ---------------------------------------------------------------- config

V5 = {
    "model_type": "llama",
    "vocab_size": 100,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 128,
    "dtype": "bfloat16",
    "tie_word_embeddings": True,
    "rope_parameters": {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    },
}
LEGACY = {
    **{k: v for k, v in V5.items() if k not in ("dtype", "rope_parameters")},
    "torch_dtype": "bfloat16",
    "rope_theta": 500000.0,
    "rope_scaling": {
        "type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    },
}


def test_from_hf_reads_v5_and_legacy_layouts_alike(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(V5))
    from_file = ModelConfig.from_hf(tmp_path)
    assert from_file == ModelConfig.from_hf(LEGACY)
    assert from_file.param_dtype == from_file.compute_dtype == "bfloat16"
    assert from_file.head_dim == 16 and from_file.num_kv_heads == 2 and from_file.tie_word_embeddings
    assert from_file.rope_theta == 500000.0
    assert from_file.rope_scaling_dict()["rope_type"] == "llama3"
    assert from_file.rope_scaling_dict()["factor"] == 8.0
    assert ModelConfig.from_hf(V5, param_dtype="float32").param_dtype == "float32"
    hash(from_file)  # usable as a static jit argument
    assert ModelConfig.from_hf(from_file.to_hf()) == from_file


def test_from_hf_family_flags():
    qwen2 = ModelConfig.from_hf(
        {**V5, "model_type": "qwen2", "rope_parameters": None, "sliding_window": 32, "use_sliding_window": False}
    )
    assert qwen2.attention_bias and qwen2.sliding_window is None and not qwen2.qk_norm and qwen2.rope_scaling is None
    qwen3 = ModelConfig.from_hf({**V5, "model_type": "qwen3", "head_dim": 48})
    assert qwen3.qk_norm and qwen3.head_dim == 48
    mistral = ModelConfig.from_hf({**V5, "model_type": "mistral", "sliding_window": 32})
    assert mistral.layer_windows() == (32, 32, 32)


@pytest.mark.parametrize(
    "raw, message",
    [
        ({**V5, "model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}, "unknown architecture model_type='gpt2'"),
        ({k: v for k, v in V5.items() if k != "hidden_size"}, "missing key 'hidden_size'"),
        ({**V5, "hidden_act": "gelu"}, "hidden_act='gelu'"),
        ({**V5, "rope_parameters": {"rope_type": "longrope", "rope_theta": 1.0}}, "rope_type='longrope'"),
        ({**V5, "dtype": "int8"}, "unsupported dtype 'int8'"),
    ],
)
def test_from_hf_errors_name_file_and_key(tmp_path, raw, message):
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError) as err:
        ModelConfig.from_hf(tmp_path)
    assert message in str(err.value) and str(tmp_path / "config.json") in str(err.value)


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("architecture", "gpt2", "ModelConfig.architecture"),
        ("num_kv_heads", 3, "ModelConfig.num_kv_heads"),
        ("head_dim", 7, "ModelConfig.head_dim"),
        ("param_dtype", "float64", "ModelConfig.param_dtype"),
        ("remat", "some", "ModelConfig.remat"),
        ("layer_types", ("full_attention",), "ModelConfig.layer_types"),
    ],
)
def test_config_validation_names_the_field(field, value, message):
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(TINY, **{field: value})


def test_num_params_counts_every_leaf():
    for config in (
        TINY,
        dataclasses.replace(TINY, architecture="qwen3", qk_norm=True, attention_bias=True),
        dataclasses.replace(TINY, tie_word_embeddings=True),
    ):
        shapes = jax.tree.leaves(param_shapes(config), is_leaf=lambda x: isinstance(x, tuple))
        assert config.num_params == sum(int(np.prod(s)) for s in shapes)


# ---------------------------------------------------------------- params and axes


@pytest.mark.parametrize(
    "arch, extra",
    [
        ("llama", {}),
        ("qwen2", {"attention_bias": True}),
        ("qwen3", {"qk_norm": True}),
        ("llama", {"tie_word_embeddings": True}),
    ],
)
def test_logical_axes_match_params(arch, extra):
    config = dataclasses.replace(TINY, architecture=arch, **extra)
    params = jax.eval_shape(lambda key: init_params(config, key), jax.random.key(0))
    axes = logical_axes(config)
    is_axes = lambda x: isinstance(x, tuple) and all(isinstance(a, str) for a in x)  # noqa: E731
    assert jax.tree.structure(axes, is_leaf=is_axes) == jax.tree.structure(params)
    for ax, p in zip(jax.tree.leaves(axes, is_leaf=is_axes), jax.tree.leaves(params)):
        assert len(ax) == p.ndim
    assert axes["layers"]["q_proj"]["kernel"] == ("layers", "embed", "heads", "head_dim")
    assert ("lm_head" in params) == (not config.tie_word_embeddings)


def test_dtype_policy_bfloat16_params_float32_logits():
    config = dataclasses.replace(TINY, param_dtype="bfloat16", compute_dtype="bfloat16")
    params = init_params(config, jax.random.key(0))
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(params))
    x = _tokens(2, 5)
    hidden, _ = _forward(params, x, _positions(2, 5), config=config)
    assert hidden.dtype == jnp.bfloat16
    assert _logits(params, hidden, config=config).dtype == jnp.float32
    lp, ent = _sequence_logprobs(params, x, _positions(2, 5), config=config, with_entropy=True)
    assert lp.dtype == ent.dtype == jnp.float32
    # On a CPU with XLA's decode products (TINY's `cpu_matmul="xla"`) the cache is float32 (`cache_dtype`: XLA:CPU
    # would widen a bfloat16 cache at every decode step; oneDNN's keep it bfloat16, tests/test_onednn.py).
    held = jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16
    assert init_cache(config, 2, 8).k.dtype == cache_dtype(config) == held


def test_float32_cache_of_a_bfloat16_model_holds_bfloat16_values_and_is_as_accurate():
    """The CPU's float32 cache (`cache_dtype`) holds bfloat16-rounded keys and values, after prefill and after a
    decode step, and prefill then decode through it are at least as close to the same model computed in float32 as
    through a bfloat16 cache.

    Not bit for bit: XLA may keep a float32 intermediate of the bfloat16 model unrounded
    (`xla_allow_excess_precision`), in other places for the two caches. Since RoPE computes in float32 and rounds
    once (`apply_rope`), the float32 cache's pass keeps more of them (here its error is 15% smaller; with
    `--xla_allow_excess_precision=false` the two errors agree within 1%, as they did before). Hence the bound: no
    more than 1% above the bfloat16 cache's error; the held values are checked for bfloat16 rounding directly."""
    config = dataclasses.replace(TINY, param_dtype="bfloat16", compute_dtype="bfloat16")
    params = init_params(config, jax.random.key(0))
    wide_params = jax.tree.map(lambda a: a.astype(jnp.float32), params)  # the same bfloat16 values
    prompt, step = _tokens(2, 6), _tokens(2, 1, seed=3)
    outputs = {}
    for name, dtype, cfg, p in (
        ("float32 cache", jnp.float32, config, params),
        ("bfloat16 cache", jnp.bfloat16, config, params),
        ("float32 model", jnp.float32, TINY, wide_params),
    ):
        cache = jax.tree.map(lambda a, d=dtype: a.astype(d), init_cache(cfg, 2, 8))
        hidden, cache = _forward(p, prompt, _positions(2, 6), config=cfg, cache=cache)
        assert cache.k.dtype == cache.v.dtype == dtype
        if name == "float32 cache":
            for held in (cache.k, cache.v):
                held = np.asarray(held)
                np.testing.assert_array_equal(held, held.astype(jnp.bfloat16).astype(np.float32))
        last, cache = _forward(p, step, jnp.full((2, 1), 6, jnp.int32), config=cfg, cache=cache)
        if name == "float32 cache":
            for held in (cache.k, cache.v):
                held = np.asarray(held)
                np.testing.assert_array_equal(held, held.astype(jnp.bfloat16).astype(np.float32))
        outputs[name] = [np.asarray(x, np.float64) for x in (hidden, last)]
    for wide, narrow, reference in zip(*outputs.values()):
        wide_error, narrow_error = np.abs(wide - reference).max(), np.abs(narrow - reference).max()
        assert narrow_error > 0 and wide_error <= 1.01 * narrow_error, (wide_error, narrow_error)


# ---------------------------------------------------------------- log-probabilities


def _reference_logprobs(params, config, tokens, temperature):
    hidden, _ = _forward(params, tokens, _positions(*tokens.shape), config=config)
    z = np.asarray(_logits(params, hidden, config=config), np.float64) / temperature
    logp = z - np.log(np.exp(z - z.max(-1, keepdims=True)).sum(-1, keepdims=True)) - z.max(-1, keepdims=True)
    lp = np.take_along_axis(logp[:, :-1], np.asarray(tokens)[:, 1:, None], -1)[..., 0]
    ent = -(np.exp(logp) * logp).sum(-1)[:, :-1]
    pad = np.zeros((tokens.shape[0], 1))
    return np.concatenate([pad, lp], 1), np.concatenate([pad, ent], 1)


@pytest.mark.parametrize(
    "chunk_size, chunk_tokens, temperature",
    # 1000 x 1 and 1000 x 6: the token-slot cap decides the chunk (1 and 3 columns of both rows), not chunk_size.
    [(1, 1024, 1.0), (3, 1024, 0.7), (1000, 1024, 0.7), (1000, 1, 0.7), (1000, 6, 1.0)],
)
def test_sequence_logprobs_match_log_softmax(chunk_size, chunk_tokens, temperature):
    params = _scaled_params(TINY)
    tokens = _tokens(2, 9)
    want_lp, want_ent = _reference_logprobs(params, TINY, tokens, temperature)
    lp, ent = jax.jit(
        lambda p, x: sequence_logprobs(
            p,
            x,
            _positions(2, 9),
            config=TINY,
            temperature=temperature,
            with_entropy=True,
            chunk_size=chunk_size,
            chunk_tokens=chunk_tokens,
        )
    )(params, tokens)
    assert lp.shape == ent.shape == (2, 9)
    assert np.abs(want_lp).max() > 0.5
    np.testing.assert_allclose(lp, want_lp, atol=2e-5)
    np.testing.assert_allclose(ent, want_ent, atol=2e-5)
    assert _sequence_logprobs(params, tokens, _positions(2, 9), config=TINY)[1] is None


def _float_shapes(jaxpr):
    """Shapes of every float32 value produced anywhere in a (closed) jaxpr, sub-jaxprs included."""
    out = []
    for eqn in jaxpr.eqns:
        out += [tuple(v.aval.shape) for v in eqn.outvars if getattr(v.aval, "dtype", None) == jnp.float32]
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            out += _float_shapes(sub)
    return out


def test_sequence_logprobs_never_builds_full_float32_logits():
    params = _scaled_params(TINY)
    b, t, v = 2, 16, TINY.vocab_size
    tokens = _tokens(b, t)

    def loss(p):
        lp, ent = sequence_logprobs(p, tokens, _positions(b, t), config=TINY, with_entropy=True, chunk_size=4)
        return lp.sum() + ent.sum()

    shapes = _float_shapes(jax.make_jaxpr(jax.value_and_grad(loss))(params).jaxpr)
    vocab_sized = [s for s in shapes if s and s[-1] == v and len(s) >= 3]
    assert vocab_sized, "expected chunked [B, C, V] logits"
    assert max(int(np.prod(s[:-1])) for s in vocab_sized) <= b * 4, vocab_sized


def test_logit_chunks_hold_at_most_chunk_tokens_slots_whatever_the_rows():
    """With room for the whole sequence in `chunk_size`, the token-slot cap bounds a chunk: 8 rows x 2 columns for a
    cap of 16, 1 column of 32 rows for a cap of 16 (never less than a column), and the gradient is unchanged."""
    params = _scaled_params(TINY, scale=3.0)

    def chunks_and_grads(b, chunk_tokens):
        tokens = _tokens(b, 12)

        def loss(p):
            lp, _ = sequence_logprobs(
                p, tokens, _positions(b, 12), config=TINY, chunk_size=256, chunk_tokens=chunk_tokens
            )
            return lp.sum()

        shapes = _float_shapes(jax.make_jaxpr(jax.grad(loss))(params).jaxpr)
        widest = max(int(np.prod(s[:-1])) for s in shapes if len(s) >= 3 and s[-1] == TINY.vocab_size)
        return widest, jax.jit(jax.grad(loss))(params)

    assert chunk_positions(8, 11, 256, 16) == 2 and chunk_positions(32, 11, 256, 16) == 1
    for rows, cap, widest in [(8, 16, 16), (32, 16, 32), (8, 10**6, 8 * 11)]:
        assert chunks_and_grads(rows, cap)[0] == widest
    _, capped = chunks_and_grads(8, 16)
    _, whole = chunks_and_grads(8, 10**6)
    # The same sums in other groupings: float32 rounding of ~100 terms, ~1e-5 of the leaf's largest entry at most
    # (measured: 2e-7); a chunk scored twice or missed changes entries by their own size.
    for a, b in zip(jax.tree.leaves(capped), jax.tree.leaves(whole), strict=True):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-5 * np.abs(b).max())


def test_remat_policies_give_the_same_gradients():
    params = _scaled_params(TINY, scale=3.0)
    tokens = _tokens(2, 6)

    def grads(remat):
        loss = lambda p: sequence_logprobs(p, tokens, _positions(2, 6), config=TINY, remat=remat)[0].sum()  # noqa: E731
        return jax.jit(jax.grad(loss))(params)

    base = grads("none")
    for policy in ("full", "dots"):
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5), grads(policy), base)
    with pytest.raises(ValueError, match="remat policy"):
        grads("sometimes")


# ---------------------------------------------------------------- masks and cache


def test_padding_does_not_change_real_tokens():
    params = _scaled_params(TINY)
    tokens = _tokens(1, 6)
    short, _ = _forward(params, tokens, _positions(1, 6), config=TINY)
    padded_tokens = jnp.concatenate([tokens, jnp.full((1, 3), 5, jnp.int32)], 1)
    seg = jnp.asarray([[1] * 6 + [0] * 3], jnp.int32)
    padded, _ = _forward(params, padded_tokens, _positions(1, 9), config=TINY, segment_ids=seg)
    np.testing.assert_allclose(padded[:, :6], short, atol=1e-5)
    assert np.all(np.isfinite(np.asarray(padded)))


def test_continuous_batching_rows_at_their_own_positions():
    """Slot insertion and batched decode: rows prefilled separately, decoded together at different positions."""
    params = _scaled_params(TINY)
    prompts = [_tokens(1, 7, seed=3)[0], _tokens(1, 4, seed=4)[0]]
    full = [
        np.asarray(_logits(params, _forward(params, p[None], _positions(1, len(p)), config=TINY)[0], config=TINY))[0]
        for p in prompts
    ]
    step = jax.jit(lambda p, x, pos, s, c: forward(p, x, pos, config=TINY, segment_ids=s, cache=c))
    cache = init_cache(TINY, 2, 12)
    # Slot 1 first holds a longer, unrelated sequence that the new prompt must overwrite.
    stale = _tokens(2, 10, seed=9)
    _, cache = step(params, stale, _positions(2, 10), jnp.ones((2, 10), jnp.int32), cache)
    # Insert each prompt (all but its last token) into its own slot; the other row is padding (not written).
    for slot, prompt in enumerate(prompts):
        n = len(prompt) - 1
        x = jnp.zeros((2, 6), jnp.int32).at[slot, :n].set(prompt[:n])
        seg = jnp.zeros((2, 6), jnp.int32).at[slot, :n].set(1)
        _, cache = step(params, x, _positions(2, 6), seg, cache)
    # One batched decode step, row 0 at position 6 and row 1 at position 3.
    x = jnp.asarray([[prompts[0][-1]], [prompts[1][-1]]], jnp.int32)
    pos = jnp.asarray([[6], [3]], jnp.int32)
    hidden, cache = step(params, x, pos, jnp.ones((2, 1), jnp.int32), cache)
    out = np.asarray(_logits(params, hidden, config=TINY))
    np.testing.assert_allclose(out[0, 0], full[0][-1], atol=1e-5)
    np.testing.assert_allclose(out[1, 0], full[1][-1], atol=1e-5)


@pytest.mark.parametrize(
    "extra",
    [{}, {"architecture": "mistral", "sliding_window": 3}, {"architecture": "qwen3", "qk_norm": True}],
)
def test_per_layer_params_match_stacked(extra):
    """`unstack_layers` params (the unrolled layer loop) compute what the scan computes: no cache, a stacked
    cache (prefill), and a per-layer cache (`KVCache.unstack`, the engine's decode steps)."""
    config = dataclasses.replace(TINY, **extra)
    params = _scaled_params(config)
    split = unstack_layers(params)
    assert len(split["layers"]) == config.num_layers
    tokens, segments = _tokens(2, 6), jnp.asarray([[1] * 6, [1] * 4 + [0] * 2], jnp.int32)
    want, _ = _forward(params, tokens, _positions(2, 6), config=config, segment_ids=segments)
    got, _ = _forward(split, tokens, _positions(2, 6), config=config, segment_ids=segments)
    np.testing.assert_allclose(got, want, atol=1e-5)

    step = jax.jit(lambda p, x, pos, c: forward(p, x, pos, config=config, cache=c))
    want_hidden, want_cache = step(params, tokens, _positions(2, 6), init_cache(config, 2, 8))
    got_hidden, got_cache = step(split, tokens, _positions(2, 6), init_cache(config, 2, 8))
    np.testing.assert_allclose(got_hidden, want_hidden, atol=1e-5)
    np.testing.assert_allclose(got_cache.k, want_cache.k, atol=1e-5)
    np.testing.assert_allclose(got_cache.v, want_cache.v, atol=1e-5)

    decode = tokens[:, :1], jnp.asarray([[6], [4]], jnp.int32)
    want_hidden, want_cache = step(params, *decode, want_cache)
    got_hidden, got_cache = step(split, *decode, got_cache.unstack())
    assert isinstance(got_cache.k, tuple) and len(got_cache.k) == config.num_layers
    np.testing.assert_allclose(got_hidden, want_hidden, atol=1e-5)
    np.testing.assert_allclose(got_cache.stack().k, want_cache.k, atol=1e-5)
    np.testing.assert_allclose(got_cache.stack().v, want_cache.v, atol=1e-5)


def test_attend_len_reads_only_a_cache_prefix():
    """A decode step attending to the first `attend_len` cache indices equals one attending to all of them
    while every query sits below `attend_len` (to rounding: the masked tail adds exact zeros, but the sums
    are grouped differently)."""
    params = unstack_layers(_scaled_params(TINY))
    step = jax.jit(lambda p, x, pos, c, n: forward(p, x, pos, config=TINY, cache=c, attend_len=n), static_argnums=4)
    _, cache = step(params, _tokens(2, 6), _positions(2, 6), init_cache(TINY, 2, 16).unstack(), None)
    decode = _tokens(2, 1, seed=5), jnp.asarray([[6], [3]], jnp.int32)
    want_hidden, want_cache = step(params, *decode, cache, None)
    got_hidden, got_cache = step(params, *decode, cache, 8)
    np.testing.assert_allclose(got_hidden, want_hidden, atol=1e-6)
    np.testing.assert_allclose(got_cache.stack().k, want_cache.stack().k, atol=1e-6)
    np.testing.assert_allclose(got_cache.stack().v, want_cache.stack().v, atol=1e-6)


def test_sliding_window_limits_attention():
    config = dataclasses.replace(TINY, architecture="mistral", sliding_window=2)
    params = _scaled_params(config)
    tokens = _tokens(1, 6)
    base, _ = _forward(params, tokens, _positions(1, 6), config=config)
    # With a window of 2 and 2 layers, position 5 sees at most positions 3..5: changing token 0 or 1 is invisible.
    changed = tokens.at[0, 0].set((tokens[0, 0] + 1) % 64).at[0, 1].set((tokens[0, 1] + 1) % 64)
    out, _ = _forward(params, changed, _positions(1, 6), config=config)
    np.testing.assert_allclose(out[0, 5], base[0, 5], atol=1e-6)
    assert np.abs(np.asarray(out[0, 2] - base[0, 2])).max() > 1e-3
    full_config = dataclasses.replace(config, sliding_window=None)
    a, _ = _forward(params, tokens, _positions(1, 6), config=full_config)
    b, _ = _forward(params, changed, _positions(1, 6), config=full_config)
    assert np.abs(np.asarray(a[0, 5] - b[0, 5])).max() > 1e-3


def test_jitted_forward_does_not_retrace():
    traces = []

    @jax.jit
    def run(p, x, pos):
        traces.append(1)
        return forward(p, x, pos, config=TINY)[0]

    params = init_params(TINY, jax.random.key(0))
    run(params, _tokens(2, 5), _positions(2, 5))
    run(params, _tokens(2, 5, seed=7), _positions(2, 5))
    assert len(traces) == 1
