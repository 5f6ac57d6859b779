"""Padding-free RL updates (`feynrl_jax.train.packed_units`) and micro-batches sized by memory
(`feynrl_jax.train.token_budget`): packing moves every token exactly, the packed model computes the unpacked one's
function (float64 reference, the tolerances of tests/test_shared_prefix.py), the train step skips the micro-batches
packing empties and gives the update of the unpacked batch, and the budget picks and refuses micro-batches by
memory."""

from __future__ import annotations

import dataclasses
import functools
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))
from test_shared_prefix import (  # noqa: E402
    _FAST_COMPILE,
    FLOAT32_FORWARD_TOL,
    FLOAT32_GRADIENT_TOL,
    FLOAT64_TOL,
    TINY,
    _assert_close,
    _in_float64,
    _params,
    _rollouts,
)

from feynrl_jax.config.derived import BatchPlan  # noqa: E402
from feynrl_jax.losses import ALGORITHMS, TrainBatch  # noqa: E402
from feynrl_jax.models import ModelConfig, init_params, sequence_logprobs  # noqa: E402
from feynrl_jax.sharding import RULES, make_mesh  # noqa: E402
from feynrl_jax.train.microbatch import split_microbatches  # noqa: E402
from feynrl_jax.train.optimizer import make_optimizer  # noqa: E402
from feynrl_jax.train.packed_units import pack_rows, pack_units, unit_spans  # noqa: E402
from feynrl_jax.train.rl_batch import rollout_tokens  # noqa: E402
from feynrl_jax.train.shared_prefix import shared_prefix_rows  # noqa: E402
from feynrl_jax.train.step import ParamsSpec, make_algorithm_train_step, make_train_step, model_logprob_fn  # noqa: E402
from feynrl_jax.train.token_budget import (  # noqa: E402
    activation_bytes_per_token,
    logits_bytes,
    rl_micro_batch,
    state_bytes,
)


def _unit_batch(rollouts, layout: str) -> TrainBatch:
    """A host `TrainBatch` of `rollouts` in the row or shared-prefix layout: `old_logprobs` holds each token's id + 1
    (its place in the layout, to follow it through packing), `advantages` random weights on completion tokens."""
    seq_len = 8 + rollouts.completion_ids.shape[1]
    if layout == "rows":
        tokens, positions, segments = rollout_tokens(rollouts, seq_len, pad_id=0)
        completion = np.zeros(tokens.shape, bool)
        for i, (p, c) in enumerate(zip(rollouts.prompt_lengths, rollouts.completion_mask.sum(1).astype(int))):
            completion[i, p : p + c] = True
    else:
        shared = shared_prefix_rows(rollouts, prompt_width=8, completion_width=16, pad_id=0)
        tokens, positions, segments = shared.tokens, shared.positions, shared.segment_ids
        completion = shared.sample_row >= 0
    ids = (np.arange(tokens.size).reshape(tokens.shape) + 1).astype(np.float32) * (segments != 0)
    weights = np.random.default_rng(1).normal(size=tokens.shape).astype(np.float32) * completion
    return TrainBatch(tokens, positions, segments, completion.astype(np.float32), weights, ids)


@pytest.mark.parametrize("layout", ["rows", "shared"])
def test_packing_moves_every_token_and_field_into_the_first_micro_batches(layout):
    rollouts = _rollouts(prompt_lengths=(5, 3, 7, 2, 6, 4, 8, 1), group=2, max_new=6, seed=2)
    batch = _unit_batch(rollouts, layout)
    packed, stats = pack_units(batch, num_micro=4, pad_id=0)
    assert packed.tokens.shape == batch.tokens.shape
    # Every token with its position and fields (ids follow the tokens): each completion token once, a prompt once
    # per row its group's completions went to.
    src = packed.old_logprobs.astype(int) - 1
    valid = packed.segment_ids != 0
    trained = packed.loss_mask > 0
    assert set(src[valid].tolist()) == set((batch.old_logprobs[batch.segment_ids != 0] - 1).astype(int).tolist())
    assert sorted(src[trained].tolist()) == sorted((batch.old_logprobs[batch.loss_mask > 0] - 1).astype(int).tolist())
    flat = lambda x: np.asarray(x).reshape(-1)  # noqa: E731
    for name in ("tokens", "positions", "loss_mask", "advantages"):
        np.testing.assert_array_equal(flat(getattr(batch, name))[src[valid]], getattr(packed, name)[valid], name)
    # Segments of one row stay distinct; a unit's tokens stay in one row, in order.
    for row in range(packed.tokens.shape[0]):
        ids = packed.segment_ids[row][valid[row]]
        if ids.size == 0:
            continue
        runs = ids[np.r_[True, ids[1:] != ids[:-1]]]
        assert len(runs) == len(set(runs.tolist()))
    assert stats.rows < batch.tokens.shape[0] and stats.tokens == int(valid.sum())
    # The filled rows are dealt to the first micro-batches; the others are padding alone.
    micro = split_microbatches(packed, 4)
    filled = [bool((np.asarray(m) != 0).any()) for m in micro.segment_ids]
    assert filled == [m < stats.micro_batches for m in range(4)], (filled, stats)
    assert stats.micro_batches < 4


