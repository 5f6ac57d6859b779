"""Async RL on Ray with a tiny random model: results that do not depend on timing, and every new key honoured.

- Two async runs whose rollout workers are slowed down differently train bitwise the same (the schedule is a
  function of version numbers, not of timing).
- `train.cpu_cores` / `rollout.cpu_cores` pin the trainer and the rollout workers.
- `train.max_staleness`, `algo.off_policy`, `algo.tis_cap` on the command line reach the loop.
- `algo.hparams.value_clip` / `vf_coef` overrides reach PPO's critic; `algo.off_policy` reaches the loss.
"""

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import resume_harness as harness

from feynrl_jax.tracking import read_metrics

ROOT = os.path.join(os.path.dirname(__file__), "..")
sys.path.insert(0, os.path.join(ROOT, "configs"))
import tiny_rl  # noqa: E402


def async_config(run_dir: str, staleness: int = 2, algo: str = "grpo"):
    config = tiny_rl.get_config(algo)
    config.run_dir = run_dir
    config.eval.during_training = False
    config.train.steps = 4
    config.train.max_staleness = staleness
    config.checkpoint.every_steps = 0
    return config


def slow_every_third_seed(seed: int) -> float:
    return 0.6 if seed % 3 == 0 else 0.2


@pytest.mark.slow
@pytest.mark.ray
def test_async_runs_with_different_worker_delays_train_identically(ray_session, tmp_path):
    from feynrl_jax.orchestration import rl_loop

    fast = async_config(str(tmp_path / "fast"))
    slow = async_config(str(tmp_path / "slow"))
    rl_loop.run(fast)
    rl_loop.run(slow, rollout_delay=slow_every_third_seed)
    want, got = read_metrics(fast.run_dir), read_metrics(slow.run_dir)
    assert [r["step"] for r in got] == [1, 2, 3, 4]
    for key in (
        "train/loss",
        "train/grad_norm",
        "train/entropy",
        "rollout/reward/total/mean",
        "rollout/logprob_mismatch_kl",
        "loss/is_weight_mean",
        "loss/ratio_mean",
        "rollout/version_lag_mean",
        "rollout/policy_version",
    ):
        assert [r[key] for r in got] == [r[key] for r in want], key
    assert [r["rollout/version_lag_max"] for r in want] == [0, 1, 2, 2]
    # The delays were real: every generation of the slowed run took at least its shortest delay.
    assert all(r["perf/rollout_seconds"] >= 0.2 for r in got), [r["perf/rollout_seconds"] for r in got]
    harness.assert_same_final_state(fast.run_dir, slow.run_dir, total_steps=4)


@pytest.mark.slow
@pytest.mark.ray
def test_trainer_and_rollout_workers_are_pinned_to_their_cores(ray_session, tmp_path):
    import ray

    from feynrl_jax.orchestration.rl_loop import _Run

    if (os.cpu_count() or 1) < 2:
        pytest.skip("needs two CPU cores")
    config = async_config(str(tmp_path / "pinned"))
    config.train.cpu_cores = (0,)
    config.rollout.cpu_cores = (1,)
    config.rollout.num_workers = 2
    run = _Run(config)
    try:
        run.start_actors()
        assert ray.get(run.trainers[0].cpu_cores.remote()) == [0]
        assert [ray.get(w.status.remote())["cpu_cores"] for w in run.workers] == [[1], [1]]
    finally:
        run.close()


def test_the_command_line_sets_the_async_keys(tmp_path):
    """`feynrl-jax train` hands the RL loop the async keys given on the command line."""
    (tmp_path / "recording_loop.py").write_text(
        "import json, os\n"
        "def run(config):\n"
        "    with open(os.environ['RECORD'], 'w') as f:\n"
        "        json.dump({'k': config.train.max_staleness, 'off_policy': config.algo.off_policy,\n"
        "                   'cap': config.algo.tis_cap, 'train_cores': list(config.train.cpu_cores),\n"
        "                   'rollout_cores': list(config.rollout.cpu_cores)}, f)\n"
    )
    record = tmp_path / "record.json"
    code = textwrap.dedent(
        f"""
        import sys
        sys.path.insert(0, {str(tmp_path)!r})
        from feynrl_jax.cli import main
        main.LOOPS["rl"] = main.Entry("recording_loop", "run")
        sys.argv = ["feynrl-jax", "train", "--config=configs/tiny_rl.py", "--config.train.max_staleness=2",
                    "--config.algo.off_policy=tis", "--config.algo.tis_cap=3.5",
                    "--config.train.cpu_cores=(0,)", "--config.rollout.cpu_cores=(1,)"]
        main.run()
        """
    )
    env = dict(os.environ, RECORD=str(record))
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, env=env, timeout=60)
    assert result.returncode == 0, result.stderr
    assert json.loads(record.read_text()) == {
        "k": 2,
        "off_policy": "tis",
        "cap": 3.5,
        "train_cores": [0],
        "rollout_cores": [1],
    }


