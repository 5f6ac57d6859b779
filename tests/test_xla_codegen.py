"""The suite compiles at XLA's backend optimisation level 0 (tests/xla_codegen.py), its RL runs at XLA's default
level, and what the suite checks at level 0 holds at the default level, where users run.

The model's log-probabilities and their gradient, three GRPO train steps and the native engine's greedy and sampled
decoding, each computed in two fresh one-device processes, one at XLA's default level and one at this session's,
agree to float32 rounding. Any tolerance below is a bound on float32 rounding of the sums involved (XLA:CPU compiles
without fast-math, so the two levels may differ in rounding only, as fused multiply-adds do); a miscompiled or
differently lowered program is off by orders of magnitude more.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import resume_harness as harness
import xla_codegen
from actor_devices import actor_xla_flags

TESTS = Path(__file__).resolve().parent

_COMPUTE = """
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, sys.argv[2])
import test_train_step
from test_engine import CONFIG as ENGINE_CONFIG, PROMPTS
from test_train_step import CONFIG, STEPS, build_step, initial_params, make_batch

test_train_step.FAST_COMPILE = {}  # the train step at this process's level (XLA_FLAGS), not test_train_step's 0

from feynrl_jax.models import init_params, sequence_logprobs
from feynrl_jax.rollout.native_engine import NativeEngine
from feynrl_jax.rollout.types import SamplingParams

assert jax.device_count() == 1
out = {}
# The model's log-probabilities of a batch and the gradient of their masked mean (the core of every loss).
batch = make_batch("grpo", seed=0)
params = initial_params()

def mean_logprob(params):
    lp, _ = sequence_logprobs(params, batch.tokens, batch.positions, config=CONFIG, segment_ids=batch.segment_ids)
    return jnp.sum(lp * batch.loss_mask) / jnp.sum(batch.loss_mask), lp

grads, lp = jax.jit(jax.grad(mean_logprob, has_aux=True))(params)
out["logprobs"] = np.asarray(lp)
for path, leaf in jax.tree_util.tree_leaves_with_path(grads):
    out["grad" + jax.tree_util.keystr(path)] = np.asarray(leaf)
# GRPO train steps: loss and gradient norm of each.
train_step = build_step("grpo", "single")
state = train_step.init_state(params)
losses, norms = [], []
for i in range(STEPS):
    state, metrics = train_step(state, train_step.place_batch(make_batch("grpo", seed=i)))
    losses.append(float(metrics["train/loss"].value))
    norms.append(float(metrics["train/grad_norm"].value))
out["losses"], out["grad_norms"] = np.asarray(losses), np.asarray(norms)
# The native engine, greedy and sampled, on test_engine's peaked random model.
engine_params = jax.tree.map(lambda x: x * 8.0 if x.ndim > 2 else x, init_params(ENGINE_CONFIG, jax.random.PRNGKey(0)))
engine = NativeEngine(ENGINE_CONFIG, engine_params, num_slots=3, cache_len=48, decode_steps_per_dispatch=4)
for name, sampling in (
    ("greedy", SamplingParams(greedy=True, max_new_tokens=12, n=1)),
    ("sampled", SamplingParams(temperature=0.7, max_new_tokens=12, n=2, seed=11)),
):
    rollouts = engine.generate(PROMPTS, sampling)
    out[name + "_tokens"] = np.asarray(rollouts.completion_ids)
    out[name + "_lengths"] = np.asarray(rollouts.completion_lengths)
    out[name + "_logprobs"] = np.asarray(rollouts.behavior_logprobs)