def test_a_group_that_fits_no_row_whole_is_split_behind_copies_of_its_prompt():
    # Width 10; three groups of the shared-prefix layout: a prompt of 2 (segment 1), then completions.
    segment_ids = np.asarray(
        [[1, 1, 2, 2, 2, 3, 3, 3, 0, 0], [1, 1, 2, 2, 3, 3, 4, 0, 0, 0], [1, 1, 2, 3, 4, 0, 0, 0, 0, 0]], np.int32
    )
    positions = np.asarray(
        [[0, 1, 2, 3, 4, 2, 3, 4, 0, 0], [0, 1, 2, 3, 2, 3, 2, 0, 0, 0], [0, 1, 2, 2, 2, 0, 0, 0, 0, 0]], np.int32
    )
    # G1 (8) opens row 0 (room 2); G2 (7) opens row 1 (room 3); G3 (5) fits no row whole: its prompt and first
    # completion fill row 1, a copy of its prompt and the other two open row 2.
    rows = pack_rows(segment_ids, *unit_spans(segment_ids))
    assert rows == [[(0, [(0, 8)])], [(1, [(0, 7)]), (2, [(0, 3)])], [(2, [(0, 2), (3, 5)])]]
    tokens = (np.arange(30).reshape(3, 10) + 1).astype(np.int32) * (segment_ids > 0)
    mask = (segment_ids > 1).astype(np.float32)
    packed, stats = pack_units(TrainBatch(tokens, positions, segment_ids, mask, mask, mask), num_micro=1, pad_id=0)
    assert (stats.units, stats.chunks, stats.rows, stats.tokens) == (3, 4, 3, 22)
    np.testing.assert_array_equal(packed.tokens[1], [11, 12, 13, 14, 15, 16, 17, 21, 22, 23])
    np.testing.assert_array_equal(packed.segment_ids[1], [1, 1, 2, 2, 3, 3, 4, 5, 5, 6])
    np.testing.assert_array_equal(packed.positions[1], [0, 1, 2, 3, 2, 3, 2, 0, 1, 2])
    np.testing.assert_array_equal(packed.tokens[2], [21, 22, 24, 25, 0, 0, 0, 0, 0, 0])
    np.testing.assert_array_equal(packed.loss_mask[2], [0, 0, 1, 1, 0, 0, 0, 0, 0, 0])
    assert packed.loss_mask.sum() == mask.sum()  # a prompt's copy trains nothing


def test_rows_with_padding_between_their_tokens_are_refused():
    with pytest.raises(ValueError, match="row 0 has padding between"):
        pack_units(
            TrainBatch(*(np.asarray([[1, 0, 1, 0]] * 2, np.int32) for _ in range(3)), *(np.zeros((2, 4)),) * 3),
            num_micro=1,
            pad_id=0,
        )