@pytest.mark.parametrize(
    "staleness, mode, cap, want",
    [
        (0, None, 2.0, {"decoupled": False, "tis_cap": None}),
        (1, None, 2.0, {"decoupled": True, "tis_cap": 2.0}),
        (1, "none", 2.0, {"decoupled": False, "tis_cap": None}),
        (0, "tis", 3.0, {"decoupled": False, "tis_cap": 3.0}),
        (2, "decoupled", 0.0, {"decoupled": True, "tis_cap": None}),
    ],
)
def test_off_policy_keys_reach_the_loss(staleness, mode, cap, want):
    from feynrl_jax.train.rl_trainer import rl_settings

    for algo in ("grpo", "ppo", "cispo", "p3o", "gspo"):
        config = tiny_rl.get_config(algo)
        config.train.max_staleness = staleness
        config.algo.off_policy = mode
        config.algo.tis_cap = cap
        settings = rl_settings(config)
        got = {key: settings.loss_hyperparameters[key] for key in want}
        assert got == want, (algo, got)


def _critic_step(tmp_path, name: str, *, epochs: int = 1, **hparams):
    """One trainer step of PPO on fixed rollouts with `algo.hparams` overrides; returns its metrics."""
    from feynrl_jax.config.base import set_algorithm_hparams
    from feynrl_jax.rollout.types import Rollouts
    from feynrl_jax.train.rl_trainer import RLTrainer

    config = tiny_rl.get_config("ppo")
    config.run_dir = str(tmp_path / name)
    config.checkpoint.every_steps = 0
    config.train.mini_batches = 1
    config.train.ppo_epochs = epochs
    config.algo.critic_lr = 3e-2  # the critic moves far within one step: its second epoch's update clips
    set_algorithm_hparams(config, **hparams)
    trainer = RLTrainer(config)
    trainer.start()
    rng = np.random.default_rng(3)
    n, width = config.train.global_batch_size, config.rollout.max_new_tokens
    group = config.rollout.n_samples
    prompts = rng.integers(1, 100, (n // group, 8))  # the samples of a group share their prompt (`Rollouts`)
    rollouts = Rollouts(
        prompt_ids=np.repeat(prompts, group, axis=0).astype(np.int32),
        prompt_lengths=np.full((n,), 8, np.int32),
        completion_ids=rng.integers(1, 100, (n, width)).astype(np.int32),
        completion_mask=np.ones((n, width), np.float32),
        behavior_logprobs=np.full((n, width), -4.0, np.float32),
        finish_reason=np.zeros((n,), np.int32),
        group_id=np.arange(n, dtype=np.int32) // group,
        policy_version=np.zeros((n,), np.int32),
    )
    rewards = rng.integers(0, 2, n).astype(np.float32) * 5.0
    metrics = trainer.train(rollouts, rewards, step=1, shuffle_seed=0)
    trainer.close()
    return trainer.settings, metrics


@pytest.mark.slow
def test_value_clip_and_vf_coef_overrides_reach_the_critic(tmp_path):
    # Three trainers (each build traces and compiles PPO's steps): "base" and "scaled" take one epoch without
    # clipping, "clipped" two epochs with a tight clip.
    base_settings, base = _critic_step(tmp_path, "base", vf_coef=1.0, value_clip=None)
    scaled_settings, scaled = _critic_step(tmp_path, "scaled", vf_coef=0.25, value_clip=None)
    clipped_settings, clipped = _critic_step(tmp_path, "clipped", epochs=2, vf_coef=1.0, value_clip=0.05)
    assert (base_settings.vf_coef, scaled_settings.vf_coef) == (1.0, 0.25)
    assert (clipped_settings.value_clip, base_settings.value_clip) == (0.05, None)
    # The actor's loss never carries the value term (the critic is its own model).
    assert base_settings.loss_hyperparameters["vf_coef"] == 0.0
    # vf_coef scales the critic's loss on the same first update (same params, same batch).
    np.testing.assert_allclose(scaled["train/critic_loss"], 0.25 * base["train/critic_loss"], rtol=1e-5)
    np.testing.assert_allclose(scaled["loss/critic_value"], base["loss/critic_value"], rtol=1e-5)
    # value_clip=None: no clipping metric; 0.05: the second epoch's update clips (the first starts at the
    # rollout-time values, where nothing is clipped).
    assert "loss/critic_value_clip_frac" in clipped and "loss/critic_value_clip_frac" not in base
    assert clipped["loss/critic_value_clip_frac"] > 0
