"""The layers' gradient added into an accumulator in place (`models.forward`'s `grad_sink`) and the train step that
uses it to accumulate micro-batches.

With a sink, `jax.grad` of a loss over the model gives `sink + the pass's gradient` for the stacked layers and the
pass's gradient for every other param. The sink's backward pass runs the same float32 operations per layer as the
scan's own transpose (recompute the layer, its vector-Jacobian product, one addition), so the result is the float64
sum `sink + gradient` up to its own float32 rounding (2 ulps of the sum) and to the two programs fusing the
backward pass differently (1e-6 of the largest gradient). Measured: exactly the float32 sum. In bfloat16 compute,
each layer's bfloat16 gradient is widened and added where the ordinary pass widens the whole stack first: the same
values (measured: exactly), up to XLA fusing the bfloat16 backward pass differently on another CPU (1e-2 of the
largest gradient, under 3 x 2^-8, bfloat16's relative spacing).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from feynrl_jax.losses import ALGORITHMS, TrainBatch
from feynrl_jax.models import ModelConfig, SegmentBounds, init_params, sequence_logprobs, sinks_layer_grads
from feynrl_jax.sharding import RULES, make_mesh
from feynrl_jax.testing.batches import shared_prefix_batch
from feynrl_jax.train.critic import (
    critic_params_spec,
    critic_values,
    init_critic_params,
    make_critic_train_step,
    value_loss,
)
from feynrl_jax.train.optimizer import make_optimizer
from feynrl_jax.train.step import ParamsSpec, make_train_step, model_logprob_fn

CONFIG = ModelConfig(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_layers=3,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    remat="full",
)
PROMPT, GROUP, WIDTH = 8, 4, 8
FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


def grpo_batch(config: ModelConfig, groups: int, seed: int = 0) -> TrainBatch:
    """`groups` rows in the trainer's shared-prefix layout, completions of random lengths, random advantages."""
    return shared_prefix_batch(
        config.vocab_size, groups, prompt=PROMPT, group=GROUP, width=WIDTH, seed=seed, min_length=2
    )


CASES = {
    "float32": (CONFIG, None, 1e-6),
    # Sliding windows on some layers (the window rides in the scan) and attention in blocks (the batch's block
    # structure is closed over by the layer, and becomes an argument of the sink's rule).
    "windows, blocks": (
        dataclasses.replace(
            CONFIG, sliding_window=6, layer_types=("sliding_attention", "full_attention", "sliding_attention")
        ),
        SegmentBounds(segment=WIDTH, prefix=PROMPT),
        1e-6,
    ),
    # bfloat16 weights and compute from float32 masters: each layer is rounded and cast inside the sink's rule.
    "bfloat16 from float32 masters": (
        dataclasses.replace(CONFIG, param_dtype="bfloat16", compute_dtype="bfloat16"),
        None,
        1e-2,
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_the_sink_receives_the_layers_gradient_and_the_rest_is_unchanged(case):
    config, bounds, rtol = CASES[case]
    params = init_params(dataclasses.replace(config, param_dtype="float32", compute_dtype="float32"), jax.random.key(1))
    batch = grpo_batch(config, groups=2)
    rng = np.random.default_rng(2)
    sink = jax.tree.map(lambda a: jnp.asarray(rng.standard_normal(a.shape), a.dtype), params["layers"])

    def loss(params, sink):
        logprobs, _ = sequence_logprobs(
            params,
            batch.tokens,
            batch.positions,
            config=config,
            segment_ids=batch.segment_ids,
            first_column=PROMPT,
            segment_bounds=bounds,
            grad_sink=sink,
        )
        return jnp.sum(logprobs * batch.advantages)

    plain = jax.jit(jax.grad(loss))(params, None)
    sunk = jax.jit(jax.grad(loss))(params, sink)
    assert float(loss(params, sink)) == float(loss(params, None))
    scale = max(float(jnp.max(jnp.abs(g))) for g in jax.tree.leaves(plain["layers"]))
    assert scale > 1e-3  # the pass has a gradient worth comparing
    for got, want, into in zip(*(jax.tree.leaves(t) for t in (sunk["layers"], plain["layers"], sink)), strict=True):
        assert got.dtype == jnp.float32
        expected = np.asarray(into, np.float64) + np.asarray(want, np.float64)
        ulps = 2 * np.finfo(np.float32).eps * np.max(np.abs(expected))
        np.testing.assert_allclose(np.asarray(got, np.float64), expected, rtol=0, atol=ulps + rtol * scale)
    others = lambda g: {k: v for k, v in g.items() if k != "layers"}  # noqa: E731
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=rtol, atol=1e-7),
        others(sunk),
        others(plain),
    )