def _packed_logprobs_and_gradients(config: ModelConfig, params, rollouts, layout: str) -> tuple[dict, dict]:
    """`(unpacked, packed)`: `{"logprobs", "entropy": per token id, "gradient"}` of `sum(weights * logprobs)`."""
    batch = _unit_batch(rollouts, layout)
    packed, stats = pack_units(batch, num_micro=2, pad_id=0)
    first = 8 if layout == "shared" else 1
    assert stats.rows < batch.tokens.shape[0]
    assert stats.chunks > stats.units or layout == "rows"  # a group split behind a copy of its prompt

    def objective(params, b, first_column):
        lp, ent = sequence_logprobs(
            params, b.tokens, b.positions, config=config, segment_ids=b.segment_ids, with_entropy=True,
            first_column=first_column,
        )  # fmt: skip
        return jnp.sum(lp * b.advantages), (lp, ent)

    grad = jax.jit(jax.value_and_grad(objective, has_aux=True), static_argnums=2, compiler_options=_FAST_COMPILE)

    def outputs(b, first_column):
        (_, (lp, ent)), g = grad(params, b, first_column)
        at = np.asarray(b.loss_mask) > 0
        order = np.argsort(np.asarray(b.old_logprobs)[at])
        leaves = jax.tree_util.tree_leaves_with_path(g)
        return {
            "logprobs": np.asarray(lp)[at][order],
            "entropy": np.asarray(ent)[at][order],
            "gradient": {jax.tree_util.keystr(p): np.asarray(x) for p, x in leaves},
        }

    return outputs(batch, first), outputs(packed, 1)


@pytest.mark.parametrize("layout", ["rows", "shared"])
def test_packed_logprobs_and_gradients_equal_the_unpacked(layout, monkeypatch):
    """Packed rows compute the unpacked rows' function: equal in float64, each float32 result within rounding."""
    params = _params(TINY)
    run = functools.partial(
        _packed_logprobs_and_gradients,
        rollouts=_rollouts(prompt_lengths=(5, 3, 7, 2), group=2, max_new=6, seed=3),
        layout=layout,
    )
    unpacked64, packed64 = _in_float64(run, TINY, params, monkeypatch)
    assert np.abs(unpacked64["logprobs"]).sum() > 1.0
    _assert_close(packed64, unpacked64, forward_tol=FLOAT64_TOL, gradient_tol=FLOAT64_TOL)
    for float32 in run(TINY, params):
        _assert_close(float32, unpacked64, forward_tol=FLOAT32_FORWARD_TOL, gradient_tol=FLOAT32_GRADIENT_TOL)


def test_train_step_skips_padding_micro_batches_and_matches_the_update_without_them():
    """A step whose last micro-batches are padding alone runs the model on the others only (a host callback in the
    forward pass counts the micro-batches run) and gives the update of the step without them. Both programs add
    the same two micro-batches in the same order; XLA compiles a scan of 2 and one of 4 separately, which may
    round one float32 sum differently (1 ulp in one of 1,952 weights here), so params agree to 1e-6 relative."""
    config = TINY
    mesh = make_mesh(1, 1, 1, devices=jax.devices()[:1])
    optimizer, _ = make_optimizer(1e-3, warmup_steps=0, total_steps=10, schedule="constant")
    rollouts = _rollouts(prompt_lengths=(5, 3, 7, 2), group=2, max_new=6)
    batch = _unit_batch(rollouts, "rows")
    batch = dataclasses.replace(batch, old_logprobs=-np.abs(batch.advantages) * batch.loss_mask)
    padding = jax.tree.map(np.zeros_like, batch)
    calls = []
    model = model_logprob_fn(config)

    def predict(params, b):
        jax.debug.callback(lambda: calls.append(1))
        return model(params, b)

    results = []
    for b, accum in ((batch, 2), (jax.tree.map(lambda x, z: np.concatenate([x, z]), batch, padding), 4)):
        step = make_train_step(
            ALGORITHMS["grpo"].make_loss(kl_coef=0.0), optimizer, mesh, RULES["dp"], predict=predict,
            params_spec=ParamsSpec.of_model(config), grad_accum=accum, compiler_options=_FAST_COMPILE,
        )  # fmt: skip
        # Rows placed where `split_microbatches` deals the real ones to the first two micro-batches.
        per_micro = b.tokens.shape[0] // accum
        index = [(k % per_micro) * accum + k // per_micro for k in range(b.tokens.shape[0])]
        dealt = jax.tree.map(lambda x, index=index: np.zeros_like(x), b)
        for k, i in enumerate(index):
            for field, value in zip(dataclasses.fields(dealt), dataclasses.astuple(b)):
                if value is not None:
                    getattr(dealt, field.name)[i] = value[k]
        state = step.init_state(init_params(config, jax.random.key(0)))
        calls.clear()
        state, metrics = step(state, step.place_batch(dealt))
        jax.effects_barrier()
        results.append((jax.device_get(state.params), {k: np.asarray(m.value) for k, m in metrics.items()}, len(calls)))
    (p2, m2, n2), (p4, m4, n4) = results
    assert n2 == n4 == 2  # the two padding micro-batches never ran
    for a, b in zip(jax.tree.leaves(p2), jax.tree.leaves(p4)):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-9)
    for key in m2:
        np.testing.assert_allclose(m2[key], m4[key], rtol=1e-6, err_msg=key)
    assert m2["train/grad_norm"] > 0


