"""Exact resume of an RL run, sync and async: killed with SIGKILL (driver, Ray and every actor) after a checkpoint
and resumed, it equals a run that never stopped: same per-step losses and rewards, bitwise-identical final params.

With `train.max_staleness=2` the checkpoint of step 2 holds the batches of steps 3 and 4, generated from versions
0 and 1 while the trainer trained; the resumed run trains on exactly those.

Every run is a real `feynrl-jax train` subprocess of the Ray loop (tiny random model, reasoning-gym
`chain_sum`, 2 mini-batches per step, asynchronous checkpoints every 2 steps). The sampling seed of each step
comes from the checkpointed PRNG key and the prompts from the checkpointed data-iterator state, so the
resumed run regenerates the same rollouts.
"""

import os
import textwrap

import jax
import numpy as np
import pytest
import resume_harness as harness
import rl_run_checks

from feynrl_jax.checkpoints.train_state import TrainCheckpointer
from feynrl_jax.tracking import read_metrics

TOTAL_STEPS = 4
SAVE_EVERY = 2
KILL_AFTER_LOGGED_STEP = 3

CONFIG = textwrap.dedent(
    """
    import importlib.util
    import os

    spec = importlib.util.spec_from_file_location("tiny_rl", os.environ["TINY_RL_CONFIG"])
    tiny_rl = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tiny_rl)

    def get_config(arg=None):
        name, staleness = arg.rsplit("-k", 1)
        config = tiny_rl.get_config("grpo")
        config.run_dir = os.path.join(os.environ["RESUME_ROOT"], arg)
        config.train.max_staleness = int(staleness)
        config.seed = 5
        config.train.steps = {steps}
        config.checkpoint.every_steps = {every}
        config.checkpoint.async_save = True
        config.eval.during_training = False
        return config
    """
).format(steps=TOTAL_STEPS, every=SAVE_EVERY)


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    root = tmp_path_factory.mktemp("rl_resume")
    (root / "resume_rl.py").write_text(CONFIG)
    env = harness.subprocess_env(
        # As the actors of the in-process RL tests (actor_devices.RAY_ACTOR_DEVICES): still a mesh (data 2), at a
        # fraction of 8 devices' cost on a 2-core machine.
        devices=2,
        rl=True,
        RESUME_ROOT=str(root),
        TINY_RL_CONFIG=os.path.join(os.path.dirname(__file__), "..", "configs", "tiny_rl.py"),
    )
    return root, env


def _train(root, env, run_name):
    # A session of its own: SIGKILL to the group takes down the driver, Ray's processes and every actor at once.
    return harness.start_train(f"{root / 'resume_rl.py'}:{run_name}", env, new_session=True)


def _final_policy(run_dir):
    with TrainCheckpointer(run_dir, save_every=SAVE_EVERY, keep=2) as ckpt:
        assert ckpt.latest_step() == TOTAL_STEPS
        state = ckpt.restore_state_unsharded()
    leaves, _ = jax.tree_util.tree_flatten_with_path(state)
    return {jax.tree_util.keystr(path): np.asarray(leaf) for path, leaf in leaves}


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.ray
@pytest.mark.parametrize("staleness", [0, 2], ids=["sync", "async"])
def test_rl_run_killed_and_resumed_equals_a_straight_run(workspace, staleness):
    root, env = workspace
    straight_name, interrupted_name = f"straight-k{staleness}", f"interrupted-k{staleness}"
    harness.wait_success(_train(root, env, straight_name), timeout=900)

    run_dir = str(root / interrupted_name)
    proc = _train(root, env, interrupted_name)
    harness.kill_after_logged_step(
        proc,
        run_dir,
        KILL_AFTER_LOGGED_STEP,
        save_every=SAVE_EVERY,
        total_steps=TOTAL_STEPS,
        timeout=900,
        group=True,
    )

    harness.wait_success(_train(root, env, interrupted_name), timeout=900)

    # The straight run is also the suite's check of what every GRPO run logs, its steps and version lags among
    # them (tests/test_rl_algorithms.py runs the other algorithms).
    want = rl_run_checks.assert_loop_records(str(root / straight_name), "grpo")
    got = read_metrics(run_dir)
    assert [r["step"] for r in got] == list(range(1, TOTAL_STEPS + 1))
    for key in (
        "train/loss",
        "train/grad_norm",
        "rollout/reward/total/mean",
        "rollout/response_length_mean",
        "train/policy_version",
        "loss/ratio_mean",
        "rollout/version_lag_mean",
    ):
        assert [r[key] for r in got] == [r[key] for r in want], key
    # Different prompts and samples every step (a tiny random model never stops early, so lengths do not tell).
    assert len({r["train/entropy"] for r in want}) > 1, "the steps sample different rollouts"

    if staleness:
        # The resumed run trained on the batches the checkpoint held in flight, with their weights.
        assert [r["loss/is_weight_mean"] for r in got] == [r["loss/is_weight_mean"] for r in want]

    a, b = _final_policy(str(root / straight_name)), _final_policy(run_dir)
    assert a.keys() == b.keys()
    for name in a:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)