def test_forward_refuses_a_sink_it_cannot_fill():
    params = init_params(CONFIG, jax.random.key(0))
    tokens = jnp.ones((1, 4), jnp.int32)
    positions = jnp.arange(4, dtype=jnp.int32)[None]
    sink = jax.tree.map(jnp.zeros_like, params["layers"])
    call = lambda config, sink=sink: sequence_logprobs(  # noqa: E731
        params, tokens, positions, config=config, grad_sink=sink
    )
    with pytest.raises(ValueError, match="grad_sink needs remat 'full'"):
        call(dataclasses.replace(CONFIG, remat="none"))
    with pytest.raises(ValueError, match="must match params"):
        call(CONFIG, sink={**sink, "q_proj": {"kernel": jnp.zeros((1,))}})
    assert sinks_layer_grads(CONFIG) and not sinks_layer_grads(CONFIG, "dots")
    assert not sinks_layer_grads(dataclasses.replace(CONFIG, lora_rank=4, lora_targets=("q_proj",)))


def build_step(
    config: ModelConfig,
    grad_accum: int,
    *,
    sinking: bool = True,
    master: str | None = None,
    mesh: str = "single",
    optimizer=None,
):
    predict = model_logprob_fn(config, chunk_size=8, first_column=PROMPT)
    if not sinking:  # the same function without the mark: the step accumulates the returned stacks
        predict = lambda *a, predict=predict, **k: predict(*a, **k)  # noqa: E731
    if optimizer is None:
        optimizer, _ = make_optimizer(1e-3, schedule="constant", weight_decay=0.01)
    sizes, rules = {"single": ((1, 1, 1), "dp"), "fsdp4_tp2": ((1, 4, 2), "fsdp_tp")}[mesh]
    return make_train_step(
        ALGORITHMS["grpo"].make_loss(kl_coef=0.0),
        optimizer,
        make_mesh(*sizes, devices=jax.devices()[:1] if mesh == "single" else None),
        RULES[rules],
        predict=predict,
        params_spec=ParamsSpec.of_model(config).with_master_dtype(master),
        grad_accum=grad_accum,
        compiler_options=FAST_COMPILE,
        check_updated=False,
    )


def test_which_steps_sink_the_layers_gradient():
    assert build_step(CONFIG, 2).sinks_layer_grads
    assert not build_step(CONFIG, 1).sinks_layer_grads  # nothing to accumulate
    assert not build_step(CONFIG, 2, sinking=False).sinks_layer_grads
    assert not build_step(dataclasses.replace(CONFIG, remat="none"), 2).sinks_layer_grads
    # bfloat16 compute sinks into the float32 masters' accumulator; bfloat16 params alone train in bfloat16.
    bf16 = dataclasses.replace(CONFIG, param_dtype="bfloat16", compute_dtype="bfloat16")
    assert build_step(bf16, 2, master="float32").sinks_layer_grads
    assert not build_step(bf16, 2).sinks_layer_grads