# ---------------------------------------------------------------- micro-batches by memory

SMOL = ModelConfig(
    vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9, num_kv_heads=3,
    head_dim=64, tie_word_embeddings=True,
)  # fmt: skip
PLAN = BatchPlan(
    global_batch_size=32, mini_batches=1, mini_batch_size=32, micro_batch_size=32, grad_accum_steps=1,
    prompts_per_step=4,
)  # fmt: skip
GIB = 2**30


def _choose(free_gib: float, **kw):
    args = dict(
        micro_batch_size=0, micro_batch_tokens=0, seq_len=192, group_size=8, shared_width=64 + 8 * 128, shards=1
    )
    return rl_micro_batch(PLAN, SMOL, **(args | kw), free=(int(free_gib * GIB), 0.4))


def test_budget_picks_the_largest_micro_batch_that_fits():
    big, small = _choose(200.0), _choose(20.0)
    assert big.plan.micro_batch_size == 32 and big.plan.grad_accum_steps == 1
    assert small.plan.micro_batch_size < 32 and small.plan.grad_accum_steps * small.plan.micro_batch_size == 32
    # The state and the micro-batch's activations fit the usable share of the free memory...
    assert state_bytes(SMOL) < small.estimated_bytes <= 0.4 * 20 * GIB
    # ...and the next larger candidate's would not have.
    larger = min(d for d in (1, 2, 4, 8, 16, 32) if d > small.plan.micro_batch_size)
    assert _choose(20.0, micro_batch_size=larger).estimated_bytes > 0.4 * 20 * GIB
    # Packed updates: at least 4 micro-batches where memory would allow fewer.
    assert _choose(200.0, min_micro_batches=4).plan.micro_batch_size == 8
    # Whole groups of 8 on each of 4 shards: 32, the only such candidate, whatever the other preferences.
    assert _choose(200.0, min_micro_batches=4, whole_groups=True, shards=4).plan.micro_batch_size == 32
    assert _choose(200.0, min_micro_batches=4, shards=4).plan.micro_batch_size == 8
    # An explicit token budget: 2 rows of 192 fit 400 slots, 4 do not.
    assert _choose(200.0, micro_batch_tokens=400).plan.micro_batch_size == 2
    # The chunk of logits is capped on each batch shard: 32 rows of 192 columns hold 1,024 slots of logits on one
    # shard (32 columns), 4,096 over 4 (128 columns).
    one, four = (_choose(200.0, micro_batch_size=32, shards=k).estimated_bytes for k in (1, 4))
    assert four - one == 3 * SMOL.vocab_size * 4 * (4096 - 1024)


def test_budget_refuses_what_cannot_fit_naming_the_key():
    with pytest.raises(ValueError, match="train.micro_batch_size=32"):
        _choose(8.0, micro_batch_size=32)
    with pytest.raises(ValueError, match="train.micro_batch_tokens=100 is smaller"):
        _choose(200.0, micro_batch_tokens=100)
    with pytest.raises(ValueError, match="data.max_seq_len.*or set model.remat='full'"):
        _choose(1.0)
    args = dict(micro_batch_size=0, micro_batch_tokens=0, seq_len=192, group_size=8, shards=1)
    # Where the model already recomputes every layer ("auto" on a CPU in bfloat16), remat is not suggested; "auto" in
    # float32 keeps the projections' outputs ("dots"), and "full" is suggested there.
    for model, suggested in (
        (dataclasses.replace(SMOL, remat="full"), False),
        (dataclasses.replace(SMOL, remat="auto", compute_dtype="bfloat16"), False),
        (dataclasses.replace(SMOL, remat="auto"), True),
    ):
        with pytest.raises(ValueError, match="data.max_seq_len") as refused:
            rl_micro_batch(PLAN, model, **args, shared_width=64 + 8 * 128, free=(int(0.1 * GIB), 0.4))
        assert ("or set model.remat='full'" in str(refused.value)) == suggested, (model.remat, model.compute_dtype)