np.savez(sys.argv[1], **out)
"""


def _compute(tmp_path: Path, name: str, xla_flags: str) -> dict[str, np.ndarray]:
    out = tmp_path / f"{name}.npz"
    env = dict(os.environ, XLA_FLAGS=xla_flags, JAX_PLATFORMS="cpu")
    proc = subprocess.run(
        [sys.executable, "-c", _COMPUTE, str(out), str(TESTS)], capture_output=True, text=True, env=env, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    with np.load(out) as data:
        return dict(data)


def test_the_suite_compiles_at_its_level_and_rl_runs_at_the_default():
    level = f"--xla_backend_optimization_level={xla_codegen.session_level()}"
    assert level in os.environ["XLA_FLAGS"].split()
    assert level in harness.subprocess_env(devices=2)["XLA_FLAGS"].split()  # SFT, DPO and evaluation CLI runs
    # RL runs: the Ray actors of the in-process runs and the processes of the CLI runs, at XLA's default level.
    assert "xla_backend_optimization_level" not in actor_xla_flags(os.environ["XLA_FLAGS"])
    assert "xla_backend_optimization_level" not in harness.subprocess_env(devices=2, rl=True)["XLA_FLAGS"]
    # A level the environment names is kept, in the session and in the flags a subprocess gets.
    environ = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=2"}
    assert xla_codegen.session_level(environ) == "2"
    assert xla_codegen.with_suite_codegen("--xla_force_host_platform_device_count=4", environ).split() == [
        "--xla_force_host_platform_device_count=4",
        "--xla_backend_optimization_level=2",
    ]
    assert xla_codegen.with_suite_codegen(environ["XLA_FLAGS"], {}) == environ["XLA_FLAGS"]
    assert xla_codegen.session_level({}) == "0"
    assert xla_codegen.with_suite_codegen("", {}) == "--xla_backend_optimization_level=0"
    assert xla_codegen.for_rl_run(environ["XLA_FLAGS"]) == "--xla_force_host_platform_device_count=8"


@pytest.mark.slow
def test_what_the_suite_checks_at_its_level_holds_at_the_default_level(tmp_path):
    one_device = "--xla_force_host_platform_device_count=1"
    default = _compute(tmp_path, "default", xla_codegen.for_rl_run(one_device))
    suite = _compute(tmp_path, "suite", xla_codegen.with_suite_codegen(one_device))
    assert default.keys() == suite.keys()
    # Log-probabilities of about -log(128) ~ -4.9: a logsumexp over 128 logits, each a sum over 64-wide products;
    # float32 rounding of such sums in another order is ~1e-6 absolute.
    np.testing.assert_allclose(suite["logprobs"], default["logprobs"], rtol=0, atol=1e-5)
    # Each gradient entry sums about 16 x 16 token terms through two layers: reordered, ~n * 2^-24 ~ 2e-5 of the
    # leaf's scale; 1e-4 of each leaf's largest entry bounds it.
    for key in (k for k in default if k.startswith("grad")):
        scale = np.max(np.abs(default[key]))
        assert scale > 0, key
        np.testing.assert_allclose(suite[key], default[key], rtol=0, atol=1e-4 * scale, err_msg=key)
    # GRPO's loss sums terms of size |advantage| ~ 1 that nearly cancel: its rounding is absolute (~1e-7 per term
    # over 256 tokens); the gradient norm is a sum of squares, relative rounding.
    np.testing.assert_allclose(suite["losses"], default["losses"], rtol=0, atol=1e-5)
    np.testing.assert_allclose(suite["grad_norms"], default["grad_norms"], rtol=1e-4)
    # The engine's random model is scaled to peaked distributions: rounding cannot change an argmax or a sampled
    # token, so the tokens are equal, and their log-probabilities agree to float32 rounding.
    for name in ("greedy", "sampled"):
        np.testing.assert_array_equal(suite[name + "_tokens"], default[name + "_tokens"], err_msg=name)
        np.testing.assert_array_equal(suite[name + "_lengths"], default[name + "_lengths"], err_msg=name)
        np.testing.assert_allclose(
            suite[name + "_logprobs"], default[name + "_logprobs"], rtol=0, atol=1e-4, err_msg=name
        )
