"""bfloat16 mixed precision (docs/DTYPES.md): bf16 params and compute, float32 master weights and optimizer state.

The tolerances come from bfloat16's unit roundoff ``U = 2^-8`` (8 significand bits, round to nearest:
``|fl(x) - x| <= U |x|``), never from what this CPU happens to produce:

* one bf16 train step against the float32 step on the same params and batch (loss, gradient norm);
* master weights matter: at a learning rate whose AdamW steps are below half a bf16 ulp of the RMSNorm scales
  (1.0), bf16 params never move while float32 masters do, and so do the bf16 weights cast from them;
* SFT, DPO and one sync GRPO step run end to end in bf16 with float32 masters: losses finite and close to the
  float32 run's first-step loss, the optimizer state float32, checkpoints holding the masters (and an SFT run
  resumes from them exactly), the published weights bf16.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import shutil
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from feynrl_jax.config.base import add_data_source, base_config, data_source
from feynrl_jax.losses import ALGORITHMS, TrainBatch, compute_metrics
from feynrl_jax.models import ModelConfig, as_param_dtype, init_params
from feynrl_jax.sharding import RULES, make_mesh
from feynrl_jax.train.optimizer import make_optimizer
from feynrl_jax.train.step import ParamsSpec, make_algorithm_train_step, model_logprob_fn

U = 2.0**-8
"""bfloat16's unit roundoff: a rounding to bf16 changes a value by at most this fraction of it."""

# Depth 2. On any path from a parameter to the loss the bf16 program rounds about 8 times per layer and pass
# (norm output, q/k/v, attention output, o_proj, residual add, MLP input, gate * up, down_proj, residual add), and
# the initial params once: about 2 * 2 * 8 + 1 = 33 roundings of at most U each. Independent roundings add in
# quadrature (sqrt(33) U ~ 6 U); the loss and the gradient norm are sums over many tokens and parameters, which
# average the errors further. 8 U (3.1%) bounds them with a margin; a bug (a lost term, a wrong cast) is O(1).
STEP_RTOL = 8 * U

F32 = ModelConfig(
    vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16
)
BF16 = dataclasses.replace(F32, param_dtype="bfloat16", compute_dtype="bfloat16")
B, T = 8, 16
FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


def sft_batch(seed: int = 0) -> TrainBatch:
    """A random SFT batch: a 4-token prompt, the response after it, rows right-padded."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, F32.vocab_size, (B, T)).astype(np.int32)
    real = np.arange(T)[None, :] < rng.integers(10, T + 1, B)[:, None]
    positions = np.where(real, np.arange(T)[None, :], 0).astype(np.int32)
    loss_mask = (real & (np.arange(T)[None, :] >= 4)).astype(np.float32)
    zeros = np.zeros((B, T), np.float32)
    return TrainBatch(tokens, positions, real.astype(np.int32), loss_mask, zeros, zeros)


# At LR, AdamW's steps stay below half a bf16 ulp of 1.0 (see the master-weights test); the loss and gradient
# of a step do not depend on it.
LR = 5e-4


@functools.cache
def sft_step(config: ModelConfig, master_dtype: str | None):
    """The SFT train step (compiled once per module) on one device, the state's params in `master_dtype`."""
    mesh = make_mesh(1, 1, 1, devices=jax.devices()[:1])
    optimizer, _ = make_optimizer(LR, schedule="constant", max_grad_norm=None)
    return make_algorithm_train_step(
        ALGORITHMS["sft"],
        optimizer,
        mesh,
        RULES["dp"],
        config=config,
        params_spec=ParamsSpec.of_model(config).with_master_dtype(master_dtype),
        logprob_chunk_size=8,
        compiler_options=FAST_COMPILE,
    )


def dtypes(tree) -> set[str]:
    """The dtypes of the floating leaves of `tree`."""
    return {str(x.dtype) for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.floating)}