@functools.cache
def _temp_growth(remat: str, width: int) -> tuple[float, float]:
    """(measured, estimated) bytes per added token of a GRPO train step's temporaries on a 4-layer model, from 2 to 6
    rows of `width` columns: XLA's `memory_analysis()` of the compiled step against `activation_bytes_per_token`
    plus `logits_bytes`. Cached: the tests below share their compiles."""
    config = dataclasses.replace(TINY, num_layers=4, intermediate_size=256, vocab_size=512, remat=remat)
    mesh = make_mesh(1, 1, 1, devices=jax.devices()[:1])
    optimizer, _ = make_optimizer(1e-3, warmup_steps=0, total_steps=10, schedule="constant")
    step = make_algorithm_train_step(
        ALGORITHMS["grpo"], optimizer, mesh, RULES["dp"], config=config, hyperparameters={"kl_coef": 0.0}
    )
    temp = []
    for rows in (2, 6):
        shape = jax.ShapeDtypeStruct((rows, width), jnp.int32)
        fshape = jax.ShapeDtypeStruct((rows, width), jnp.float32)
        batch = TrainBatch(shape, shape, shape, fshape, fshape, fshape)
        compiled = step._jitted.lower(step.abstract_state, {}, batch).compile()
        temp.append(compiled.memory_analysis().temp_size_in_bytes)
    measured = (temp[1] - temp[0]) / (4 * width)

    def activations(rows):
        return rows * width * activation_bytes_per_token(config, width) + logits_bytes(config, rows, width)

    return measured, (activations(6) - activations(2)) / (4 * width)


@pytest.mark.parametrize("remat, width", [("none", 128), ("full", 128), ("full", 256), ("dots", 128)])
def test_activation_estimate_follows_xla(remat, width):
    """The estimate against XLA's own `memory_analysis()` of the train step: the growth of its temporary buffers
    from 2 to 6 rows (the layers' activations and the chunk of logits), per added token, within a factor of 2 (the
    constants were fitted on SmolLM2-135M; this checks that they carry to another shape, not a tuned value). At 256
    columns the 6 rows pass the chunk's cap of token slots: their chunk holds 170 columns, not all 255. "dots" is
    what "auto" picks on a CPU in float32."""
    measured, estimate = _temp_growth(remat, width)
    assert 0.5 <= estimate / measured <= 2.0, (estimate, measured)


def test_the_dots_estimate_lies_between_full_and_none_as_xla_does():
    """A factor of 2 alone would let "dots" be estimated with "full"'s or "none"'s constants on this shape; XLA keeps
    more per token under "dots" than under "full" and less than under "none", and so must the estimate."""
    growth = {remat: _temp_growth(remat, 128) for remat in ("full", "dots", "none")}
    measured = [growth[r][0] for r in ("full", "dots", "none")]
    estimated = [growth[r][1] for r in ("full", "dots", "none")]
    assert measured[0] < measured[1] < measured[2], growth
    assert estimated[0] < estimated[1] < estimated[2], growth


