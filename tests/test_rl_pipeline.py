"""The rollout pipeline of sync and async RL (`feynrl_jax.orchestration.pipeline`), without Ray or a model.

A fake `collect` stands in for generation and scoring: it stamps every row with the version of the snapshot it
was handed and sleeps a random time. Whatever the delays, the pipeline must hand step t the batch of version
`max(0, t - 1 - k)` with the same seeds, never let a trained token be more than k versions old, and resume
from `checkpoint_state` exactly.
"""

import time

import jax
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from feynrl_jax.orchestration.pipeline import (
    RolloutPipeline,
    Scored,
    behavior_version,
    decode_batch,
    encode_batch,
    restore_state,
    staleness_metrics,
)
from feynrl_jax.rollout.types import Rollouts

ROWS, WIDTH = 4, 3


class FakeRun:
    """`collect` and a prompt iterator whose state counts the prompts drawn."""

    def __init__(self, delays=None):
        self.drawn = 0
        self.delays = delays or (lambda seed: 0.0)
        self.calls = []
        self.spans = []  # (start, end) of every collect, perf_counter seconds

    def collect(self, seed, snapshot):
        start = time.perf_counter()
        time.sleep(self.delays(seed))
        self.spans.append((start, time.perf_counter()))
        self.drawn += 1
        self.calls.append((seed, snapshot))
        rng = np.random.default_rng(seed)
        rollouts = Rollouts(
            prompt_ids=np.full((ROWS, 2), self.drawn, np.int32),
            prompt_lengths=np.full((ROWS,), 2, np.int32),
            completion_ids=rng.integers(0, 100, (ROWS, WIDTH)).astype(np.int32),
            completion_mask=np.ones((ROWS, WIDTH), np.float32),
            behavior_logprobs=rng.normal(size=(ROWS, WIDTH)).astype(np.float32),
            finish_reason=np.zeros((ROWS,), np.int32),
            group_id=np.arange(ROWS, dtype=np.int32) // 2,
            policy_version=np.full((ROWS,), snapshot, np.int32),
        )
        scored = Scored(rollouts, rng.random(ROWS).astype(np.float32), {"r": rng.random(ROWS)}, {"m": 1.0})
        return scored, {"perf/rollout_seconds": 0.0}

    def state(self):
        return {"drawn": self.drawn}


def run_schedule(
    k,
    steps,
    *,
    delays=None,
    train_delay=0.0,
    first_step=1,
    version=0,
    rng=None,
    restored=(),
    prompts_state=None,
    run=None,
    train_spans=None,
):
    """Drives the pipeline like `rl_loop`: take, 'train' (bump the version), publish. Returns per-step records;
    `train_spans` (a list) receives the (start, end) of every 'training'."""
    assert run is None or delays is None, "delays belong to the FakeRun passed in"
    run = FakeRun(delays) if run is None else run
    if prompts_state is not None:
        run.drawn = prompts_state["drawn"]
    pipeline = RolloutPipeline(
        run.collect,
        run.state,
        first_step=first_step,
        last_step=steps,
        max_staleness=k,
        rng=jax.random.key(7) if rng is None else rng,
        restored=list(restored),
    )
    pipeline.publish(version, version)
    records = []
    try:
        for step in range(first_step, steps + 1):
            batch, _ = pipeline.take(step)
            lag = staleness_metrics(
                batch.scored.rollouts.policy_version, batch.scored.rollouts.completion_mask, version, k
            )
            records.append((step, version, batch, lag))
            start = time.perf_counter()
            time.sleep(train_delay)
            if train_spans is not None:
                train_spans.append((start, time.perf_counter()))
            version += 1
            pipeline.publish(version, version)
        return records, pipeline
    finally:
        pipeline.close()


def test_behavior_version_is_the_schedule():
    assert [behavior_version(t, 0) for t in range(1, 5)] == [0, 1, 2, 3]
    assert [behavior_version(t, 1) for t in range(1, 5)] == [0, 0, 1, 2]
    assert [behavior_version(t, 2) for t in range(1, 6)] == [0, 0, 0, 1, 2]


@settings(max_examples=12, deadline=None)
@given(
    k=st.integers(0, 3),
    steps=st.integers(1, 7),
    delay_seed=st.integers(0, 2**16),
    train_delay=st.sampled_from([0.0, 0.002]),
)
def test_no_trained_token_is_older_than_k_versions(k, steps, delay_seed, train_delay):
    jitter = np.random.default_rng(delay_seed)
    records, _ = run_schedule(k, steps, delays=lambda seed: float(jitter.uniform(0, 0.004)), train_delay=train_delay)
    for step, trainer_version, batch, lag in records:
        generated = batch.scored.rollouts.policy_version
        assert np.all(trainer_version - generated <= k)
        # Exactly the schedule's version, not merely a fresh enough one.
        assert np.all(generated == behavior_version(step, k))
        assert lag["rollout/version_lag_max"] == min(k, step - 1)
        assert lag[f"rollout/version_lag_frac_{min(k, step - 1)}"] == 1.0


