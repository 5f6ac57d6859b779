"""The rollout pipeline of an RL run: every step's scored batch, produced ahead by a background thread.

Sync and async RL share one loop (`rl_loop`); they differ only in `train.max_staleness = k`, which fixes the
policy version that generates each step's batch:

    behavior_version(t) = max(0, t - 1 - k)      (steps are 1-based; version v = the params after v updates)

With k = 0 (sync) the batch of step t comes from the params that step t then trains (fully on-policy). With
k >= 1 the batch of step t is generated while the trainer trains steps t - k .. t - 1: the rollout workers and
the trainer overlap, and a trained token is never more than k versions older than the params it updates. The
schedule is a function of version numbers, never of timing, so a run samples the same rollouts on any machine
and resumes exactly (Fu et al. 2025, "AReaL: A Large-Scale Asynchronous Reinforcement Learning System for
Language Reasoning", arXiv:2505.24298, bounds staleness the same way).

How it runs: the driver's main thread trains step t, then hands the pipeline the published version's snapshot
(`publish`); the producer thread generates batch t' as soon as its version `behavior_version(t')` has been
published, draws its prompts and seeds in step order (so the prompt stream and the PRNG are consumed in one
deterministic order) and queues it; the main thread `take`s batch t when step t starts. Rollout workers never
wait for a publish beyond the schedule's own dependency, and the trainer never waits for a reader: the
snapshot handed to the workers is a set of Ray object references that stay alive for as long as the pipeline or
a worker holds them, while the trainer writes the next version into the store's back buffer.

Exact resume: a checkpoint at step t must hold what is in flight, the batches of steps t+1..t+k (they were
generated from versions older than t, which the checkpoint no longer has). `checkpoint_state(t)` waits for them
and returns them with the prompt-iterator state and the PRNG key after the last of them; `RolloutPipeline(...,
restored=...)` starts from there.
"""

from __future__ import annotations

import base64
import dataclasses
import io
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from feynrl_jax.rollout.types import Rollouts

log = logging.getLogger(__name__)

PIPELINE_STATE_FORMAT = 1
"""Version of the checkpointed pipeline state (`checkpoint_state` / `restore_state`)."""


def behavior_version(step: int, max_staleness: int) -> int:
    """The policy version whose params generate the batch of RL step `step` (1-based) under staleness `k`."""
    return max(0, step - 1 - max_staleness)


@dataclasses.dataclass
class Scored:
    """Rollouts of some prompts with their rewards (`[N]` rows, groups of `n` consecutive rows)."""

    rollouts: Rollouts
    rewards: np.ndarray
    per_reward: dict[str, np.ndarray]
    reward_metrics: dict[str, float]


@dataclasses.dataclass
class StepBatch:
    """The scored batch of one RL step and what the driver's state was right after producing it.

    Attributes:
        step: the RL step that trains on it.
        scored: the rollouts and rewards.
        shuffle_seed: seeds the step's mini-batch shuffling.
        metrics: `rollout/` and `perf/` metrics of its collection.
        rng_after: the driver's PRNG key data (`uint32`) after this step's seeds were drawn.
        prompts_after: the prompt iterator's state after this step's prompts (refills included) were drawn.
    """

    step: int
    scored: Scored
    shuffle_seed: int
    metrics: dict[str, float]
    rng_after: np.ndarray
    prompts_after: Any


Collect = Callable[[int, Any], tuple[Scored, dict[str, float]]]
"""`(sample_seed, params_snapshot) -> (scored batch, metrics)`: generate, score and refill one step's batch."""


def step_seeds(key: jax.Array) -> tuple[int, int]:
    """`(sample_seed, shuffle_seed)` of one step, from its PRNG key."""
    bits = np.asarray(jax.random.bits(key, (2,), jnp.uint32))
    return int(bits[0]), int(bits[1])


class PipelineStopped(RuntimeError):
    """The pipeline was closed while a caller waited on it."""


