"""What every run of the real RL loop must log, checked on a finished run's folder: shared by the tests that run
the loop (`rl_loop.run` or `feynrl-jax train`), so that a run made for another check also checks this one instead
of the suite paying for a run of its own. Not a test module: pytest imports it from the tests folder.
"""

from __future__ import annotations

import json
import os

import numpy as np

from feynrl_jax.losses import ALGORITHMS
from feynrl_jax.tracking import read_metrics

FINITE_EVERY_STEP = (
    "train/loss",
    "train/grad_norm",
    "rollout/reward/total/mean",
    "rollout/response_length_mean",
    "rollout/logprob_mismatch_max_abs",
    "perf/rollout_seconds",
    "perf/train_seconds",
    "train/entropy",
    "loss/ratio_mean",
)


def assert_loop_records(run_dir: str, algo: str) -> list[dict]:
    """Checks the training records of the finished RL run in `run_dir` against its `config.json`; returns them.

    Every step logs finite losses, rewards, lengths and timings and ran `ppo_epochs x mini_batches` updates; the
    last reaches policy version `train.steps`. Step 1 (no lag in either mode) has behaviour and trainer
    log-probabilities equal to 1e-3, since the engine shares the trainer's model code. Step t trains on the batch
    of version max(0, t - 1 - k) (k = `train.max_staleness`): lag min(k, t - 1), all of its tokens. Unless
    `algo.off_policy` is set, an async run uses the decoupled objective with truncated importance weights (their
    effective sample sizes in (0, 1] where the lag is positive) and a sync run no correction. A critic's value and
    gradient norm and the reference KL are logged where the algorithm has them.
    """
    with open(os.path.join(run_dir, "config.json")) as f:
        config = json.load(f)
    assert config["algo"]["name"] == algo
    train = config["train"]
    k = train["max_staleness"]
    records = [r for r in read_metrics(run_dir) if r["step"] > 0]  # step 0: an evaluation before training
    assert [r["step"] for r in records] == list(range(1, train["steps"] + 1))
    for record in records:
        for key in FINITE_EVERY_STEP:
            assert np.isfinite(record[key]), (algo, record["step"], key, record.get(key))
        assert record["train/updates"] == train["ppo_epochs"] * train["mini_batches"]
    last = records[-1]
    assert last["train/policy_version"] == train["steps"]
    assert records[0]["rollout/logprob_mismatch_max_abs"] < 1e-3
    lags = [min(k, r["step"] - 1) for r in records]
    assert [r["rollout/version_lag_max"] for r in records] == lags
    assert [r[f"rollout/version_lag_frac_{k}"] for r in records] == [float(lag == k) for lag in lags]
    if config["algo"]["off_policy"] is None:
        assert all(("loss/is_weight_mean" in r) == (k > 0) for r in records)
    for record, lag in zip(records, lags, strict=True):
        if lag:
            assert 0 < record["loss/is_ess"] <= 1 and 0 < record["rollout/behavior_ess"] <= 1, record["step"]
    if ALGORITHMS[algo].needs_critic:
        assert np.isfinite(last["loss/critic_value"]) and "train/critic_grad_norm" in last
    if config["algo"]["kl_coef"]:
        assert "train/kl_ref" in last
    return records
