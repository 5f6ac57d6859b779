"""Sampling correctness: empirical frequencies match the exact target distribution, log-probs match it too."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats

from feynrl_jax.rollout import sampling
from feynrl_jax.rollout.types import Rollouts, SamplingParams

# A small fixed distribution with a clear order and two tied entries (indices 3 and 4).
LOGITS = np.array([2.0, 1.2, 0.7, 0.3, 0.3, -0.4, -1.0, -2.5], np.float32)
DRAWS = 200_000


def _target(logits, temperature, top_k, top_p):
    """The documented target: softmax(l / T), keep top-k, renormalise, keep the top-p nucleus, renormalise."""
    z = logits.astype(np.float64) / temperature
    order = np.argsort(-z, kind="stable")
    keep = np.zeros(len(z), bool)
    keep[order[: (top_k or len(z))]] = True
    p = np.where(keep, np.exp(z - z.max()), 0.0)
    p /= p.sum()
    if top_p < 1.0:
        # The nucleus is {p >= t*}, t* the largest probability whose tokens at or above it hold >= top_p.
        t_star = max(v for v in p if p[p >= v].sum() >= top_p)
        p = np.where(p >= t_star, p, 0.0)
        p /= p.sum()
    return p


@functools.partial(jax.jit, static_argnames=("temperature", "top_k", "top_p"))
def _draw(logits, keys, *, temperature, top_k, top_p):
    logits = jnp.broadcast_to(logits, (keys.shape[0], logits.shape[0]))
    return sampling.sample(logits, keys, temperature=temperature, top_k=top_k, top_p=top_p)


@pytest.mark.parametrize(
    "temperature, top_k, top_p",
    [
        (1.0, 0, 1.0),
        (0.7, 0, 1.0),
        (1.6, 0, 1.0),
        (1.0, 3, 1.0),
        (1.0, 0, 0.8),
        (0.8, 5, 0.9),
        (1.3, 0, 0.55),
        (1.0, 0, 0.87),
    ],
)
def test_frequencies_match_target_distribution(temperature, top_k, top_p):
    keys = sampling.row_keys(1234, jnp.arange(DRAWS), jnp.zeros(DRAWS, jnp.int32))
    keys = sampling.step_keys(keys, jnp.full(DRAWS, 7))
    tokens, logprobs = _draw(jnp.asarray(LOGITS), keys, temperature=temperature, top_k=top_k, top_p=top_p)
    tokens, logprobs = np.asarray(tokens), np.asarray(logprobs)
    target = _target(LOGITS, temperature, top_k, top_p)
    counts = np.bincount(tokens, minlength=len(LOGITS))
    support = target > 0
    assert counts[~support].sum() == 0, f"sampled outside the support: {counts}, target {target}"
    result = stats.chisquare(counts[support], DRAWS * target[support])
    assert result.pvalue > 1e-3, f"chi-square p={result.pvalue:.2e} counts={counts} expected={DRAWS * target}"
    # The reported log-prob is the exact log q of the sampled token.
    np.testing.assert_allclose(logprobs, np.log(target[tokens]), atol=2e-6)


def test_truncation_cases_differ_from_plain_softmax():
    # Guard against a test that passes because truncation silently does nothing.
    plain = _target(LOGITS, 1.0, 0, 1.0)
    assert (_target(LOGITS, 1.0, 3, 1.0) > 0).sum() == 3
    assert (_target(LOGITS, 1.0, 0, 0.8) > 0).sum() < (plain > 0).sum()


def test_sampling_distribution_matches_target():
    for temperature, top_k, top_p in [(1.0, 0, 1.0), (0.8, 5, 0.9), (1.3, 0, 0.55)]:
        logq = sampling.sampling_distribution(
            jnp.asarray(LOGITS)[None], temperature=temperature, top_k=top_k, top_p=top_p
        )
        np.testing.assert_allclose(np.exp(np.asarray(logq[0])), _target(LOGITS, temperature, top_k, top_p), atol=1e-6)


def test_greedy_takes_argmax_and_reports_model_logprob():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(6, 50)).astype(np.float32)
    keys = sampling.row_keys(0, jnp.arange(6), jnp.zeros(6, jnp.int32))
    tokens, logprobs = sampling.sample(jnp.asarray(logits), keys, temperature=0.5, greedy=True, top_k=3, top_p=0.5)
    np.testing.assert_array_equal(np.asarray(tokens), logits.argmax(-1))
    ref = jax.nn.log_softmax(logits / 0.5, axis=-1)[np.arange(6), logits.argmax(-1)]
    np.testing.assert_allclose(np.asarray(logprobs), np.asarray(ref), atol=1e-6)


def test_masked_tokens_are_never_sampled_and_logprob_is_renormalised():
    logits = jnp.broadcast_to(jnp.asarray(LOGITS), (4000, 8))
    banned = jnp.arange(4000) % 2 == 0  # only even rows are masked
    masked = sampling.mask_tokens(logits, jnp.array([0, 1], jnp.int32), banned)
    keys = sampling.row_keys(3, jnp.arange(4000), jnp.zeros(4000, jnp.int32))
    tokens, logprobs = jax.jit(sampling.sample)(masked, keys)
    tokens, logprobs = np.asarray(tokens), np.asarray(logprobs)
    assert not np.isin(tokens[0::2], [0, 1]).any()
    assert np.isin(tokens[1::2], [0, 1]).any()
    target = _target(np.where(np.arange(8) < 2, -np.inf, LOGITS).astype(np.float32), 1.0, 0, 1.0)
    np.testing.assert_allclose(logprobs[0::2], np.log(target[tokens[0::2]]), atol=2e-6)


@settings(max_examples=15, deadline=None)
@given(
    seed=st.integers(0, 1000),
    temperature=st.sampled_from([0.3, 1.0, 1.7]),
    top_k=st.sampled_from([0, 3, 20]),
    top_p=st.sampled_from([1.0, 0.9, 0.4]),
)
def test_greedy_traced_takes_the_branch_it_says(seed, temperature, top_k, top_p):
    """`greedy` traced (one program for both branches) picks the tokens the static `greedy` picks, either way, both
    compiled as the engine's decode programs are. Their log-probs are equal bit for bit at temperature 1, and within
    float32 rounding otherwise: the static program fuses the tempering product into the log-softmax's subtraction,
    which the compiler may contract into one fused multiply-add, while the `lax.cond` takes the tempered logits
    rounded; |tempered logits| <= 3 * 6 / 0.3 = 60 here, so one rounding apart is at most 60 * 2**-24 = 3.6e-6."""
    rng = np.random.default_rng(seed)
    logits = jnp.asarray(np.clip(rng.normal(scale=3.0, size=(5, 40)), -18, 18).astype(np.float32))
    keys = jnp.asarray(sampling.row_keys(seed, np.arange(5), np.zeros(5, np.int32)))
    statics = dict(top_k=top_k, use_top_p=top_p < 1.0)

    def run(logits, keys, t, p, greedy):
        return sampling.sample(logits, keys, temperature=t, top_p=p, greedy=greedy, **statics)

    traced, static = jax.jit(lambda *args: run(*args)), jax.jit(run, static_argnums=4)  # two caches
    for greedy in (True, False):
        expected = static(logits, keys, jnp.float32(temperature), jnp.float32(top_p), greedy)
        got = traced(logits, keys, jnp.float32(temperature), jnp.float32(top_p), jnp.bool_(greedy))
        assert [g.dtype for g in got] == [e.dtype for e in expected]
        np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(expected[0]))
        tolerance = 0.0 if temperature == 1.0 else 2e-5  # a few roundings of 3.6e-6 (docstring)
        np.testing.assert_allclose(np.asarray(got[1]), np.asarray(expected[1]), atol=tolerance, rtol=0)
    assert traced._cache_size() == 1


def test_row_keys_depend_on_request_sample_and_step_only():
    a = sampling.row_keys(5, jnp.array([0, 1, 2]), jnp.array([0, 0, 1]))
    b = sampling.row_keys(5, jnp.array([2, 0]), jnp.array([1, 0]))  # same sequences, other slots
    np.testing.assert_array_equal(np.asarray(a)[[2, 0]], np.asarray(b))
    assert len({tuple(k) for k in np.asarray(a).tolist()}) == 3
    s = sampling.step_keys(a, jnp.array([0, 1, 0]))
    assert not np.array_equal(np.asarray(s), np.asarray(a))
    other_seed = sampling.row_keys(6, jnp.array([0, 1, 2]), jnp.array([0, 0, 1]))
    assert not np.array_equal(np.asarray(other_seed), np.asarray(a))


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    ids=st.lists(st.tuples(st.integers(0, 2**32 - 1), st.integers(0, 2**32 - 1)), max_size=150),
)
def test_row_keys_are_each_rows_two_folds_of_the_seed_key(seed, ids):
    """Bitwise the keys of folding each row on its own, whatever the row count and its padding."""
    request_ids = np.array([r for r, _ in ids], np.uint32)
    sample_ids = np.array([s for _, s in ids], np.uint32)
    keys = sampling.row_keys(seed, request_ids, sample_ids)
    assert keys.shape == (len(ids), 2) and keys.dtype == np.uint32
    base = jax.random.PRNGKey(seed)
    expected = [np.asarray(jax.random.fold_in(jax.random.fold_in(base, r), s)) for r, s in ids[:5]]
    np.testing.assert_array_equal(keys[:5], np.array(expected, np.uint32).reshape(-1, 2))
    if ids:  # the rest, checked against the per-row folds batched (the same function of each row's ids)
        fold = jax.vmap(lambda r, s: jax.random.fold_in(jax.random.fold_in(base, r), s))
        np.testing.assert_array_equal(keys, np.asarray(fold(jnp.asarray(request_ids), jnp.asarray(sample_ids))))


def test_row_keys_compile_one_program_for_every_row_count_up_to_the_bucket():
    sampling.row_keys(0, np.arange(3), np.zeros(3, np.int32))
    before = sampling._fold_rows._cache_size()
    for rows in (1, 8, 32, 63, sampling.ROW_KEY_BUCKET):
        sampling.row_keys(rows, np.arange(rows), np.arange(rows))
    assert sampling._fold_rows._cache_size() == before
    sampling.row_keys(0, np.arange(sampling.ROW_KEY_BUCKET + 1), np.zeros(sampling.ROW_KEY_BUCKET + 1, np.int32))
    assert sampling._fold_rows._cache_size() == before + 1  # the next power of two


@pytest.mark.parametrize(
    "field, value",
    [
        ("temperature", 0.0),
        ("temperature", float("nan")),
        ("top_k", -1),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("max_new_tokens", 0),
        ("min_new_tokens", 999),
        ("stop_token_ids", (-3,)),
        ("stop_strings", ("",)),
        ("n", 0),
        ("seed", -1),
        ("greedy", "yes"),
    ],
)
def test_sampling_params_errors_name_the_field(field, value):
    with pytest.raises(ValueError, match=f"SamplingParams.{field}"):
        SamplingParams(**{field: value})


def test_sampling_params_is_hashable_and_normalises_lists():
    params = SamplingParams(stop_token_ids=[2, 3], stop_strings=["\n\n"])
    assert params.stop_token_ids == (2, 3) and params.stop_strings == ("\n\n",)
    assert hash(params) == hash(SamplingParams(stop_token_ids=(2, 3), stop_strings=("\n\n",)))


def test_rollouts_rejects_mismatched_rows():
    z = lambda *shape: np.zeros(shape, np.int32)
    with pytest.raises(ValueError, match="Rollouts.group_id"):
        Rollouts(z(2, 3), z(2), z(2, 4), z(2, 4), z(2, 4), z(2), z(3), z(2))
    with pytest.raises(ValueError, match="Rollouts.behavior_logprobs"):
        Rollouts(z(2, 3), z(2), z(2, 4), z(2, 4), z(2, 5), z(2), z(2), z(2))


@pytest.mark.parametrize("top_k, top_p", [(0, 1.0), (0, 0.7), (40, 1.0)])
def test_frequencies_match_over_several_cdf_blocks(top_k, top_p):
    # 300 entries span three blocks of the two-level inverse CDF; masked entries sit inside blocks.
    logits = np.random.default_rng(1).normal(scale=1.5, size=300).astype(np.float32)
    logits[[5, 130, 299]] = -np.inf
    draws = DRAWS // 2
    keys = sampling.row_keys(99, jnp.arange(draws), jnp.ones(draws, jnp.int32))
    tokens, logprobs = _draw(jnp.asarray(logits), keys, temperature=1.0, top_k=top_k, top_p=top_p)
    tokens, logprobs = np.asarray(tokens), np.asarray(logprobs)
    target = _target(logits, 1.0, top_k, top_p)
    counts = np.bincount(tokens, minlength=300)
    assert counts[target == 0].sum() == 0
    support = target > 0
    result = stats.chisquare(counts[support], draws * target[support] / target[support].sum())
    assert result.pvalue > 1e-3, f"chi-square p={result.pvalue:.2e}"
    np.testing.assert_allclose(logprobs, np.log(target[tokens]), atol=5e-6)
