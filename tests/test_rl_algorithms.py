"""Integration: every RL algorithm of the registry runs 2 steps on Ray with a tiny random model, async
(`train.max_staleness=1`: step 1 trains on-policy, step 2 on the batch version 0 generated while step 1 trained,
with the decoupled objective's truncated importance weights), so each loss runs at lag 0 and at lag 1. Sync
(`train.max_staleness=0`, no correction) runs for one algorithm of each family: GRPO (group baseline), PPO
(critic and GAE) and DAPO (dynamic sampling's refills); sync GRPO also runs in the resume and fault tests.

One Ray session serves the module. Each run is the real loop (`feynrl_jax.orchestration.rl_loop.run`): rollout
worker actors with native engines, the reward actor, the trainer actor, the parameter store. A persistent
compilation cache shared by the actors keeps the module fast; it does not weaken any check.
"""

import json
import os
import sys

import numpy as np
import pytest

from feynrl_jax.losses import ALGORITHMS
from feynrl_jax.tracking import read_metrics

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "configs"))
import tiny_rl  # noqa: E402

RL_ALGORITHMS = sorted(name for name, a in ALGORITHMS.items() if a.paradigm == "rl")


def tiny_config(algo: str, run_dir: str, **changes):
    config = tiny_rl.get_config(algo)
    config.run_dir = run_dir
    config.eval.during_training = False
    for key, value in changes.items():
        section, name = key.split(".")
        config[section][name] = value
    return config


RUNS = [(algo, 1) for algo in RL_ALGORITHMS] + [("grpo", 0), ("ppo", 0), ("dapo", 0)]


@pytest.mark.slow
@pytest.mark.ray
@pytest.mark.parametrize(("algo", "staleness"), RUNS, ids=[f"{a}-{'async' if k else 'sync'}" for a, k in RUNS])
def test_two_steps_of_every_rl_algorithm(ray_session, tmp_path, algo, staleness):
    from feynrl_jax.orchestration import rl_loop

    config = tiny_config(algo, str(tmp_path / algo))
    config.train.max_staleness = staleness
    if algo == "dapo":
        config.algo.dynamic_sampling = True
        config.algo.max_refill_draws = 1
    last = rl_loop.run(config)
    records = read_metrics(config.run_dir)
    assert [r["step"] for r in records] == [1, 2]
    for record in records:
        for key in (
            "train/loss",
            "train/grad_norm",
            "rollout/reward/total/mean",
            "rollout/response_length_mean",
            "rollout/logprob_mismatch_max_abs",
            "perf/rollout_seconds",
            "perf/train_seconds",
            "train/entropy",
            "loss/ratio_mean",
        ):
            assert np.isfinite(record[key]), (algo, key, record.get(key))
        assert record["train/updates"] == config.train.ppo_epochs * config.train.mini_batches
    assert last["train/policy_version"] == 2
    # The engine shares the trainer's model code: at step 1 (no lag in either mode) behaviour and trainer
    # log-probabilities agree.
    assert records[0]["rollout/logprob_mismatch_max_abs"] < 1e-3
    # Step t trains on the batch of version max(0, t - 1 - k): lag 0 then min(k, 1).
    assert [r["rollout/version_lag_max"] for r in records] == [0, staleness]
    assert [r[f"rollout/version_lag_frac_{staleness}"] for r in records] == [float(staleness == 0), 1.0]
    # Async defaults to the decoupled objective with truncated importance weights; sync to no correction.
    assert all(("loss/is_weight_mean" in r) == (staleness > 0) for r in records)
    if staleness:
        assert 0 < records[1]["loss/is_ess"] <= 1 and 0 < records[1]["rollout/behavior_ess"] <= 1
    if ALGORITHMS[algo].needs_critic:
        assert np.isfinite(last["loss/critic_value"]) and "train/critic_grad_norm" in last
    if algo == "dapo":
        # A random model's rewards rarely differ inside a group: constant groups are dropped and one refill drawn.
        assert all(r["rollout/dynamic_sampling_draws"] <= 1 for r in records)
        dropped = sum(r["rollout/dynamic_sampling_dropped_groups"] for r in records)
        assert dropped == 0 or any(r["rollout/dynamic_sampling_draws"] == 1 for r in records)
    if config.algo.kl_coef:
        assert "train/kl_ref" in last
    # The final checkpoint exists and records the policy version.
    with open(os.path.join(config.run_dir, "config.json")) as f:
        assert json.load(f)["algo"]["name"] == algo