def test_a_bfloat16_step_from_float32_masters_sinks_the_same_gradient():
    # 8 group rows in 4 micro-batches, bfloat16 compute, float32 masters and accumulator, and plain SGD at rate 1:
    # a step's change of the masters is minus the accumulated gradient. Each layer's bfloat16 gradient is widened
    # and added in the sink where the ordinary step widens the returned stack: the same values (measured: equal),
    # up to XLA fusing the two bfloat16 backward passes differently on another CPU (1e-2 of the largest gradient,
    # the module docstring).
    bf16 = dataclasses.replace(CONFIG, param_dtype="bfloat16", compute_dtype="bfloat16")
    params = jax.tree.map(np.asarray, init_params(CONFIG, jax.random.key(0)))
    steps = {
        sinking: build_step(bf16, 4, sinking=sinking, master="float32", optimizer=optax.sgd(1.0))
        for sinking in (True, False)
    }
    assert steps[True].sinks_layer_grads and not steps[False].sinks_layer_grads
    batch = grpo_batch(CONFIG, groups=8, seed=0)
    grads = {}
    for sinking, step in steps.items():
        state, _ = step(step.init_state(params), step.place_batch(batch))
        assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(state.params))
        grads[sinking] = jax.tree.map(
            lambda old, new: np.asarray(old, np.float64) - np.asarray(new), params, state.params
        )
    scale = max(float(np.max(np.abs(g))) for g in jax.tree.leaves(grads[False]["layers"]))
    assert scale > 1e-3  # the layers have a gradient worth comparing
    for got, want in zip(jax.tree.leaves(grads[True]), jax.tree.leaves(grads[False]), strict=True):
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-2 * scale)


def test_a_step_accumulating_into_the_sink_takes_the_same_steps():
    # 16 group rows in 4 micro-batches (rows are dealt: micro-batch m holds rows m, m + 4, ...) on fsdp4_tp2: the
    # accumulator is sharded like the params (one device runs the same program without the collectives). Micro-batch
    # 1 is padding alone in the second step: its branch of the step's `lax.cond` returns the accumulator as it is.
    mesh = "fsdp4_tp2"
    params = jax.tree.map(np.asarray, init_params(CONFIG, jax.random.key(0)))
    steps = {sinking: build_step(CONFIG, 4, sinking=sinking, mesh=mesh) for sinking in (True, False)}
    assert steps[True].sinks_layer_grads and not steps[False].sinks_layer_grads
    states = {sinking: step.init_state(params) for sinking, step in steps.items()}
    for seed in range(2):
        batch = grpo_batch(CONFIG, groups=16, seed=seed)
        if seed == 1:
            padding = np.zeros(16, bool)
            padding[1::4] = True
            batch = dataclasses.replace(
                batch,
                segment_ids=np.where(padding[:, None], 0, batch.segment_ids),
                loss_mask=np.where(padding[:, None], 0.0, batch.loss_mask).astype(np.float32),
                advantages=np.where(padding[:, None], 0.0, batch.advantages).astype(np.float32),
            )
        metrics = {}
        for sinking, step in steps.items():
            states[sinking], metrics[sinking] = step(states[sinking], step.place_batch(batch))
        norms = [float(metrics[s]["train/grad_norm"].value) for s in (True, False)]
        np.testing.assert_allclose(norms[0], norms[1], rtol=1e-6)
        assert float(metrics[True]["train/update_skipped"].value) == 0.0
    moved = max(
        float(jnp.max(jnp.abs(a - b))) for a, b in zip(jax.tree.leaves(states[True].params), jax.tree.leaves(params))
    )
    assert moved > 1e-4
    # The same float32 operations in both programs (measured: equal params); AdamW's step divides by the root of the
    # second moment, so an ulp of a gradient near 0 may move a weight by more: 1e-5 relative, 1e-6 absolute.
    for got, want in zip(jax.tree.leaves(states[True].params), jax.tree.leaves(states[False].params), strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)