class RolloutPipeline:
    """Produces `StepBatch`es for steps `first_step..last_step` in a background thread (see the module doc).

    Args:
        collect: generates, scores and refills one step's batch (runs in the producer thread).
        prompts_state: returns the prompt iterator's state (called in the producer thread, after `collect`).
        first_step: the first step to train (1 on a fresh run, `restored step + 1` on a resumed one).
        last_step: `train.steps`.
        max_staleness: `train.max_staleness`.
        rng: the driver's PRNG key after the batches already produced (`restored` included).
        restored: batches of steps `first_step..` that a checkpoint held in flight, in step order.
    """

    def __init__(
        self,
        collect: Collect,
        prompts_state: Callable[[], Any],
        *,
        first_step: int,
        last_step: int,
        max_staleness: int,
        rng: jax.Array,
        restored: list[StepBatch] = (),
    ):
        self._collect = collect
        self._prompts_state = prompts_state
        self._k = max_staleness
        self._last_step = last_step
        self._rng = rng
        self._cond = threading.Condition()
        self._batches: dict[int, StepBatch] = {b.step: b for b in restored}
        self._snapshots: dict[int, Any] = {}
        self._error: BaseException | None = None
        self._stopped = False
        self._newest_taken: StepBatch | None = None
        self._next_step = first_step + len(restored)
        expected = list(range(first_step, first_step + len(restored)))
        if [b.step for b in restored] != expected:
            raise ValueError(f"restored in-flight batches are for steps {[b.step for b in restored]}, not {expected}")
        self._thread = threading.Thread(target=self._produce, name="rollout-pipeline", daemon=True)
        self._thread.start()

    # Main thread ---------------------------------------------------------------------------------------------

    def publish(self, version: int, snapshot: Any) -> None:
        """Makes `version`'s params (a store snapshot) available to the producer."""
        with self._cond:
            self._snapshots[version] = snapshot
            self._cond.notify_all()

    def take(self, step: int) -> tuple[StepBatch, float]:
        """Blocks until the batch of `step` is ready; returns it and the seconds waited.

        Raises:
            Whatever the producer raised (a failed generation or reward), or `PipelineStopped`.
        """
        t0 = time.perf_counter()
        batch = self._wait_for(step)
        with self._cond:
            self._batches.pop(step)
            self._newest_taken = batch
        return batch, time.perf_counter() - t0

    def checkpoint_state(self, step: int) -> tuple[np.ndarray, dict[str, Any]]:
        """What a checkpoint at `step` (just trained) needs to resume the pipeline exactly.

        Waits for the batches of steps `step + 1 .. min(step + k, last_step)` (all already scheduled).

        Returns:
            `(rng, data_state)`: the PRNG key data (`uint32`) after the last of those batches, and a
            JSON-serialisable dict with the format, those in-flight batches (encoded) and the prompt-iterator
            state after them.
        """
        in_flight = [self._wait_for(s) for s in range(step + 1, min(step + self._k, self._last_step) + 1)]
        last = in_flight[-1] if in_flight else self._newest_taken
        if last is None or (not in_flight and last.step != step):
            raise RuntimeError(f"checkpoint_state({step}): the batch of step {step} was never taken")
        state = {
            "format": PIPELINE_STATE_FORMAT,
            "prompts": last.prompts_after,
            "in_flight": [encode_batch(b) for b in in_flight],
        }
        return np.asarray(last.rng_after, np.uint32), state

    def close(self) -> None:
        """Stops the producer after its current batch (a generation in flight ends with the actors)."""
        with self._cond:
            self._stopped = True
            self._cond.notify_all()

    # Producer thread -----------------------------------------------------------------------------------------

    def _wait_for(self, step: int) -> StepBatch:
        with self._cond:
            while step not in self._batches:
                if self._error is not None:
                    raise self._error
                if self._stopped or not self._thread.is_alive():
                    raise PipelineStopped(f"the rollout pipeline stopped before producing step {step}")
                self._cond.wait(timeout=1.0)
            return self._batches[step]

    def _snapshot_for(self, version: int) -> Any | None:
        """The snapshot of `version` once published (None when stopped); drops the versions before it.

        A resumed run whose checkpoint held fewer in-flight batches than the schedule needs (a run continued
        past its original `train.steps`) no longer has the old versions: it takes the oldest one it has.
        """
        with self._cond:
            while not self._stopped and (not self._snapshots or max(self._snapshots) < version):
                self._cond.wait()
            if self._stopped:
                return None
            chosen = version if version in self._snapshots else min(self._snapshots)
            if chosen != version:
                log.warning("rollout pipeline: version %d is not held any more; generating with %d", version, chosen)
            for old in [v for v in self._snapshots if v < chosen]:
                del self._snapshots[old]
            return self._snapshots[chosen]

    def _produce(self) -> None:
        try:
            for step in range(self._next_step, self._last_step + 1):
                t0 = time.perf_counter()
                snapshot = self._snapshot_for(behavior_version(step, self._k))
                if snapshot is None:
                    return
                waited = time.perf_counter() - t0
                self._rng, key = jax.random.split(self._rng)
                sample_seed, shuffle_seed = step_seeds(key)
                scored, metrics = self._collect(sample_seed, snapshot)
                metrics["perf/rollout_wait_params_seconds"] = waited
                batch = StepBatch(
                    step=step,
                    scored=scored,
                    shuffle_seed=shuffle_seed,
                    metrics=metrics,
                    rng_after=np.asarray(jax.random.key_data(self._rng), np.uint32),
                    prompts_after=self._prompts_state(),
                )
                with self._cond:
                    self._batches[step] = batch
                    self._cond.notify_all()
        except BaseException as error:  # handed to the main thread, which raises it
            with self._cond:
                self._error = error
                self._cond.notify_all()


