"""The sharded train step on 8 fake CPU devices: parity with one device, exact accumulation, no retrace,
sharded memory, non-finite skipping, typed metrics, its parts, and the no-gradient log-probabilities.

One module-level cache runs each (algorithm, mesh, grad_accum) configuration once; the tests read from it, so
the suite compiles each step program a single time.
"""

from __future__ import annotations

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from feynrl_jax.losses import ALGORITHMS, TrainBatch, compute_metrics
from feynrl_jax.losses.metrics import combine_updates
from feynrl_jax.models import ModelConfig, init_params, logical_axes, sequence_logprobs
from feynrl_jax.sharding import RULES, make_mesh, param_shardings, place_tree, tree_bytes_per_device
from feynrl_jax.train.frozen_logprobs import make_logprob_fn
from feynrl_jax.train.loss_parts import old_logprobs_from_current, with_logprob_diagnostics
from feynrl_jax.train.nonfinite import NonFiniteError, NonFiniteGuard
from feynrl_jax.train.optimizer import make_optimizer
from feynrl_jax.train.step import ParamsSpec, make_algorithm_train_step, make_train_step, model_logprob_fn

CONFIG = ModelConfig(
    vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16
)
B, T, STEPS = 16, 16, 3
MESHES = {"single": ((1, 1, 1), "dp"), "fsdp8": ((1, 8, 1), "fsdp"), "fsdp4_tp2": ((1, 4, 2), "fsdp_tp")}
HYPERPARAMETERS = {"grpo": {"kl_coef": 0.05}, "dpo": {"beta": 0.1}}
# These programs are tiny: compile time dominates, so LLVM's optimisations are switched off (4x faster).
FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