def build_critic_step(config: ModelConfig, grad_accum: int, *, sinking: bool = True):
    optimizer, _ = make_optimizer(1e-3, schedule="constant", weight_decay=0.01)
    mesh = make_mesh(1, 1, 1, devices=jax.devices()[:1])
    if sinking:
        return make_critic_train_step(
            config, optimizer, mesh, RULES["dp"], value_clip=0.2, grad_accum=grad_accum, check_updated=False
        )

    # make_critic_train_step's step, with a prediction that carries no `layer_sink` mark.
    def values(params, batch):
        return critic_values(params, batch.tokens, batch.positions, batch.segment_ids, config=config), None

    return make_train_step(
        functools.partial(value_loss, value_clip=0.2),
        optimizer,
        mesh,
        RULES["dp"],
        predict=values,
        params_spec=critic_params_spec(config),
        grad_accum=grad_accum,
        check_updated=False,
    )


def critic_batch(config: ModelConfig, groups: int, seed: int) -> TrainBatch:
    """`grpo_batch` with GAE targets and rollout-time values (what the critic's loss reads)."""
    batch = grpo_batch(config, groups, seed)
    rng = np.random.default_rng(seed + 100)
    shape = batch.tokens.shape
    return dataclasses.replace(
        batch,
        returns=rng.standard_normal(shape).astype(np.float32),
        values=(0.1 * rng.standard_normal(shape)).astype(np.float32),
    )


def test_the_critic_accumulates_its_backbones_layers_into_the_sink():
    # PPO's critic: its backbone's layers sit at params["backbone"]["layers"]; 8 group rows in 4 micro-batches.
    assert build_critic_step(CONFIG, 4).sinks_layer_grads
    assert not build_critic_step(CONFIG, 1).sinks_layer_grads
    assert not build_critic_step(dataclasses.replace(CONFIG, remat="none"), 4).sinks_layer_grads
    params = jax.tree.map(np.asarray, init_critic_params(init_params(CONFIG, jax.random.key(0)), CONFIG))
    params["value_head"]["kernel"] = np.full_like(params["value_head"]["kernel"], 0.1)  # a gradient for the layers
    steps = {sinking: build_critic_step(CONFIG, 4, sinking=sinking) for sinking in (True, False)}
    assert steps[True].sinks_layer_grads and not steps[False].sinks_layer_grads
    states = {sinking: step.init_state(params) for sinking, step in steps.items()}
    for seed in range(2):
        batch = critic_batch(CONFIG, groups=8, seed=seed)
        metrics = {}
        for sinking, step in steps.items():
            states[sinking], metrics[sinking] = step(states[sinking], step.place_batch(batch))
        norms = [float(metrics[s]["train/grad_norm"].value) for s in (True, False)]
        np.testing.assert_allclose(norms[0], norms[1], rtol=1e-6)
    moved = max(
        float(jnp.max(jnp.abs(a - b)))
        for a, b in zip(
            jax.tree.leaves(states[True].params["backbone"]["layers"]), jax.tree.leaves(params["backbone"]["layers"])
        )
    )
    assert moved > 1e-4
    # As for the policy's step above: the same float32 operations, AdamW's division by the second moment's root.
    for got, want in zip(jax.tree.leaves(states[True].params), jax.tree.leaves(states[False].params), strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)


def test_the_sink_saves_a_buffer_of_the_layers_size():
    # Matrices of 256 x 512: the layers' gradient, not the activations, sets the peak of the accumulating loop.
    config = dataclasses.replace(CONFIG, hidden_size=256, intermediate_size=512, head_dim=64)
    params = init_params(config, jax.random.key(0))
    batch = grpo_batch(config, groups=2)
    temporaries = {}
    for sinking in (True, False):
        step = build_step(config, 2, sinking=sinking)
        compiled = step.compile(step.abstract_state, step.place_batch(batch))
        temporaries[sinking] = compiled.memory_analysis().temp_size_in_bytes
    layer_bytes = sum(x.nbytes for x in jax.tree.leaves(params["layers"]))
    # Measured: 1.00x the layers' bytes less under the suite's program-order scheduler, 0.42x under XLA's default one
    # (a run's); SmolLM2-135M's GRPO step 1.00 against 1.25 GiB (benchmarks/bench_grad_sink.py). Without the sink
    # in place, the two programs would hold the same.
    assert temporaries[False] - temporaries[True] >= 0.3 * layer_bytes, (temporaries, layer_bytes)