def test_bf16_step_with_float32_masters_matches_the_float32_step():
    params = init_params(F32, jax.random.key(0))
    batch = sft_batch()
    step32, step16 = sft_step(F32, None), sft_step(BF16, "float32")
    state32 = step32.init_state(params)
    state16 = step16.init_state(as_param_dtype(params, BF16))  # as the loops load them: in param_dtype
    assert dtypes(state16.params) == dtypes(state16.opt_state) == {"float32"}
    assert dtypes(step16.abstract_state) == {"float32"}  # the checkpoint restore target: the masters
    logprobs, _ = jax.eval_shape(model_logprob_fn(BF16), state16.params, batch)
    assert logprobs.dtype == jnp.float32

    _, typed32 = step32(state32, step32.place_batch(batch))
    new16, typed16 = step16(state16, step16.place_batch(batch))
    assert typed16["train/loss"].value.dtype == typed16["train/grad_norm"].value.dtype == jnp.float32
    assert dtypes(new16.params) == dtypes(new16.opt_state) == {"float32"}
    m32, m16 = compute_metrics(typed32), compute_metrics(typed16)
    for key in ("train/loss", "train/grad_norm"):
        got, want = float(m16[key]), float(m32[key])
        assert abs(got - want) <= STEP_RTOL * abs(want), (key, got, want)
    # ... and the bf16 program really ran in bf16: its gradient is not the float32 one.
    assert float(m16["train/grad_norm"]) != float(m32["train/grad_norm"])


def test_float32_masters_keep_updates_smaller_than_a_bf16_ulp():
    # The RMSNorm scales start at 1.0, where bf16's spacing is 2^-8 below and 2^-7 above: a change smaller than
    # half of 2^-8 (1.95e-3) rounds back to 1.0. AdamW's step is lr * m_hat / (sqrt(v_hat) + eps), at most
    # lr * (1 - b1) / sqrt(1 - b2) = 3.16 lr = 1.6e-3 at LR: bf16 params stay at 1.0 forever. Float32 masters
    # move by up to LR per step, up to 1e-2 in 20 steps where a gradient keeps its sign (the same batch every
    # step): past the rounding boundary (2^-9 below, 2^-8 above), so the bf16 weights the model runs on change too.
    params = as_param_dtype(init_params(F32, jax.random.key(1)), BF16)
    batch = sft_batch(seed=1)
    finals = {}
    for master in (None, "float32"):
        step = sft_step(BF16, master)
        state = step.init_state(params)
        for _ in range(20):
            state, metrics = step(state, step.place_batch(batch))
            assert float(compute_metrics(metrics)["train/update_skipped"]) == 0.0
        finals[master] = state
    scales = lambda params: np.asarray(params["layers"]["mlp_norm"]["scale"], np.float32).ravel()

    assert dtypes(finals[None].opt_state) == {"bfloat16"}  # without masters the optimizer state is bf16 too
    np.testing.assert_array_equal(scales(finals[None].params), 1.0)

    masters = scales(finals["float32"].params)
    assert np.all(masters != 1.0)
    model_weights = scales(as_param_dtype(finals["float32"].params, BF16))
    assert np.mean(model_weights != 1.0) > 0.5, masters


def test_the_model_and_the_engine_round_wider_params_to_param_dtype():
    """Float32 masters given to the model compute as their bf16 rounding, even with float32 compute (where the
    model's per-use cast to compute_dtype alone would keep them unrounded); the engine holds them in bf16."""
    from feynrl_jax.models import forward
    from feynrl_jax.rollout.native_engine import NativeEngine

    masters = init_params(F32, jax.random.key(2))
    config = dataclasses.replace(F32, param_dtype="bfloat16")  # bf16 weights, float32 activations
    tokens = jnp.asarray(sft_batch().tokens)
    positions = jnp.broadcast_to(jnp.arange(T), tokens.shape)
    run = jax.jit(lambda params: forward(params, tokens, positions, config=config)[0])
    np.testing.assert_array_equal(run(masters), run(as_param_dtype(masters, config)))
    assert not np.array_equal(run(masters), jax.jit(lambda p: forward(p, tokens, positions, config=F32)[0])(masters))

    engine = NativeEngine(BF16, masters, num_slots=2, cache_len=16)
    assert dtypes(engine._params) == {"bfloat16"}