def staleness_metrics(
    policy_version: np.ndarray, completion_mask: np.ndarray, trainer_version: int, max_staleness: int
):
    """How old a step's batch is: `rollout/version_lag_*`.

    Args:
        policy_version: `[N]` version that generated each row.
        completion_mask: `[N, C]` the rows' completion tokens.
        trainer_version: the version of the params the step trains (its updates start from them).
        max_staleness: `train.max_staleness` (the fractions are reported for lags 0..k).

    Returns:
        `rollout/version_lag_mean` and `_max` (over rows), and `rollout/version_lag_frac_<j>`: the fraction of
        completion tokens generated `j` versions behind the trainer, for j = 0..k.
    """
    lag = trainer_version - np.asarray(policy_version, np.int64)
    tokens = np.asarray(completion_mask, np.float64).sum(axis=1)
    total = max(float(tokens.sum()), 1.0)
    out = {
        "rollout/version_lag_mean": float(lag.mean()),
        "rollout/version_lag_max": float(lag.max()),
    }
    for j in range(max_staleness + 1):
        out[f"rollout/version_lag_frac_{j}"] = float(tokens[lag == j].sum() / total)
    return out


# Checkpoint encoding -----------------------------------------------------------------------------------------


def encode_batch(batch: StepBatch) -> dict[str, Any]:
    """A JSON-safe record of an in-flight batch: its arrays as one `.npz` (bytes), the rest as JSON values."""
    arrays = {f"rollouts/{f.name}": getattr(batch.scored.rollouts, f.name) for f in dataclasses.fields(Rollouts)}
    arrays["rewards"] = batch.scored.rewards
    arrays.update({f"per_reward/{k}": v for k, v in batch.scored.per_reward.items()})
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    return {
        "step": batch.step,
        "shuffle_seed": batch.shuffle_seed,
        "metrics": {k: float(v) for k, v in batch.metrics.items()},
        "reward_metrics": {k: float(v) for k, v in batch.scored.reward_metrics.items()},
        "rng_after": np.asarray(batch.rng_after, np.uint32).tolist(),
        "prompts_after": batch.prompts_after,
        "arrays_npz_b64": base64.b64encode(buffer.getvalue()).decode("ascii"),
    }


def decode_batch(record: dict[str, Any]) -> StepBatch:
    """Inverse of `encode_batch` (bit-exact arrays)."""
    with np.load(io.BytesIO(base64.b64decode(record["arrays_npz_b64"]))) as npz:
        arrays = {name: npz[name] for name in npz.files}
    rollouts = Rollouts(**{f.name: arrays[f"rollouts/{f.name}"] for f in dataclasses.fields(Rollouts)})
    per_reward = {name.split("/", 1)[1]: v for name, v in arrays.items() if name.startswith("per_reward/")}
    return StepBatch(
        step=int(record["step"]),
        scored=Scored(rollouts, arrays["rewards"], per_reward, dict(record["reward_metrics"])),
        shuffle_seed=int(record["shuffle_seed"]),
        metrics=dict(record["metrics"]),
        rng_after=np.asarray(record["rng_after"], np.uint32),
        prompts_after=record["prompts_after"],
    )


def restore_state(data_state: Any) -> tuple[Any, list[StepBatch]]:
    """`(prompt-iterator state, in-flight batches)` from a checkpoint's data state (`checkpoint_state`).

    Raises:
        ValueError: the data state is not a pipeline state of a supported format.
    """
    if not isinstance(data_state, dict) or data_state.get("format") != PIPELINE_STATE_FORMAT:
        raise ValueError(
            "the checkpoint's data state is not an RL pipeline state of format "
            f"{PIPELINE_STATE_FORMAT} (written by another version of feynrl-jax?)"
        )
    return data_state["prompts"], [decode_batch(record) for record in data_state["in_flight"]]