@pytest.mark.parametrize("k", [0, 1, 3])
def test_batches_do_not_depend_on_worker_or_trainer_speed(k):
    fast, _ = run_schedule(k, 6)
    slow_workers, _ = run_schedule(k, 6, delays=lambda seed: 0.01 * (seed % 3))
    slow_trainer, _ = run_schedule(k, 6, train_delay=0.01)
    for a, b, c in zip(fast, slow_workers, slow_trainer, strict=True):
        for other in (b, c):
            assert a[2].shuffle_seed == other[2].shuffle_seed
            np.testing.assert_array_equal(a[2].scored.rollouts.completion_ids, other[2].scored.rollouts.completion_ids)
            np.testing.assert_array_equal(a[2].scored.rollouts.policy_version, other[2].scored.rollouts.policy_version)


@pytest.mark.serial  # times its schedules
def test_async_generation_overlaps_training():
    """With k = 1 the batch of step t + 1 is generated while step t trains, so the run takes about max, not sum, of
    the two; with k = 0 generation never overlaps training. Delays of 0.15 s leave the check a margin of tenths of a
    second against a loaded machine's scheduling."""
    steps, gen, train = 6, 0.15, 0.15
    seconds, overlapping = {}, {}
    for k in (0, 1):
        run, trained = FakeRun(lambda seed: gen), []
        t0 = time.perf_counter()
        run_schedule(k, steps, run=run, train_delay=train, train_spans=trained)
        seconds[k] = time.perf_counter() - t0
        overlapping[k] = sum(any(a < d and c < b for c, d in trained) for a, b in run.spans)
    assert overlapping[0] == 0, overlapping
    # Batches 2..steps are each generated while the step before them trains (their versions are published by then);
    # one miss is tolerated (a thread stalled for the whole 0.15 s).
    assert overlapping[1] >= steps - 2, overlapping
    # Sync is about steps x (gen + train) = 1.8 s; async about (steps + 1) x max(gen, train) = 1.05 s.
    assert seconds[1] < 0.85 * seconds[0], seconds


@pytest.mark.parametrize("k", [0, 1, 2])
@pytest.mark.parametrize("stop_after", [1, 3])
def test_resume_from_checkpoint_state_continues_exactly(k, stop_after):
    steps = 6
    straight, _ = run_schedule(k, steps)

    # Interrupted: run to `stop_after`, take the checkpoint's state, rebuild a pipeline from it alone.
    run = FakeRun()
    pipeline = RolloutPipeline(
        run.collect, run.state, first_step=1, last_step=steps, max_staleness=k, rng=jax.random.key(7)
    )
    pipeline.publish(0, 0)
    for step in range(1, stop_after + 1):
        pipeline.take(step)
        pipeline.publish(step, step)
    rng, data_state = pipeline.checkpoint_state(stop_after)
    pipeline.close()
    prompts_state, in_flight = restore_state(data_state)
    assert [b.step for b in in_flight] == list(range(stop_after + 1, min(stop_after + k, steps) + 1))
    resumed, _ = run_schedule(
        k,
        steps,
        first_step=stop_after + 1,
        version=stop_after,
        rng=jax.random.wrap_key_data(jax.numpy.asarray(rng, jax.numpy.uint32)),
        restored=in_flight,
        prompts_state=prompts_state,
    )
    assert prompts_state == {"drawn": min(stop_after + k, steps)}
    for a, b in zip(straight[stop_after:], resumed, strict=True):
        assert a[0] == b[0] and a[2].shuffle_seed == b[2].shuffle_seed
        for name in ("completion_ids", "behavior_logprobs", "policy_version", "prompt_ids"):
            np.testing.assert_array_equal(getattr(a[2].scored.rollouts, name), getattr(b[2].scored.rollouts, name))
        np.testing.assert_array_equal(a[2].scored.rewards, b[2].scored.rewards)


def test_encoded_batch_round_trips_bit_exactly():
    records, _ = run_schedule(1, 2)
    batch = records[1][2]
    back = decode_batch(encode_batch(batch))
    assert back.step == batch.step and back.shuffle_seed == batch.shuffle_seed
    for name in ("completion_ids", "behavior_logprobs", "completion_mask", "policy_version", "group_id"):
        a, b = getattr(batch.scored.rollouts, name), getattr(back.scored.rollouts, name)
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(back.scored.per_reward["r"], batch.scored.per_reward["r"])
    np.testing.assert_array_equal(back.rng_after, batch.rng_after)


def test_a_producer_error_reaches_the_trainer():
    def collect(seed, snapshot):
        raise RuntimeError("reward actor died")

    pipeline = RolloutPipeline(collect, dict, first_step=1, last_step=3, max_staleness=1, rng=jax.random.key(0))
    pipeline.publish(0, 0)
    with pytest.raises(RuntimeError, match="reward actor died"):
        pipeline.take(1)
    pipeline.close()


def test_close_releases_a_waiting_producer():
    pipeline = RolloutPipeline(
        lambda seed, snapshot: None, dict, first_step=1, last_step=3, max_staleness=0, rng=jax.random.key(0)
    )
    # Nothing published: the producer waits for version 0 until the pipeline closes.
    time.sleep(0.05)
    assert pipeline._thread.is_alive()
    pipeline.close()
    pipeline._thread.join(timeout=5)
    assert not pipeline._thread.is_alive()


def test_restored_batches_must_be_the_next_steps():
    records, _ = run_schedule(2, 4)
    with pytest.raises(ValueError, match="steps"):
        RolloutPipeline(
            lambda seed, snapshot: None,
            dict,
            first_step=1,
            last_step=4,
            max_staleness=2,
            rng=jax.random.key(0),
            restored=[records[2][2]],
        )