# ---------------------------------------------------------------- the SFT, DPO and RL run paths


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    from feynrl_jax.data.toy_tokenizer import build_toy_tokenizer

    root = tmp_path_factory.mktemp("mixed_precision")
    rows = []
    for i in range(24):
        a, b = i % 7 + 1, (i * 3) % 5 + 1
        prompt = f"What is {a} plus {b}?"
        rows.append(
            {"prompt": prompt, "response": f"#### {a + b}", "chosen": f"It is {a + b}.", "rejected": f"It is {a}!!"}
        )
    with open(root / "train.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    texts = [" ".join(r.values()) for r in rows]
    build_toy_tokenizer(texts, vocab_size=200).save_pretrained(root / "tokenizer")
    return root


def tiny_config(root, run_dir, paradigm: str, precision: str, steps: int):
    """A tiny random-init SFT or DPO run: float32 ("f32") or bf16 params and compute with float32 masters."""
    config = base_config()
    config.paradigm = paradigm
    config.run_dir = str(run_dir)
    config.seed = 1
    config.model.random_init = True
    config.model.tokenizer = str(root / "tokenizer")
    if precision == "bf16":
        config.model.param_dtype = config.model.compute_dtype = "bfloat16"
        config.model.master_dtype = "float32"
    arch = config.model.arch
    arch.vocab_size, arch.hidden_size, arch.intermediate_size = 264, 32, 64
    arch.num_heads, arch.num_kv_heads, arch.head_dim = 4, 2, 8
    add_data_source(config, "toy", data_source("jsonl", path=str(root / "train.jsonl")))
    config.data.max_seq_len = 48
    config.data.max_prompt_len = 40
    config.algo.name = paradigm
    config.algo.reference = "initial" if paradigm == "dpo" else "none"
    config.optim.lr = 3e-3
    config.optim.schedule = "constant"
    config.train.steps = steps
    config.train.global_batch_size = 8
    config.checkpoint.every_steps = 1
    config.checkpoint.keep = 2
    config.tracking.progress_bar = False
    config.eval.during_training = paradigm == "dpo"  # DPO: held-out preference accuracy on the train pairs
    config.eval.reward = ""
    config.eval.split = "train"
    config.eval.num_prompts = 8
    return config


def saved_state(run_dir):
    from feynrl_jax.checkpoints.train_state import TrainCheckpointer

    with TrainCheckpointer(str(run_dir), save_every=1, keep=1, read_only=True) as checkpointer:
        return checkpointer.restore_state_unsharded()


def bf16_losses(run_dir) -> list[float]:
    """The per-step training losses of a bf16 run, checked finite and applied."""
    from feynrl_jax.tracking import read_metrics

    records = [r for r in read_metrics(str(run_dir)) if "train/loss" in r]
    assert all(np.isfinite(r["train/loss"]) and r["train/update_skipped"] == 0 for r in records), records
    return [r["train/loss"] for r in records]


@pytest.mark.slow
def test_sft_in_bf16_with_float32_masters_checkpoints_the_masters_and_resumes_exactly(data_dir, tmp_path):
    from feynrl_jax.tracking import read_metrics
    from feynrl_jax.train import sft_loop

    sft_loop.run(tiny_config(data_dir, tmp_path / "f32", "sft", "f32", steps=1))
    sft_loop.run(tiny_config(data_dir, tmp_path / "bf16", "sft", "bf16", steps=2))
    # Step 1 runs the same initial weights (bf16-rounded) on the same batch in both: STEP_RTOL's argument.
    f32_loss = read_metrics(str(tmp_path / "f32"))[-1]["train/loss"]
    assert abs(bf16_losses(tmp_path / "bf16")[0] - f32_loss) <= STEP_RTOL * f32_loss
    straight = saved_state(tmp_path / "bf16")
    assert dtypes(straight["params"]) == dtypes(straight["opt_state"]) == {"float32"}

    # A crash after step 1's checkpoint (step 2's removed), resumed: the float32 masters and moments come back
    # exactly, so step 2 gives the straight run's state bitwise.
    shutil.copytree(tmp_path / "bf16", tmp_path / "resumed")
    shutil.rmtree(tmp_path / "resumed" / "checkpoints" / "2")
    sft_loop.run(tiny_config(data_dir, tmp_path / "resumed", "sft", "bf16", steps=2))
    resumed = saved_state(tmp_path / "resumed")
    # It resumed after step 1 (a fresh start would have rewritten step 1's line of metrics.jsonl).
    assert read_metrics(str(tmp_path / "resumed"))[0] == read_metrics(str(tmp_path / "bf16"))[0]
    for got, want in zip(jax.tree.leaves(resumed), jax.tree.leaves(straight), strict=True):
        np.testing.assert_array_equal(got, want)


@pytest.mark.slow
def test_dpo_in_bf16_with_float32_masters(data_dir, tmp_path):
    from feynrl_jax.tracking import read_metrics
    from feynrl_jax.train import dpo_loop

    dpo_loop.run(tiny_config(data_dir, tmp_path / "bf16", "dpo", "bf16", steps=2))
    # The float32 run's first-step loss is log 2 (policy == reference: tests/test_dpo_loop.py). Here too: the
    # reference is the initial bf16 weights and the policy runs on its float32 masters rounded to bf16, the same
    # weights; the two programs may round differently (STEP_RTOL).
    losses = bf16_losses(tmp_path / "bf16")
    assert abs(losses[0] - math.log(2.0)) <= STEP_RTOL * math.log(2.0)
    assert losses[1] < losses[0]
    # The held-out evaluation scores the policy's bf16 weights against the same reference: no margin at step 0.
    start = read_metrics(str(tmp_path / "bf16"))[0]
    assert start["step"] == 0 and abs(start["eval/reward_margin"]) <= STEP_RTOL
    state = saved_state(tmp_path / "bf16")
    assert dtypes(state["params"]) == dtypes(state["opt_state"]) == {"float32"}


@pytest.mark.slow
def test_grpo_step_in_bf16_with_float32_masters_publishes_bf16_weights(tmp_path):
    """One sync GRPO step without Ray, as the trainer actor runs it: the trainer publishes its weights
    (`host_params`), the native engine samples with them, the trainer trains on those rollouts."""
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "configs"))
    import tiny_rl

    from feynrl_jax.rollout.native_engine import NativeEngine
    from feynrl_jax.rollout.types import SamplingParams
    from feynrl_jax.train.rl_trainer import RLTrainer

    config = tiny_rl.get_config("grpo")  # a KL penalty to the initial policy: the reference runs too
    config.run_dir = str(tmp_path / "bf16")
    config.data.max_prompt_len, config.data.max_seq_len = 16, 32
    config.train.mini_batches, config.train.micro_batch_size = 1, 0  # one update, at ratio 1
    config.checkpoint.every_steps = 0
    config.model.param_dtype = config.model.compute_dtype = "bfloat16"
    config.model.master_dtype = "float32"
    trainer = RLTrainer(config)
    trainer.start()
    published = trainer.host_params()
    assert dtypes(published) == dtypes(trainer.reference) == {"bfloat16"}
    assert dtypes(trainer.state.params) == dtypes(trainer.state.opt_state) == {"float32"}

    rng = np.random.default_rng(0)
    prompts = [rng.integers(10, 1000, size).tolist() for size in (5, 9, 12, 16)]
    engine = NativeEngine(trainer.model_config, published, num_slots=8, cache_len=32, decode_steps_per_dispatch=4)
    rollouts = engine.generate(prompts, SamplingParams(max_new_tokens=16, n=4, seed=0))
    rewards = rng.integers(0, 2, len(rollouts.prompt_ids)).astype(np.float32)
    metrics = trainer.train(rollouts, rewards, step=1, shuffle_seed=0)
    trainer.close()

    assert all(np.isfinite(metrics[k]) for k in ("train/loss", "train/grad_norm", "rollout/logprob_mismatch_max_abs"))
    assert metrics["train/update_skipped"] == 0 and metrics["loss/ratio_mean"] == 1.0
    # The float32 run's first-step loss on these rollouts is -sum(A m) / sum(m) = -train/advantage_mean: ratio 1,
    # and no KL to a reference equal to the policy. The bf16 run's reference is the initial bf16 weights and its
    # policy the float32 masters rounded to bf16, the same weights: its loss terms are of the size of |A|, each
    # computed to STEP_RTOL.
    want = -metrics["train/advantage_mean"]
    assert abs(metrics["train/loss"] - want) <= STEP_RTOL * metrics["train/advantage_abs_mean"]
    assert dtypes(trainer.state.params) == dtypes(trainer.state.opt_state) == {"float32"}
    after = trainer.host_params()
    assert dtypes(after) == {"bfloat16"}
    assert any(np.any(a != b) for a, b in zip(jax.tree.leaves(after), jax.tree.leaves(published), strict=True))
