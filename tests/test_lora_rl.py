"""LoRA in the RL loop (Ray actors, native engine): the weight sync carries the adapters alone, the rollout engine
applies them exactly as the trainer does, the reference is the policy's own base, and the critic of PPO trains
beside the adapters, in sync and async runs.
"""

import os
import sys

import jax
import numpy as np
import pytest

from feynrl_jax.models import lora
from feynrl_jax.models.decoder import param_shapes
from feynrl_jax.tracking import read_metrics

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "configs"))
import tiny_rl  # noqa: E402


def _is_shape(x) -> bool:
    return isinstance(x, tuple)


def tree_bytes(shapes, itemsize: int) -> int:
    return sum(int(np.prod(s)) * itemsize for s in jax.tree.leaves(shapes, is_leaf=_is_shape))


@pytest.mark.slow
@pytest.mark.ray
# GRPO runs plain LoRA; PPO runs QLoRA (an NF4 base; its critic a plain model) with the held-out evaluation on (the
# trainer's engine gets the merged, dequantized weights).
@pytest.mark.parametrize(("algo", "staleness", "quantize_base"), [("grpo", 0, ""), ("ppo", 1, "nf4")])
def test_rl_with_lora_syncs_adapters_only(ray_session, tmp_path, algo, staleness, quantize_base):
    from feynrl_jax.orchestration import rl_loop
    from feynrl_jax.train.rl_trainer import RLTrainer

    config = tiny_rl.get_config(algo)
    config.run_dir = str(tmp_path / f"{algo}{quantize_base}")
    config.eval.during_training = bool(quantize_base)
    config.train.steps = 2
    config.train.max_staleness = staleness
    if algo == "grpo":  # PPO has no KL term
        config.algo.kl_coef = 0.05
        config.algo.reference = "initial"
        # Rewards that differ within groups, so the adapters get a policy gradient: the tiny random model never
        # solves chain_sum, and with equal rewards and the policy equal to the reference GRPO's gradient is zero.
        # (Some of its random completions start with whitespace and some do not.)
        config.rollout.rewards = {"format": 1.0}
        config.rollout.reward_kwargs = {"format": {"pattern": r"\s.*"}}
    config.model.lora.rank = 4
    # QLoRA: the NF4 base is published once as it is stored; the native engine dequantizes it as the trainer does.
    config.model.lora.quantize_base = quantize_base
    rl_loop.run(config)
    records = read_metrics(config.run_dir)
    if quantize_base:  # the held-out evaluation ran, before training and after, on the merged dequantized weights
        assert [r["step"] for r in records if "eval/accuracy" in r] == [0, 2]
    records = [r for r in records if r["step"] >= 1]
    assert [r["step"] for r in records] == [1, 2]
    # The rollout worker warmed up (`rollout.warmup`) on placeholder weights of the adapters' (and NF4 base's)
    # layout: its first generation compiled nothing, and then loaded base and adapters together.
    assert records[0]["perf/rollout_warmup_seconds"] > 0 and records[0]["perf/rollout_compile_seconds"] == 0.0

    trainer = RLTrainer(config)  # the model config and the final state, read back from the run folder
    model_config = trainer.model_config
    assert model_config.lora_rank == 4
    itemsize = np.dtype(model_config.param_dtype).itemsize
    base, adapters = lora.split(param_shapes(model_config))
    adapter_bytes, full_bytes = tree_bytes(adapters, itemsize), tree_bytes(base, itemsize)
    for record in records:
        # Every sync carries the adapters alone (the base went to the store once, at start).
        assert record["perf/publish_bytes"] == adapter_bytes < full_bytes / 50
        # The engine applies the adapters as the trainer does: behaviour and trainer log-probabilities agree
        # whenever both use the same version (every step of a sync run, with adapters that have moved from step
        # 2 on; the first step of an async one, where later batches come from an older version).
        if staleness == 0 or record["step"] == 1:
            assert record["rollout/logprob_mismatch_max_abs"] < 1e-3
    # The reference is the base with the adapters off: zero KL while B = 0, positive once the adapters moved.
    if algo == "grpo":
        assert records[0]["train/kl_ref"] == 0.0 and records[-1]["train/kl_ref"] > 0
    else:
        assert all(np.isfinite(r["loss/critic_value"]) for r in records)
    config.checkpoint.resume = True
    config.train.compile_ahead = False  # started to read its state back, never trained
    trainer = RLTrainer(config)
    trainer.start()
    final = jax.tree.map(np.asarray, trainer.state.params)
    initial = jax.tree.map(np.asarray, trainer._initial_params())
    # The trainer actor initialised the base at XLA's default backend optimisation level, this process at the
    # suite's (tests/xla_codegen.py): the random init rounds differently there by a float32 ulp or two (7e-9 on
    # weights of ~0.02 measured). One update of the base would move it by ~lr = 1e-4 (Adam), 1e-2 of such a weight:
    # 1e-6 relative sits between the two. NF4 codes are integers: an ulp changes one only for a weight within an
    # ulp of a code boundary (about 1e-7 of the weights, of some 1e5 quantized here), so they are compared exactly.
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(final)[0], jax.tree.leaves(initial), strict=True):
        if lora.is_adapter_path(path):
            continue
        if np.issubdtype(a.dtype, np.integer):
            np.testing.assert_array_equal(a, b, err_msg=jax.tree_util.keystr(path))
        else:
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=0, err_msg=jax.tree_util.keystr(path))
    assert np.abs(final["layers"]["q_proj"]["lora_b"]).max() > 0
    trainer.close()
