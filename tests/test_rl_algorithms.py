"""Integration: every RL algorithm of the registry but GRPO runs 2 steps on Ray with a tiny random model, async
(`train.max_staleness=1`: step 1 trains on-policy, step 2 on the batch version 0 generated while step 1 trained,
with the decoupled objective's truncated importance weights), so each loss runs at lag 0 and at lag 1. Sync
(`train.max_staleness=0`, no correction) runs for PPO (critic and GAE) and DAPO (dynamic sampling's refills).
GRPO (group baseline) runs sync and async (k = 2, lags 0 to 2) as the straight runs of tests/test_rl_resume.py,
which check them with the same `rl_run_checks.assert_loop_records`; sync GRPO also runs in the fault tests.

One Ray session serves the module. Each run is the real loop (`feynrl_jax.orchestration.rl_loop.run`): rollout
worker actors with native engines, the reward actor, the trainer actor, the parameter store. A persistent
compilation cache shared by the actors keeps the module fast; it does not weaken any check.
"""

import logging
import os
import sys

import pytest
import rl_run_checks

from feynrl_jax.losses import ALGORITHMS

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


RUNS = [(algo, 1) for algo in RL_ALGORITHMS if algo != "grpo"] + [("ppo", 0), ("dapo", 0)]


@pytest.mark.slow
@pytest.mark.ray
@pytest.mark.parametrize(("algo", "staleness"), RUNS, ids=[f"{a}-{'async' if k else 'sync'}" for a, k in RUNS])
def test_two_steps_of_every_rl_algorithm(ray_session, tmp_path, caplog, algo, staleness):
    from feynrl_jax.orchestration import rl_loop

    caplog.set_level(logging.INFO, logger=rl_loop.__name__)

    config = tiny_config(algo, str(tmp_path / algo))
    config.train.max_staleness = staleness
    if algo == "dapo":
        config.algo.dynamic_sampling = True
        config.algo.max_refill_draws = 1
    rl_loop.run(config)
    # The trainer actor trains on the fake devices `ray_session` gives the actors (actor_devices.RAY_ACTOR_DEVICES).
    assert "trainer: mesh {'data': 2, 'fsdp': 1, 'tensor': 1} over 2 devices in 1 process(es)" in caplog.text
    records = rl_run_checks.assert_loop_records(config.run_dir, algo)
    if algo == "dapo":
        # A random model's rewards rarely differ inside a group: constant groups are dropped and one refill drawn.
        assert all(r["rollout/dynamic_sampling_draws"] <= 1 for r in records)
        dropped = sum(r["rollout/dynamic_sampling_dropped_groups"] for r in records)
        assert dropped == 0 or any(r["rollout/dynamic_sampling_draws"] == 1 for r in records)
