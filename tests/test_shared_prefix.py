"""The shared-prefix layout: one row per group, completions sharing their prompt, equal to the row layout.

The model's side (`feynrl_jax.models.segments`): masks, predecessors, log-probabilities, gradients and critic
values in the shared layout equal those of one row per sample, on tiny random models with GQA, a sliding window
and QK-norm: to rounding in float64, and in float32 each layout within float32 rounding of the float64 result;
the same with attention in blocks (`feynrl_jax.models.block_attention`) on rows long enough for them to pay.
The trainer's side (`feynrl_jax.train.shared_prefix`): building the layout from rollouts, moving per-token arrays
between layouts, bad input, and the cost model.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from feynrl_jax.models import ModelConfig, SegmentBounds, block_attention, init_params, sequence_logprobs
from feynrl_jax.models import config as model_config
from feynrl_jax.models.attention import packed_mask
from feynrl_jax.models.segments import predecessor_index
from feynrl_jax.rollout.types import FINISH_LENGTH, Rollouts
from feynrl_jax.train.critic import critic_values, init_critic_params
from feynrl_jax.train.rl_batch import rollout_tokens
from feynrl_jax.train.shared_prefix import cheaper_than_rows, group_rows, shared_prefix_rows

TINY = ModelConfig(
    vocab_size=61, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8
)
CONFIGS = {
    "llama_gqa": TINY,
    "window": dataclasses.replace(TINY, sliding_window=3, architecture="mistral"),
    "qk_norm": dataclasses.replace(TINY, qk_norm=True, architecture="qwen3"),
}


def _rollouts(prompt_lengths=(5, 3), group=3, max_new=4, seed=0, vocab=61) -> Rollouts:
    """Groups of `group` samples per prompt; completion lengths vary from 0 to `max_new`."""
    rng = np.random.default_rng(seed)
    n = len(prompt_lengths) * group
    width = max(prompt_lengths)
    prompt_ids = np.zeros((n, width), np.int32)
    lengths = np.repeat(np.asarray(prompt_lengths, np.int32), group)
    completion_lengths = rng.integers(0, max_new + 1, n)
    completion_lengths[0] = max_new
    completion_ids = np.zeros((n, max_new), np.int32)
    for g, p in enumerate(prompt_lengths):
        prompt = rng.integers(1, vocab, p)
        prompt_ids[g * group : (g + 1) * group, :p] = prompt
    for i, c in enumerate(completion_lengths):
        completion_ids[i, :c] = rng.integers(1, vocab, c)
    mask = (np.arange(max_new)[None, :] < completion_lengths[:, None]).astype(np.float32)
    return Rollouts(
        prompt_ids=prompt_ids,
        prompt_lengths=lengths,
        completion_ids=completion_ids,
        completion_mask=mask,
        behavior_logprobs=-rng.random((n, max_new)).astype(np.float32) * mask,
        finish_reason=np.full(n, FINISH_LENGTH, np.int32),
        group_id=np.repeat(np.arange(len(prompt_lengths), dtype=np.int32), group),
        policy_version=np.zeros(n, np.int32),
    )


def _params(config: ModelConfig, seed: int = 0):
    params = init_params(config, jax.random.key(seed))
    return jax.tree.map(lambda x: x * 8.0 if x.ndim >= 2 else x, params)  # non-trivial logits


def _layouts(rollouts: Rollouts, prompt_width=6, completion_width=12):
    seq_len = prompt_width + rollouts.completion_ids.shape[1]
    rows = rollout_tokens(rollouts, seq_len, pad_id=0)
    shared = shared_prefix_rows(rollouts, prompt_width=prompt_width, completion_width=completion_width, pad_id=0)
    return rows, shared, seq_len


# ---------------------------------------------------------------- the model's side


def test_predecessor_index_ordinary_packing_and_continuations():
    # Row 0: two ordinary packed segments. Row 1: padding, a root of 3 tokens, two continuations from position 3.
    segment_ids = jnp.asarray([[1, 1, 1, 2, 2, 0, 0], [0, 1, 1, 1, 2, 2, 3]], jnp.int32)
    positions = jnp.asarray([[0, 1, 2, 0, 1, 0, 0], [0, 0, 1, 2, 3, 4, 3]], jnp.int32)
    index = np.asarray(predecessor_index(positions, segment_ids))
    np.testing.assert_array_equal(index[0], [-1, 0, 1, -1, 3, -1, -1])
    np.testing.assert_array_equal(index[1], [-1, -1, 1, 2, 3, 4, 3])


def test_continuation_without_its_prefix_token_has_no_predecessor():
    # A segment starting at position 5 behind a root holding only positions 0..2: nothing predicts its first token.
    segment_ids = jnp.asarray([[1, 1, 1, 2, 2]], jnp.int32)
    positions = jnp.asarray([[0, 1, 2, 5, 6]], jnp.int32)
    np.testing.assert_array_equal(np.asarray(predecessor_index(positions, segment_ids))[0], [-1, 0, 1, -1, 3])


def test_mask_continuations_see_their_prompt_not_their_siblings():
    segment_ids = jnp.asarray([[0, 1, 1, 2, 2, 3, 3]], jnp.int32)
    positions = jnp.asarray([[0, 0, 1, 2, 3, 2, 3]], jnp.int32)
    mask = np.asarray(packed_mask(positions, segment_ids, None))[0]
    assert mask[5].tolist() == [False, True, True, False, False, True, False]  # prompt + itself, not sibling 2
    assert mask[4].tolist() == [False, True, True, True, True, False, False]
    assert not mask[0].any()  # padding sees nothing
    # Ordinary packing is unchanged: segment 2 of row 0 below starts at position 0 and sees only itself.
    plain = np.asarray(packed_mask(jnp.asarray([[0, 1, 0, 1]]), jnp.asarray([[1, 1, 2, 2]]), None))[0]
    assert plain[2].tolist() == [False, False, True, False]


# Both layouts are compared in float64, where they must agree to rounding, and each float32 result against that
# float64 reference. The float32 rounding of these outputs, amplified by how ill-conditioned they are, exceeds the
# difference between the layouts on any one CPU and differs between CPUs (their matrix kernels sum in different
# orders), so comparing the two float32 results with each other would test the CPU, not the layout.
#
# Every entry must satisfy `|x - ref| <= tol * (scale + |ref|)`, the scale being the largest |ref| of a forward
# output and the 2-norm of the whole gradient for a gradient entry: rounding errors grow with the sums an entry
# comes from, not with the entry, so a purely relative test fails on entries that cancel to near 0. The errors
# quoted below are in these units, measured with XLA's default and fast-compile settings and with code generation
# capped at SSE4.2.
#
# float64: the layouts agree to 1e-15 on the gradients and exactly on log-probabilities, entropies and values (the
# same arithmetic in another order). 1e-9 is float64's eps (2.2e-16) times the float32 bound on the amplification
# below, with a margin of 4,000 for other CPUs; a real difference between the layouts moves the outputs by 2e-2
# or more (tried: one continuation's positions off by one, one prompt token hidden from the continuations).
FLOAT64_TOL = 1e-9
FLOAT32_EPS = float(np.finfo(np.float32).eps)
# float32 forward outputs: within 3 float32 eps of the reference (log-probabilities, entropies) and 15 eps (critic
# values); 256 eps is a margin of 17.
FLOAT32_FORWARD_TOL = 256 * FLOAT32_EPS
# float32 gradients: within 18 eps of the reference, 72 eps with QK-norm, whose backward pass is ill-conditioned at
# these weights (in float64, rounding the weights to float32 alone moves the q_norm/k_norm gradients by 4e-5 of
# their own norm). 1,024 eps is a margin of 14; on one CPU with AVX-512 the two float32 layouts were 37 eps apart.
FLOAT32_GRADIENT_TOL = 1024 * FLOAT32_EPS
# The model tests are compile-bound (a tiny model, four programs a test). XLA's backend optimisation level 0
# halves the compile time; it changes what the fusions are compiled to, not the arithmetic being compared.
_FAST_COMPILE = {"xla_backend_optimization_level": 0}


@pytest.fixture
def blocks_built(monkeypatch) -> list:
    """The `SegmentBounds` of every `block_attention.block_structure` traced during the test (attention in blocks)."""
    built = []
    structure = block_attention.block_structure
    monkeypatch.setattr(block_attention, "block_structure", lambda *a: built.append(a[2]) or structure(*a))
    return built


def _in_float64(run, config: ModelConfig, params, monkeypatch):
    """`run(config, params)` with the same weights and every float of the model in float64.

    The model has no float64 mode: `ModelConfig` accepts float32, bfloat16 and float16, and the model keeps its
    RMSNorm statistics, attention scores, RoPE angles, logits and values in `jnp.float32` on purpose (for
    bfloat16 compute). Under x64, pointing `jnp.float32` at float64 while `run` traces lifts those too; the
    model's code runs otherwise unchanged.
    """
    with monkeypatch.context() as patch, jax.enable_x64(True):
        patch.setattr(model_config, "DTYPES", (*model_config.DTYPES, "float64"))
        patch.setattr(jnp, "float32", jnp.float64)
        config = dataclasses.replace(config, param_dtype="float64", compute_dtype="float64")
        outputs = run(config, jax.tree.map(lambda x: np.asarray(x, np.float64), params))
    assert all(x.dtype == np.float64 for x in jax.tree.leaves(outputs))
    return outputs


def _assert_close(actual: dict, reference: dict, *, forward_tol: float, gradient_tol: float | None = None):
    """`|actual - reference| <= tol * (scale + |reference|)` for every entry (the scales: above FLOAT64_TOL).

    Args:
        actual, reference: `{name: [C] forward output on the completion tokens}`, and optionally
            `"gradient": {path: leaf}`.
        forward_tol: the tolerance of the forward outputs.
        gradient_tol: the tolerance of the gradient.
    """
    for key, ref in reference.items():
        if key != "gradient":
            scale = np.abs(ref).max()
            np.testing.assert_allclose(actual[key], ref, rtol=forward_tol, atol=forward_tol * scale, err_msg=key)
            continue
        norm = np.sqrt(sum(np.sum(np.square(leaf)) for leaf in ref.values()))
        for path, leaf in ref.items():
            np.testing.assert_allclose(
                actual[key][path], leaf, rtol=gradient_tol, atol=gradient_tol * norm, err_msg=path
            )


def _logprobs_and_gradients(
    config: ModelConfig, params, rollouts: Rollouts, completion_width: int = 12, segment_bounds=None
) -> tuple[dict, dict]:
    """Log-probabilities, entropies and the gradient of `sum(weights * logprobs)`, in the row and shared layouts
    (the shared one with `segment_bounds`: attention in blocks where they pay).

    Returns:
        `(rows, shared)`, each `{"logprobs": [C], "entropy": [C], "gradient": {path: leaf}}` in the model's dtype,
        C the completion tokens in the same order (indexed directly: `SharedPrefixRows.unpack` returns float32).
    """
    (tokens, positions, segments), shared, _ = _layouts(rollouts, completion_width=completion_width)
    weights = np.random.default_rng(1).normal(size=tokens.shape).astype(np.float32)
    valid = shared.sample_row >= 0
    row, column = shared.sample_row[valid], shared.sample_column[valid]
    mask = np.zeros_like(weights)
    mask[row, column] = 1.0

    def objective(params, tokens, positions, segments, weights, first_column, bounds):
        lp, ent = sequence_logprobs(
            params,
            tokens,
            positions,
            config=config,
            segment_ids=segments,
            with_entropy=True,
            first_column=first_column,
            segment_bounds=bounds,
        )
        return jnp.sum(lp * weights), (lp, ent)

    grad = jax.jit(jax.value_and_grad(objective, has_aux=True), static_argnums=(5, 6), compiler_options=_FAST_COMPILE)

    def outputs(lp, ent, gradient, at):
        leaves = jax.tree_util.tree_leaves_with_path(gradient)
        return {
            "logprobs": np.asarray(lp)[at],
            "entropy": np.asarray(ent)[at],
            "gradient": {jax.tree_util.keystr(path): np.asarray(leaf) for path, leaf in leaves},
        }

    (_, (lp, ent)), g = grad(params, tokens, positions, segments, weights * mask, 1, None)
    rows = outputs(lp, ent, g, (row, column))
    shared_inputs = (shared.tokens, shared.positions, shared.segment_ids, shared.pack(weights))
    (_, (lp, ent)), g = grad(params, *shared_inputs, shared.prompt_width, segment_bounds)
    return rows, outputs(lp, ent, g, valid)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_logprobs_and_gradients_equal_the_row_layout(name, monkeypatch):
    """The layouts compute the same function: equal in float64, and in float32 each within rounding of it."""
    config, params = CONFIGS[name], _params(CONFIGS[name])
    run = functools.partial(_logprobs_and_gradients, rollouts=_rollouts())
    rows64, shared64 = _in_float64(run, config, params, monkeypatch)
    assert np.abs(rows64["logprobs"]).sum() > 1.0  # the comparison is not between zeros
    _assert_close(shared64, rows64, forward_tol=FLOAT64_TOL, gradient_tol=FLOAT64_TOL)
    for float32 in run(config, params):
        _assert_close(float32, rows64, forward_tol=FLOAT32_FORWARD_TOL, gradient_tol=FLOAT32_GRADIENT_TOL)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_attention_in_blocks_equals_the_row_layout(name, monkeypatch, blocks_built):
    """Groups of 12 in the shared layout with `SegmentBounds` (`models.block_attention`): rows of 54 columns run
    attention in 7 blocks of 8 queries, each scoring 24 keys (its block, the one before, and its prompt when that
    lies further back), and compute what one row per sample computes: same tolerances as the dense layout."""
    config, params = CONFIGS[name], _params(CONFIGS[name])
    bounds = SegmentBounds(segment=6, prefix=6)  # prompts of at most 6 tokens, completions of at most 4
    assert bounds.pays(6 + 48, kv_share=0.5) and bounds.block == 8 and bounds.window == 8
    run = functools.partial(
        _logprobs_and_gradients,
        rollouts=_rollouts(prompt_lengths=(5, 3), group=12, max_new=4, seed=3),
        completion_width=48,
        segment_bounds=bounds,
    )
    rows64, shared64 = _in_float64(run, config, params, monkeypatch)
    assert blocks_built, "the blocked path did not run"
    assert np.abs(rows64["logprobs"]).sum() > 1.0
    _assert_close(shared64, rows64, forward_tol=FLOAT64_TOL, gradient_tol=FLOAT64_TOL)
    for float32 in run(config, params):
        _assert_close(float32, rows64, forward_tol=FLOAT32_FORWARD_TOL, gradient_tol=FLOAT32_GRADIENT_TOL)


def _critic_values(
    config: ModelConfig, params, rollouts: Rollouts, completion_width: int = 12, segment_bounds=None
) -> tuple[dict, dict]:
    """`(rows, shared)`, each `{"values": [C]}` on the completion tokens in the same order."""
    (tokens, positions, segments), shared, _ = _layouts(rollouts, completion_width=completion_width)
    valid = shared.sample_row >= 0
    values = functools.partial(critic_values, config=config)
    rows = jax.jit(values, compiler_options=_FAST_COMPILE)(params, tokens, positions, segments)
    shared_values = jax.jit(functools.partial(values, segment_bounds=segment_bounds), compiler_options=_FAST_COMPILE)
    packed = shared_values(params, shared.tokens, shared.positions, shared.segment_ids)
    at = (shared.sample_row[valid], shared.sample_column[valid])
    return {"values": np.asarray(rows)[at]}, {"values": np.asarray(packed)[valid]}


@pytest.mark.parametrize("blocked", [False, True])
def test_critic_values_equal_the_row_layout(blocked, monkeypatch, blocks_built):
    """Dense, and in blocks (the groups of 12 of `test_attention_in_blocks_equals_the_row_layout`)."""
    params = init_critic_params(_params(TINY), TINY)
    params = {**params, "value_head": {"kernel": jnp.linspace(-1, 1, TINY.hidden_size), "bias": jnp.asarray(0.3)}}
    run = functools.partial(_critic_values, rollouts=_rollouts(seed=3))
    if blocked:
        run = functools.partial(
            _critic_values,
            rollouts=_rollouts(prompt_lengths=(5, 3), group=12, max_new=4, seed=3),
            completion_width=48,
            segment_bounds=SegmentBounds(segment=6, prefix=6),
        )
    rows64, shared64 = _in_float64(run, TINY, params, monkeypatch)
    assert bool(blocks_built) == blocked
    assert np.abs(rows64["values"]).sum() > 1.0
    _assert_close(shared64, rows64, forward_tol=FLOAT64_TOL)
    for float32 in run(TINY, params):
        _assert_close(float32, rows64, forward_tol=FLOAT32_FORWARD_TOL)


# ---------------------------------------------------------------- the trainer's side


def test_layout_from_rollouts():
    rollouts = _rollouts(prompt_lengths=(5, 3), group=2, max_new=3, seed=4)
    shared = shared_prefix_rows(rollouts, prompt_width=6, completion_width=6, pad_id=0)
    assert shared.tokens.shape == (2, 12)
    c = rollouts.completion_lengths
    # Group 0: one pad, the 5-token prompt, then both completions back to back.
    assert shared.segment_ids[0, :6].tolist() == [0, 1, 1, 1, 1, 1]
    np.testing.assert_array_equal(shared.tokens[0, 1:6], rollouts.prompt_ids[0, :5])
    np.testing.assert_array_equal(shared.tokens[0, 6 : 6 + c[0]], rollouts.completion_ids[0, : c[0]])
    np.testing.assert_array_equal(shared.positions[0, 6 : 6 + c[0]], 5 + np.arange(c[0]))
    np.testing.assert_array_equal(shared.tokens[0, 6 + c[0] : 6 + c[0] + c[1]], rollouts.completion_ids[1, : c[1]])
    assert set(shared.segment_ids[1, 6 : 6 + c[2] + c[3]].tolist()) <= {2, 3}
    # pack then unpack is the identity on completion tokens.
    values = np.random.default_rng(0).normal(size=(4, 9)).astype(np.float32)
    mask = (np.arange(9)[None] >= rollouts.prompt_lengths[:, None]) & (
        np.arange(9)[None] < (rollouts.prompt_lengths + c)[:, None]
    )
    np.testing.assert_array_equal(shared.unpack(shared.pack(values), 9), values * mask)


def test_bad_groups_are_refused_naming_the_row():
    rollouts = _rollouts(prompt_lengths=(5, 3), group=2)
    other = rollouts.prompt_ids.copy()
    other[1, 0] = (other[1, 0] % 60) + 1
    with pytest.raises(ValueError, match="row 1: its prompt differs from row 0"):
        shared_prefix_rows(
            dataclasses.replace(rollouts, prompt_ids=other), prompt_width=6, completion_width=8, pad_id=0
        )
    with pytest.raises(ValueError, match="row 0: prompt of 5 tokens is longer than the prompt width 4"):
        shared_prefix_rows(rollouts, prompt_width=4, completion_width=8, pad_id=0)
    with pytest.raises(ValueError, match="completions need more than 2 columns"):
        shared_prefix_rows(rollouts, prompt_width=6, completion_width=2, pad_id=0)
    with pytest.raises(ValueError, match="not consecutive"):
        group_rows(np.asarray([0, 1, 0]))


def test_cost_model_prefers_sharing_short_completions_not_long_ones():
    smol = ModelConfig(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_layers=30,
        num_heads=9,
        num_kv_heads=3,
        head_dim=64,
    )
    # The demo's shapes: 8 samples of 16 tokens behind a 64-token prompt width.
    assert cheaper_than_rows(smol, group_size=8, seq_len=80, prompt_width=64, completion_width=128)
    # Long generations behind a short prompt: the shared row's quadratic attention costs more.
    assert not cheaper_than_rows(smol, group_size=16, seq_len=32832, prompt_width=64, completion_width=16 * 32768)


# ---------------------------------------------------------------- the RL trainer in both layouts


def _trainer_step(tmp_path, algo: str, mode: str, ppo_epochs: int, *, group: int = 2, narrow: bool = False):
    """One `RLTrainer.train` step on fixed rollouts: `(metrics, host params)`.

    8 prompts of `group` samples each; `narrow`: prompts of at most 8 tokens and completions of 4
    (`data.max_prompt_len=8`, `rollout.max_new_tokens=4`), where the shared layout's rows run attention in blocks.
    """
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "configs"))
    import tiny_rl

    from feynrl_jax.train.rl_trainer import RLTrainer

    config = tiny_rl.get_config(algo)
    config.run_dir = str(tmp_path / f"{algo}_{mode}_{ppo_epochs}")
    config.train.shared_prefix = mode
    config.train.mini_batches = 1
    config.train.ppo_epochs = ppo_epochs
    # 8 groups of 2: one group per fake CPU device in both layouts.
    config.rollout.n_samples = group
    config.train.global_batch_size = 8 * group
    if narrow:
        config.data.max_prompt_len, config.data.max_seq_len, config.rollout.max_new_tokens = 8, 12, 4
    config.train.micro_batch_size = 0
    config.checkpoint.every_steps = 0
    trainer = RLTrainer(config)
    trainer.start()
    assert trainer.shared_prefix == (mode == "on")
    vocab = trainer.model_config.vocab_size
    lengths = (8, 7, 1, 5, 3, 8, 2, 6) if narrow else (30, 7, 19, 12, 3, 40, 22, 9)
    rollouts = _rollouts(prompt_lengths=lengths, group=group, max_new=4 if narrow else 16, seed=5, vocab=vocab)
    rewards = np.random.default_rng(0).integers(0, 2, 8 * group).astype(np.float32)
    metrics = trainer.train(rollouts, rewards, step=1, shuffle_seed=0)
    params = trainer.host_params()
    trainer.close()
    return metrics, params


@pytest.mark.slow
@pytest.mark.parametrize("algo, ppo_epochs, blocks", [("grpo", 1, False), ("ppo", 1, True), ("cispo", 2, True)])
def test_rl_trainer_step_is_the_same_in_both_layouts(tmp_path, blocks_built, algo, ppo_epochs, blocks):
    """One trainer step on the same rollouts, one row per sample vs one row per group: same losses, gradients,
    metrics and updated params (one update: pi_old from the update's own pass; two: from a separate pass).

    `blocks`: groups of 8 behind prompts of at most 8 tokens (`_trainer_step(narrow=True)`). The trainer passes
    its layout's `SegmentBounds` (segments of at most 8 columns, prefixes of 8) to every pass (PPO's critic and
    the separate pi_old pass included), and the shared layout's 40-column rows run attention in 5 blocks."""
    group = 8 if blocks else 2
    rows, rows_params = _trainer_step(tmp_path, algo, "off", ppo_epochs, group=group, narrow=blocks)
    assert not blocks_built  # one row per sample: dense
    shared, shared_params = _trainer_step(tmp_path, algo, "on", ppo_epochs, group=group, narrow=blocks)
    assert set(blocks_built) == ({SegmentBounds(segment=8, prefix=8)} if blocks else set())
    assert rows["train/shared_prefix"] == 0.0 and shared["train/shared_prefix"] == 1.0
    assert "perf/train_tokens_per_second" in shared  # a time; only its presence is checked
    assert shared["perf/train_update_system_seconds"] >= 0.0
    assert shared["perf/train_peak_rss_gib"] > 0.1  # a process with JAX and a model (`peak_rss_gib`'s own test)
    _assert_same_step(rows, rows_params, shared, shared_params)


def _assert_same_step(rows: dict, rows_params, shared: dict, shared_params) -> None:
    """Two trainer steps agree: their losses, gradient norms, entropies and mismatch metrics, and the params."""
    for key in (
        "train/loss",
        "train/grad_norm",
        "train/entropy",
        "rollout/logprob_mismatch_kl",
        "rollout/logprob_mismatch_max_abs",
        "train/advantage_abs_mean",
    ):
        np.testing.assert_allclose(shared[key], rows[key], rtol=1e-4, atol=1e-6, err_msg=key)
    assert rows["train/grad_norm"] > 0
    # Adam's first step moves each weight by about lr * sign(gradient): where a gradient is ~0, rounding can tip
    # it. Nearly every weight must agree to 1e-6, and none may differ by more than the two-sided step 2 * lr.
    diff = np.concatenate(
        [np.abs(a - b).ravel() for a, b in zip(jax.tree.leaves(rows_params), jax.tree.leaves(shared_params))]
    )
    assert np.mean(diff > 1e-6) < 1e-4 and diff.max() <= 2.5e-4, (np.mean(diff > 1e-6), diff.max())
