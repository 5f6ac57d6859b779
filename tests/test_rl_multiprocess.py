"""The RL trainer as 2 Ray actors joined by `jax.distributed` (`ray.trainer_processes=2`, 4 fake CPU devices each)
against 1 trainer process with 8: the real `feynrl-jax train` on `configs/tiny_rl.py`, sync GRPO, a data 2 x fsdp 4
mesh whose parameter shards live in both processes.

Same mesh shape, same partitioned programs: the first step's rollouts are the same (same initial weights, same
sampling keys), its gradient norm and loss agree to float32 reduction-order rounding (tolerances justified below),
and so do the params it produces (the step-1 checkpoints of both runs). Later steps sample with those params: while
the rollouts stay the same (equal rewards) the figures must agree too, but one token whose two most likely
candidates differ by less than the rounding of the two layouts is enough to sample another token and change a
rollout, and how soon that happens depends on the CPU's kernels, so only the first step is required to match.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
import resume_harness as harness

from feynrl_jax.tracking import read_metrics

ROOT = Path(__file__).resolve().parents[1]
STEPS = 2
LR = 1e-3


def step_params(run_dir: Path, step: int):
    """The policy params of the run's checkpoint after `step`, on the host."""
    from feynrl_jax.checkpoints.train_state import TrainCheckpointer

    with TrainCheckpointer(str(run_dir), save_every=1, keep=STEPS, read_only=True) as checkpointer:
        return checkpointer.restore_state_unsharded(step)["policy"]["params"]


REWARD = """
def vowel_share(prompt, completion, example):
    return sum(c in "aeiou" for c in completion) / max(len(completion), 1)
"""


def run_rl(tmp_path, name: str, *, processes: int) -> Path:
    run_dir = tmp_path / name
    # A reward that varies within every group (a random tiny model never solves chain_sum): real advantages and
    # gradients, so the comparison is of training, not of rounding noise around zero.
    (tmp_path / "mp_reward.py").write_text(REWARD)
    env = harness.subprocess_env(devices=8 // processes, rl=True, PYTHONPATH=str(tmp_path))
    command = [
        sys.executable,
        "-m",
        "feynrl_jax.cli.main",
        "train",
        f"--config={ROOT / 'configs' / 'tiny_rl.py'}",
        f"--config.run_dir={run_dir}",
        f"--config.train.steps={STEPS}",
        "--config.mesh.data=2",
        "--config.mesh.fsdp=4",
        "--config.mesh.rules=fsdp",
        "--config.checkpoint.every_steps=1",
        f"--config.checkpoint.keep={STEPS}",
        "--config.train.eval_every=2",
        f"--config.ray.trainer_processes={processes}",
        '--config.rollout.rewards={"mp_reward:vowel_share": 1.0}',
        f"--config.optim.lr={LR}",
        # Adam turns a gradient component that is rounding noise (~1e-9, of either sign) into a full +-lr step
        # unless eps dominates it; with eps 1e-4 such components move by ~1e-8 and both layouts keep sampling
        # the same tokens.
        "--config.optim.eps=1e-4",
    ]
    harness.wait_success(harness.popen(command, env, new_session=True), timeout=600)
    return run_dir


@pytest.mark.slow
@pytest.mark.multiprocess
# Alone, for memory: its two trainer processes (4 fake devices each) held about 4.6 GB each, and beside the other
# pytest worker (about 6 GB) the first pass once ran the 24 GiB machine out of memory (the kernel killed a worker).
@pytest.mark.serial
def test_two_trainer_processes_train_like_one(tmp_path):
    one = run_rl(tmp_path, "one", processes=1)
    two = run_rl(tmp_path, "two", processes=2)

    def per_step(run_dir, key):
        records = [r for r in read_metrics(str(run_dir)) if r["step"] >= 1]
        assert [r["step"] for r in records] == list(range(1, STEPS + 1))
        return [r[key] for r in records]

    assert min(np.abs(per_step(one, "train/advantage_abs_mean"))) > 0.1  # a real training signal
    # The same rollouts at step 1, and at every later step until a near-tie samples another token (module docstring).
    rewards_one, rewards_two = per_step(one, "rollout/reward/total/mean"), per_step(two, "rollout/reward/total/mean")
    same = next((i for i, (a, b) in enumerate(zip(rewards_one, rewards_two)) if a != b), STEPS)
    assert same >= 1, (rewards_one, rewards_two)
    np.testing.assert_allclose(
        per_step(two, "train/grad_norm")[:same], per_step(one, "train/grad_norm")[:same], rtol=1e-5
    )
    # GRPO's loss is a sum of terms of size |advantage| ~ 0.7 that nearly cancel (advantages have mean 0): its
    # rounding error is absolute, ~1e-7 per term summed over a few hundred tokens, so 1e-6 absolute.
    np.testing.assert_allclose(
        per_step(two, "train/loss")[:same], per_step(one, "train/loss")[:same], rtol=0, atol=1e-6
    )
    # The update of step 1 itself: the params both trainers checkpointed after it. Adam's first step moves each
    # weight by lr * g / (|g| + eps) with eps = 1e-4: a rounding difference d in g (at most ~1e-9 here) moves it by
    # at most lr * d / eps ~ 1e-5 lr, while a real difference (a row trained twice, a shard missed) moves weights by
    # up to lr. 1e-3 lr sits between the two.
    params_one, params_two = step_params(one, 1), step_params(two, 1)
    for a, b in zip(jax.tree.leaves(params_two), jax.tree.leaves(params_one), strict=True):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-3 * LR)
    with open(os.path.join(two, "run.log")) as f:
        log = f.read()
    assert "trainer: 2 processes joining one JAX job" in log
    assert "trainer: mesh {'data': 2, 'fsdp': 4, 'tensor': 1} over 8 devices in 2 process(es), 4 in each" in log
    # Process 0 evaluated on the gathered params: the same held-out figures as the one-process trainer.
    evaluated = lambda run_dir: [r for r in read_metrics(str(run_dir)) if "eval/num_prompts" in r]  # noqa: E731
    assert [r["step"] for r in evaluated(two)] == [r["step"] for r in evaluated(one)] == [0, 2]
    assert (two / "eval_results_step2.json").is_file()