def make_batch(algorithm: str, seed: int, rows: int = B) -> TrainBatch:
    """A random batch: prompt of 6 tokens, completion after it, some rows right-padded."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, CONFIG.vocab_size, (rows, T)).astype(np.int32)
    lengths = rng.integers(9, T + 1, rows)
    if algorithm == "dpo":
        lengths[1::2] = np.maximum(lengths[1::2] - 2, 8)
    real = np.arange(T)[None, :] < lengths[:, None]
    segment_ids = real.astype(np.int32)
    positions = np.where(real, np.arange(T)[None, :], 0).astype(np.int32)
    loss_mask = (real & (np.arange(T)[None, :] >= 6)).astype(np.float32)
    advantages = np.repeat(rng.standard_normal((rows, 1)), T, axis=1).astype(np.float32) * loss_mask
    # Old and reference log-probabilities near the random model's (about -log V), so ratios clip sometimes.
    base = -np.log(CONFIG.vocab_size)
    old = (base + 0.15 * rng.standard_normal((rows, T))).astype(np.float32) * loss_mask
    ref = (base + 0.15 * rng.standard_normal((rows, T))).astype(np.float32) * loss_mask
    return TrainBatch(tokens, positions, segment_ids, loss_mask, advantages, old, ref_logprobs=ref)


@functools.cache
def initial_params():
    return jax.tree.map(np.asarray, init_params(CONFIG, jax.random.key(0)))


def build_step(algorithm: str, mesh_name: str, grad_accum: int = 1, check_updated: bool = True):
    sizes, rules = MESHES[mesh_name]
    mesh = make_mesh(*sizes, devices=jax.devices()[:1] if mesh_name == "single" else None)
    optimizer, schedule = make_optimizer(1e-4, warmup_steps=1, total_steps=10, weight_decay=0.01)
    return make_algorithm_train_step(
        ALGORITHMS[algorithm],
        optimizer,
        mesh,
        RULES[rules],
        config=CONFIG,
        hyperparameters=HYPERPARAMETERS[algorithm],
        grad_accum=grad_accum,
        logprob_chunk_size=8,
        learning_rate_fn=schedule,
        compiler_options=FAST_COMPILE,
        check_updated=check_updated,
    )


@dataclasses.dataclass
class Run:
    step: object
    params: list  # host params after each step
    metrics: list  # {name: float} of each step
    typed: list  # {name: Metric} of each step, on the host
    state: object  # the final (device) state


@functools.cache
def run(algorithm: str, mesh_name: str, grad_accum: int = 1) -> Run:
    train_step = build_step(algorithm, mesh_name, grad_accum)
    state = train_step.init_state(initial_params())
    params, metrics, typed = [], [], []
    for i in range(STEPS):
        state, m = train_step(state, train_step.place_batch(make_batch(algorithm, seed=i)))
        params.append(jax.tree.map(np.asarray, state.params))
        metrics.append({k: float(v) for k, v in compute_metrics(m).items()})
        typed.append(jax.device_get(m))
    return Run(train_step, params, metrics, typed, state)


def max_relative_difference(a, b) -> float:
    """The largest per-tensor ``||a - b|| / ||b||`` over the params."""
    diffs = jax.tree.map(lambda x, y: np.linalg.norm(x - y) / max(np.linalg.norm(y), 1e-30), a, b)
    return max(jax.tree.leaves(diffs))


@pytest.mark.parametrize("mesh_name", ["fsdp8", "fsdp4_tp2"])
@pytest.mark.parametrize("algorithm", ["grpo", "dpo"])
def test_sharded_step_matches_single_device(algorithm, mesh_name):
    sharded, single = run(algorithm, mesh_name), run(algorithm, "single")
    # The run trained: params moved, and the loss is a real number.
    assert max_relative_difference(single.params[-1], initial_params()) > 1e-4
    assert all(np.isfinite(m["train/loss"]) and m["train/update_skipped"] == 0 for m in single.metrics)
    assert max_relative_difference(sharded.params[-1], single.params[-1]) < 1e-5
    for got, want in zip(sharded.metrics, single.metrics, strict=True):
        assert got.keys() == want.keys()
        np.testing.assert_allclose([got[k] for k in want], list(want.values()), rtol=1e-4, atol=1e-6)
    # Parameters really live sharded (fsdp splits the model dimension of every matrix).
    q = sharded.state.params["layers"]["q_proj"]["kernel"]
    assert q.sharding.spec[1] == "fsdp" and len(q.sharding.device_set) == 8


@pytest.mark.parametrize("algorithm, mesh_name", [("grpo", "fsdp4_tp2"), ("dpo", "single")])
def test_gradient_accumulation_equals_one_large_batch(algorithm, mesh_name):
    accumulated, whole = run(algorithm, mesh_name, grad_accum=4), run(algorithm, mesh_name)
    assert accumulated.step.grad_accum == 4
    assert max_relative_difference(accumulated.params[0], whole.params[0]) < 1e-6
    # Loss metrics combine exactly across micro-batches.
    got, want = accumulated.metrics[0], whole.metrics[0]
    np.testing.assert_allclose([got[k] for k in want], list(want.values()), rtol=1e-5, atol=1e-7)


def test_second_call_with_the_same_shapes_does_not_compile_again():
    result = run("grpo", "fsdp8")
    assert result.step.trace_count == 1
    assert result.step._jitted._cache_size() == 1


def test_fsdp8_holds_one_eighth_of_params_and_optimizer_state_per_device():
    sharded, single = run("grpo", "fsdp8").state, run("grpo", "single").state
    unsharded = sum(x.nbytes for x in jax.tree.leaves((single.params, single.opt_state)))
    per_device = tree_bytes_per_device((sharded.params, sharded.opt_state))
    assert len(per_device) == 8
    # Only the norm scales and scalar counters are replicated.
    assert unsharded / 8 <= max(per_device.values()) <= 1.05 * unsharded / 8
    assert tree_bytes_per_device((single.params, single.opt_state)) == {jax.devices()[0]: unsharded}


def test_nonfinite_gradient_skips_the_update_and_the_guard_stops_the_run():
    train_step = run("grpo", "single").step
    state = train_step.init_state(initial_params())
    guard = NonFiniteGuard(max_consecutive=1)
    bad = make_batch("grpo", seed=0)
    bad = dataclasses.replace(bad, advantages=np.where(bad.loss_mask > 0, np.nan, 0.0).astype(np.float32))
    state, metrics = train_step(state, train_step.place_batch(bad))
    assert float(metrics["train/update_skipped"].value) == 1.0 and int(metrics["train/nonfinite_streak"].value) == 1
    assert int(state.step) == 0
    assert max_relative_difference(jax.tree.map(np.asarray, state.params), initial_params()) == 0.0
    guard.check(metrics, step=1)  # one skip is tolerated
    state, metrics = train_step(state, train_step.place_batch(bad))
    with pytest.raises(
        NonFiniteError, match=r"non-finite gradient, loss or updated weights for 2 consecutive steps at step 2"
    ):
        guard.check(metrics, step=2)
    # A finite batch applies the update and resets the streak, keeping the total.
    state, metrics = train_step(state, train_step.place_batch(make_batch("grpo", seed=0)))
    assert int(metrics["train/nonfinite_streak"].value) == 0 and int(metrics["train/nonfinite_total"].value) == 2
    assert int(state.step) == 1
    guard.check(metrics)
    # ... and gives exactly the first update of the run that never saw the bad batches.
    assert max_relative_difference(jax.tree.map(np.asarray, state.params), run("grpo", "single").params[0]) == 0.0


@pytest.mark.parametrize("mesh_name, grad_accum", [("single", 1), ("fsdp4_tp2", 4)])
def test_an_update_chosen_before_it_is_computed_is_the_same_update_written_in_place(mesh_name, grad_accum):
    # make_optimizer's AdamW turns finite inputs into finite weights, so the runs' steps (check_updated=False) test
    # the gradient norm and the loss alone, before the update, and XLA writes the update into the donated state.
    checked = run("grpo", mesh_name, grad_accum)
    step = build_step("grpo", mesh_name, grad_accum, check_updated=False)
    assert checked.step.check_updated and not step.check_updated
    state = step.init_state(initial_params())
    # The same update up to float32 rounding: the branch of the `lax.cond` is a program of its own, whose fusions may
    # round a product and a sum once or twice (measured 2.5e-9, a few elements one ulp apart; 1 ulp is 6e-8).
    for i in range(STEPS):
        state, metrics = step(state, step.place_batch(make_batch("grpo", seed=i)))
        assert max_relative_difference(jax.tree.map(np.asarray, state.params), checked.params[i]) < 1e-6
        got = {k: float(v) for k, v in compute_metrics(metrics).items()}
        assert got.keys() == checked.metrics[i].keys() and got["train/update_skipped"] == 0.0
        assert got["train/nonfinite_state"] == 0.0
        np.testing.assert_allclose(list(got.values()), list(checked.metrics[i].values()), rtol=1e-5, atol=1e-7)
    # A non-finite gradient is still skipped.
    bad = make_batch("grpo", seed=0)
    bad = dataclasses.replace(bad, advantages=np.where(bad.loss_mask > 0, np.nan, 0.0).astype(np.float32))
    before = jax.tree.map(np.asarray, (state.params, state.opt_state))
    state, metrics = step(state, step.place_batch(bad))
    assert float(metrics["train/update_skipped"].value) == 1.0 and int(state.nonfinite_streak) == 1
    assert int(state.step) == STEPS and float(metrics["train/nonfinite_state"].value) == 0.0
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, (state.params, state.opt_state)), before)


def test_an_unchecked_update_that_writes_nan_weights_stops_the_run_before_it_is_saved():
    # An optimizer that breaks the promise check_updated=False relies on (a NaN step size: make_optimizer refuses
    # one, a user's optax optimizer need not): the update is written, the step reads it back, the guard stops.
    sizes, rules = MESHES["single"]
    step = make_train_step(
        ALGORITHMS["grpo"].make_loss(**HYPERPARAMETERS["grpo"]),
        optax.adamw(lambda count: jnp.full((), jnp.nan)),
        make_mesh(*sizes, devices=jax.devices()[:1]),
        RULES[rules],
        predict=model_logprob_fn(CONFIG, chunk_size=8),
        params_spec=ParamsSpec.of_model(CONFIG),
        compiler_options=FAST_COMPILE,
        check_updated=False,
    )
    state, metrics = step(step.init_state(initial_params()), step.place_batch(make_batch("grpo", seed=0)))
    values = compute_metrics(metrics)
    assert values["train/update_skipped"] == 0.0 and values["train/nonfinite_state"] == 1.0
    assert not np.isfinite(np.asarray(state.params["embed"]["embedding"])).any()
    with pytest.raises(NonFiniteError, match="the update at step 1 wrote NaN or infinite weights or optimizer state"):
        NonFiniteGuard(max_consecutive=3).check(metrics, step=1)


def test_an_update_chosen_before_it_is_computed_needs_less_temporary_memory():
    # Matrices of 256 x 512 and two rows of 16 tokens: the update's temporaries, not the activations, set the peak.
    # (On the 64-wide test model XLA fuses the small leaves' updates either way and both programs hold the same.)
    config = dataclasses.replace(CONFIG, hidden_size=256, intermediate_size=512, vocab_size=1024, head_dim=64)
    params = init_params(config, jax.random.key(0))
    batch = make_batch("grpo", seed=0, rows=2)
    batch = dataclasses.replace(batch, tokens=batch.tokens * 8)  # ids across the larger vocabulary
    temporaries = {}
    for check_updated in (True, False):
        optimizer, _ = make_optimizer(1e-4, warmup_steps=1, total_steps=10, weight_decay=0.01)
        step = make_algorithm_train_step(
            ALGORITHMS["grpo"],
            optimizer,
            make_mesh(1, 1, 1, devices=jax.devices()[:1]),
            RULES["dp"],
            config=config,
            logprob_chunk_size=8,
            compiler_options=FAST_COMPILE,
            check_updated=check_updated,
        )
        compiled = step.compile(step.abstract_state, step.place_batch(batch))
        temporaries[check_updated] = compiled.memory_analysis().temp_size_in_bytes
    # The checked step keeps the new params and both Adam moments (3x the params' bytes) beside the old ones until
    # it chooses; in place they go to the donated state's buffers. Measured: 3.04x against 1.45x the params' bytes
    # of temporaries here (the suite's program-order scheduler), 3.5x against 2.0x with XLA's default one (a run's);
    # SmolLM2-135M's RL step 1.75 against 1.25 GiB (benchmarks/bench_update_guard.py; 1.00 with the gradient sink).
    param_bytes = sum(x.nbytes for x in jax.tree.leaves(params))
    assert temporaries[True] - temporaries[False] >= param_bytes, (temporaries, param_bytes)


def test_nan_learning_rate_skips_the_update_and_a_run_of_only_skips_fails():
    # A finite gradient with a NaN step size (optim.lr=nan) gives NaN weights: the step must not apply them.
    sizes, rules = MESHES["fsdp8"]
    step = make_train_step(
        ALGORITHMS["grpo"].make_loss(**HYPERPARAMETERS["grpo"]),
        optax.adamw(lambda count: jnp.full((), jnp.nan)),
        make_mesh(*sizes),
        RULES[rules],
        predict=model_logprob_fn(CONFIG, chunk_size=8),
        params_spec=ParamsSpec.of_model(CONFIG),
        compiler_options=FAST_COMPILE,
    )
    state = step.init_state(initial_params())
    opt_before = jax.tree.map(np.asarray, state.opt_state)
    guard = NonFiniteGuard(max_consecutive=3)
    for i in range(2):
        state, metrics = step(state, step.place_batch(make_batch("grpo", seed=i)))
        guard.check(metrics, step=i + 1)
        values = compute_metrics(metrics)
        assert np.isfinite(values["train/grad_norm"]) and np.isfinite(values["train/loss"])
        assert values["train/update_skipped"] == 1.0 and values["train/nonfinite_total"] == i + 1
    assert int(state.step) == 0 and int(state.nonfinite_streak) == 2
    assert max_relative_difference(jax.tree.map(np.asarray, state.params), initial_params()) == 0.0
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, state.opt_state), opt_before)
    # Under the streak limit, yet the run trained nothing: the end-of-run check fails it.
    with pytest.raises(NonFiniteError, match="every update of the run was skipped"):
        guard.finish()


def test_batch_size_that_does_not_split_is_rejected_before_running():
    train_step = build_step("dpo", "single", grad_accum=4)
    batch = make_batch("dpo", seed=0, rows=12)
    with pytest.raises(ValueError, match=r"batch of 12 rows cannot be split into 4 micro-batch\(es\) of whole 2-row"):
        train_step(None, batch)


def test_algorithm_step_rejects_critics_and_unknown_hyperparameters():
    mesh = make_mesh(1, 8, 1)
    optimizer, _ = make_optimizer(1e-4, schedule="constant")
    with pytest.raises(ValueError, match="'ppo' needs a critic"):
        make_algorithm_train_step(ALGORITHMS["ppo"], optimizer, mesh, RULES["fsdp"], config=CONFIG)
    with pytest.raises(ValueError, match=r"no hyperparameter\(s\) \['clip'\]"):
        make_algorithm_train_step(
            ALGORITHMS["grpo"], optimizer, mesh, RULES["fsdp"], config=CONFIG, hyperparameters={"clip": 0.1}
        )


def test_reference_logprobs_in_chunks_match_the_model():
    params = initial_params()
    batch = make_batch("grpo", seed=3)
    want, want_entropy = sequence_logprobs(
        params, batch.tokens, batch.positions, config=CONFIG, segment_ids=batch.segment_ids, with_entropy=True
    )
    mesh = make_mesh(1, 4, 2)
    fn = make_logprob_fn(CONFIG, mesh, RULES["fsdp_tp"], chunk_rows=4, with_entropy=True, compiler_options=FAST_COMPILE)
    placed = place_tree(params, param_shardings(logical_axes(CONFIG), mesh, RULES["fsdp_tp"], shapes=params))
    got, entropy = fn(placed, batch.tokens, batch.positions, batch.segment_ids)
    assert got.shape == (B, T) and {s.data.shape for s in got.addressable_shards} == {(B // 4, T)}
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5)
    np.testing.assert_allclose(np.asarray(entropy), np.asarray(want_entropy), atol=2e-5)
    assert np.all(np.asarray(got)[:, 0] == 0) and np.all(np.asarray(got)[batch.segment_ids == 0] == 0)
    with pytest.raises(ValueError, match="not a multiple of chunk_rows=4"):
        fn(placed, batch.tokens[:6], batch.positions[:6], batch.segment_ids[:6])


def test_remat_policy_reaches_the_model():
    batch = make_batch("grpo", seed=0)
    params = initial_params()

    def remat_policies(remat):
        fn = model_logprob_fn(CONFIG, chunk_size=8, remat=remat)
        text = str(jax.make_jaxpr(jax.grad(lambda p: fn(p, batch)[0].sum()))(params))
        # The model's own output-projection chunks are rematerialised with policy=None in every case.
        return set(re.findall(r"policy=(\S+)", text)) - {"None"}

    assert remat_policies("none") == set()
    assert remat_policies("dots") == {"DotsSaveable(only_if_no_batch_dims=True)"}
    assert remat_policies("full")  # nothing_saveable
    # "auto" on a CPU: "dots" in float32, "full" in bfloat16 (`ModelConfig.resolved_remat`).
    assert remat_policies("auto") == remat_policies("dots")
    bf16 = dataclasses.replace(CONFIG, compute_dtype="bfloat16", remat="auto")
    assert bf16.resolved_remat() == "full" and dataclasses.replace(CONFIG, remat="auto").resolved_remat() == "dots"
    # LoRA keeps "full": "dots" would keep a projection's base and adapter outputs, which the memory budget does not
    # count.
    lora = dataclasses.replace(CONFIG, remat="auto", lora_rank=4, lora_targets=("q_proj",))
    assert lora.resolved_remat() == "full"


def test_params_spec_of_a_model_and_a_step_needs_its_parts():
    spec = ParamsSpec.of_model(CONFIG)
    assert spec.logical_axes == logical_axes(CONFIG)
    want = jax.tree.map(lambda x: (x.shape, x.dtype), initial_params())
    assert jax.tree.map(lambda x: (x.shape, x.dtype), spec.shape) == want
    mesh = make_mesh(1, 8, 1)
    optimizer, _ = make_optimizer(1e-4, schedule="constant")
    loss = ALGORITHMS["sft"].make_loss()
    with pytest.raises(TypeError, match="predict"):
        make_train_step(loss, optimizer, mesh, RULES["fsdp"], params_spec=spec)
    with pytest.raises(TypeError, match="params_spec"):
        make_train_step(loss, optimizer, mesh, RULES["fsdp"], predict=model_logprob_fn(CONFIG))


def test_step_metrics_are_typed_and_combine_by_type():
    result = run("grpo", "single")
    typed = result.typed[0]
    reduces = {name: m.reduce for name, m in typed.items()}
    for name in ("train/step", "train/nonfinite_streak", "train/nonfinite_total", "train/learning_rate"):
        assert reduces[name] == "last", name
    assert reduces["loss/ratio_max"] == "max" and reduces["loss/ratio_min"] == "min"
    # Every mean is reported as its update's value with weight 1: a step's updates count equally.
    means = [name for name, r in reduces.items() if r == "mean"]
    assert {"train/loss", "train/grad_norm", "loss/policy", "loss/ratio_mean"} <= set(means)
    assert all(float(typed[name].weight) == 1.0 for name in means)
    # The three steps read as one RL step's three updates.
    got = combine_updates(result.typed)
    values = {name: [m[name] for m in result.metrics] for name in typed}
    assert got["train/step"] == 3.0 == values["train/step"][-1]
    assert got["train/learning_rate"] == values["train/learning_rate"][-1]
    assert got["loss/ratio_max"] == max(values["loss/ratio_max"])
    assert got["loss/ratio_min"] == min(values["loss/ratio_min"])
    for name in means:
        assert got[name] == float(np.mean(values[name])), name


def _batch_with_behavior(seed: int = 0):
    batch = make_batch("grpo", seed=seed)
    rng = np.random.default_rng(seed + 100)
    behavior = (batch.old_logprobs + 0.1 * rng.standard_normal(batch.old_logprobs.shape)) * batch.loss_mask
    return dataclasses.replace(batch, behavior_logprobs=behavior.astype(np.float32))


def test_step_built_from_parts_equals_precomputed_old_logprobs():
    """`old_logprobs_from_current` in the step equals the step on a batch whose `old_logprobs` are the current
    policy's; diagnostics add their metrics and leave the update alone; entropy reaches the loss only from
    predict (and through the diagnostics only with `pass_entropy`)."""
    mesh = make_mesh(1, 1, 1, devices=jax.devices()[:1])
    optimizer, _ = make_optimizer(1e-4, schedule="constant")
    loss = ALGORITHMS["grpo"].make_loss(kl_coef=0.05)
    spec = ParamsSpec.of_model(CONFIG)

    def build(loss_fn, with_entropy):
        predict = model_logprob_fn(CONFIG, chunk_size=8, with_entropy=with_entropy)
        return make_train_step(
            loss_fn, optimizer, mesh, RULES["dp"], predict=predict, params_spec=spec, compiler_options=FAST_COMPILE
        )

    batch = _batch_with_behavior()
    current, _ = model_logprob_fn(CONFIG, chunk_size=8)(initial_params(), batch)
    precomputed = dataclasses.replace(batch, old_logprobs=np.asarray(current) * batch.loss_mask)
    outputs = {}
    for name, loss_fn, with_entropy, b in (
        ("precomputed", loss, False, precomputed),
        ("from_current", old_logprobs_from_current(loss), False, batch),
        ("diagnostics", with_logprob_diagnostics(old_logprobs_from_current(loss), pass_entropy=False), True, batch),
        ("with_entropy", with_logprob_diagnostics(old_logprobs_from_current(loss)), True, batch),
    ):
        step = build(loss_fn, with_entropy)
        state, metrics = step(step.init_state(initial_params()), step.place_batch(b))
        outputs[name] = (jax.tree.map(np.asarray, state.params), combine_updates([jax.device_get(metrics)]))
    want_params, want = outputs["precomputed"]
    for name in ("from_current", "diagnostics", "with_entropy"):
        params, got = outputs[name]
        assert max_relative_difference(params, want_params) < 1e-6, name
        for key, value in want.items():
            np.testing.assert_allclose(got[key], value, rtol=1e-5, atol=1e-6, err_msg=f"{name}: {key}")
    assert want["loss/ratio_mean"] == pytest.approx(1.0, abs=1e-6)
    assert "train/entropy" not in outputs["from_current"][1]
    assert "loss/entropy" not in outputs["diagnostics"][1]
    diagnostics, with_entropy = outputs["diagnostics"][1], outputs["with_entropy"][1]
    for key in ("rollout/logprob_mismatch_kl", "rollout/behavior_ess", "train/entropy", "train/kl_ref"):
        assert key in diagnostics, key
    assert with_entropy["loss/entropy"] == pytest.approx(with_entropy["train/entropy"], rel=1e-6)