def test_each_batch_shard_holds_a_chunk_of_chunk_tokens_logit_slots(monkeypatch):
    """Rows split over 4 batch shards (data 2 x fsdp 2; tensor 2 splits no rows): the train step's and the no-grad
    pass's logit chunks are sized by what each shard holds (`CHUNK_TOKENS` slots on each), not by all shards
    together, which would make every shard's chunk 4x narrower, nor by all 8 devices. With a cap of 4 slots a shard,
    8 rows of 11 scored columns: 2 columns of all 8 rows (16 slots, 4 on each shard), where a cap of 4 in all would
    give 1 column (the least a chunk holds) and one of 4 x 8 devices 4 columns. The RL trainer builds its step's
    `predict` with the same `mesh_chunk_tokens`."""
    import test_models

    from feynrl_jax.train import step as step_module
    from feynrl_jax.train.frozen_logprobs import make_logprob_fn

    monkeypatch.setattr(step_module, "CHUNK_TOKENS", 4)
    config = dataclasses.replace(TINY, num_layers=1)
    mesh = make_mesh(2, 2, 2)
    rows, width = 8, 12
    shape = jax.ShapeDtypeStruct((rows, width), jnp.int32)
    fshape = jax.ShapeDtypeStruct((rows, width), jnp.float32)

    def widest(jaxpr) -> int:
        shapes = test_models._float_shapes(jaxpr.jaxpr)
        return max(int(np.prod(s[:-1])) for s in shapes if len(s) >= 3 and s[-1] == config.vocab_size)

    optimizer, _ = make_optimizer(1e-3, warmup_steps=0, total_steps=10, schedule="constant")
    step = make_algorithm_train_step(
        ALGORITHMS["grpo"], optimizer, mesh, RULES["fsdp_tp"], config=config, hyperparameters={"kl_coef": 0.0}
    )
    batch = TrainBatch(shape, shape, shape, fshape, fshape, fshape)
    assert widest(jax.make_jaxpr(step._jitted)(step.abstract_state, {}, batch)) == 2 * rows
    frozen = make_logprob_fn(config, mesh, RULES["fsdp_tp"], chunk_rows=rows)
    params = jax.eval_shape(functools.partial(init_params, config), jax.random.key(0))
    assert widest(jax.make_jaxpr(frozen)(params, shape, shape, shape)) == 2 * rows


# ---------------------------------------------------------------- the RL trainer


def _trainer_step(tmp_path, name: str, **train):
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "configs"))
    import tiny_rl

    from feynrl_jax.train.rl_trainer import RLTrainer

    config = tiny_rl.get_config("grpo")
    config.run_dir = str(tmp_path / name)
    config.train.mini_batches = 1
    config.train.shared_prefix = "off"
    config.rollout.n_samples = 2
    config.checkpoint.every_steps = 0
    for key, value in train.items():
        config.train[key] = value
    trainer = RLTrainer(config)
    trainer.start()
    rollouts = _rollouts(prompt_lengths=(30, 7, 19, 12, 3, 40, 22, 9), group=2, max_new=16, seed=5, vocab=61)
    rewards = np.random.default_rng(0).integers(0, 2, 16).astype(np.float32)
    metrics = trainer.train(rollouts, rewards, step=1, shuffle_seed=0)
    params = trainer.host_params()
    trainer.close()
    return metrics, params


def test_rl_trainer_packs_by_the_config_and_trains_as_unpacked(tmp_path):
    """`train.pack_sequences` and `train.micro_batch_tokens` reach the update: 16 samples of at most 56 tokens in
    rows of 128 over 8 fake devices, micro-batches of 8 (a budget of 8 x 128 token slots): unpacked, both run;
    packed, the samples fill one. Losses, metrics and params are those of the unpacked update (the tolerances of
    `test_shared_prefix.test_rl_trainer_step_is_the_same_in_both_layouts`)."""
    plain, plain_params = _trainer_step(tmp_path, "plain", micro_batch_tokens=1024, pack_sequences=False)
    packed, packed_params = _trainer_step(tmp_path, "packed", micro_batch_tokens=1024, pack_sequences=True)
    assert plain["train/micro_batch_size"] == packed["train/micro_batch_size"] == 8
    assert plain["train/micro_batches_run"] == 2.0 and packed["train/micro_batches_run"] == 1.0
    rollouts = _rollouts(prompt_lengths=(30, 7, 19, 12, 3, 40, 22, 9), group=2, max_new=16, seed=5, vocab=61)
    tokens = rollouts.prompt_lengths.sum() + rollouts.completion_mask.sum()
    assert packed["train/pack_fill"] == pytest.approx(tokens / (8 * 128)) and "train/pack_fill" not in plain
    for key in ("train/loss", "train/grad_norm", "train/entropy", "rollout/logprob_mismatch_kl"):
        np.testing.assert_allclose(packed[key], plain[key], rtol=1e-4, atol=1e-6, err_msg=key)
    assert plain["train/grad_norm"] > 0
    diff = np.concatenate(
        [np.abs(a - b).ravel() for a, b in zip(jax.tree.leaves(plain_params), jax.tree.leaves(packed_params))]
    )
    assert np.mean(diff > 1e-6) < 1e-4 and diff.max() <= 2.5e-4, (np.mean(diff > 1e-6), diff.max())
