"""The RL loop on Ray: `feynrl-jax train --config=configs/grpo_demo.py` (paradigm "rl"), sync or async.

Every step t:

1. the rollout pipeline (`pipeline.RolloutPipeline`, a driver thread) has produced step t's batch: it drew
   `train.global_batch_size / rollout.n_samples` prompts, had the rollout workers (`rollout.num_workers` Ray
   actors, prompts split between them) sample `rollout.n_samples` completions per prompt with the params of
   version `max(0, t - 1 - train.max_staleness)`, and had the reward actor score them (`rollout.rewards`);
   DAPO's dynamic sampling (`algo.dynamic_sampling`) dropped groups whose rewards are all equal and drew more
   prompts, at most `algo.max_refill_draws` times, to refill the batch;
2. the trainer actor computes old (proximal) and reference log-probabilities, advantages (the algorithm's
   estimator; GAE with the critic for PPO), runs `train.ppo_epochs x train.mini_batches` updates and publishes
   version t to the double-buffered parameter store;
3. metrics (`rollout/`, `train/`, `loss/`, `perf/`, `eval/`) go to the tracker; a checkpoint is written when due.

Sync (`train.max_staleness = 0`): step t's batch is sampled by the params step t trains, so generation and
training alternate. Async (k >= 1): batches of later steps are generated while the trainer trains; a batch is
at most k versions old, and the loss's off-policy correction (`algo.off_policy`, "decoupled" with a truncated
weight by default) absorbs the gap. The schedule depends on version numbers only: whatever the machine's
speed, a run samples and trains the same, and `rollout/version_lag_*` reports each step's staleness.

Fault tolerance: rollout workers restart up to `ray.max_restarts` times; a generation lost to a dead worker is
retried (at most `rollout.max_retries` times) with the same seed and params, and counted in
`rollout/lost_batches`.

Exact resume: the checkpoint of step `s` holds the trainer's state, the policy version, the batches in flight
(steps s+1..s+k, generated from versions the checkpoint no longer has), and the prompt iterator and the
driver's PRNG key after them; the sampling seed of every step derives from that key, so a resumed run samples
and trains exactly like one that never stopped.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import ray
from ml_collections import ConfigDict

from feynrl_jax.config.derived import batch_plan, checkpoint_every, effective_off_policy
from feynrl_jax.config.validation import validate
from feynrl_jax.data.from_config import build_mixture_from_config
from feynrl_jax.errors import RunFailed
from feynrl_jax.eval.evaluate import load_eval_set
from feynrl_jax.losses.registry import get_algorithm
from feynrl_jax.orchestration.actors import (
    ParamsSnapshot,
    ParamStoreActor,
    RewardWorker,
    RolloutWorker,
    TrainerActor,
    latest_snapshot,
    worker_name,
)
from feynrl_jax.orchestration.engines import engine_spec
from feynrl_jax.orchestration.liveness import (
    WORKER_FAILURES,
    ActorStalled,
    get_alive,
    get_within,
    restart,
    wait_until_alive,
)
from feynrl_jax.orchestration.pipeline import RolloutPipeline, Scored, restore_state, staleness_metrics
from feynrl_jax.orchestration.placement import WorkerPlacement, check_gpus, trainer_options
from feynrl_jax.orchestration.runtime import ACTOR_CPUS, start_ray
from feynrl_jax.rollout.types import FINISH_LENGTH, Rollouts, SamplingParams
from feynrl_jax.tracking import Tracker
from feynrl_jax.train import run_setup
from feynrl_jax.train.rl_batch import concat_rollouts, constant_reward_groups, select_rows
from feynrl_jax.train.run_lock import RunLock

log = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = 900.0
"""Bound on constructing the actors (loading a model, starting the reward pool) before liveness pings apply."""


def rollout_sampling(config: ConfigDict, tokenizer: Any, seed: int) -> SamplingParams:
    """The training rollouts' `SamplingParams` (`config.rollout`), EOS as a stop token, with `seed`."""
    eos = tokenizer.eos_token_id
    stop_ids = tuple(eos) if isinstance(eos, list | tuple) else ((eos,) if eos is not None else ())
    rollout = config.rollout
    return SamplingParams(
        temperature=rollout.temperature if rollout.temperature > 0 else 1.0,
        greedy=rollout.temperature == 0,
        top_k=rollout.top_k,
        top_p=rollout.top_p,
        max_new_tokens=rollout.max_new_tokens,
        stop_token_ids=stop_ids,
        stop_strings=tuple(rollout.stop_strings),
        n=rollout.n_samples,
        seed=seed,
    )


def worker_chunks(num_prompts: int, num_workers: int) -> list[np.ndarray]:
    """The prompt indices each rollout worker generates for (the first chunks go to the first workers)."""
    return [c for c in np.array_split(np.arange(num_prompts), num_workers) if len(c)]


def chunk_sampling(sampling: SamplingParams, index: int) -> SamplingParams:
    """The sampling of a generation's chunk `index` (`worker_chunks`): its own seed, `sampling.seed + index`."""
    return dataclasses.replace(sampling, seed=(sampling.seed + index) % 2**32)


def generate(
    workers: list[Any],
    prompts: list[list[int]],
    sampling: SamplingParams,
    snapshot: ParamsSnapshot,
    *,
    max_retries: int,
    stall_timeout_s: float,
    delay_s: float = 0.0,
) -> tuple[Rollouts, dict[str, float]]:
    """Splits `prompts` between the workers, generates with `snapshot`'s params, retries chunks of lost workers.

    A worker is lost when its process dies or when it stops answering liveness pings for `stall_timeout_s`
    (then its process is killed so that Ray restarts it). Chunk `i` is sampled with seed `sampling.seed + i` and
    the same params on its first try and on any retry, so a retried chunk reproduces exactly what the lost
    worker would have returned.

    Returns:
        `(rollouts, stats)`: stats hold `lost` (chunks lost to dead workers), `generated_tokens`, the weight
        sync's `load_seconds`, `load_fetch_seconds` and `load_bytes` and each engine's own time `engine_seconds`
        (max over workers), and the native engine's `slot_utilisation` (mean) and `compile_seconds` (max over
        workers).

    Raises:
        RuntimeError: a chunk still failed after `max_retries` retries (names the worker).
    """
    chunks = worker_chunks(len(prompts), len(workers))
    results: dict[int, tuple[Rollouts, dict]] = {}
    pending = list(range(len(chunks)))
    lost = 0
    for attempt in range(max_retries + 1):
        refs = {
            i: workers[i].generate.remote(
                [prompts[j] for j in chunks[i]],
                chunk_sampling(sampling, i),
                snapshot,
                delay_s,
            )
            for i in pending
        }
        for i, ref in refs.items():
            name = f"rollout worker {i}"
            try:
                results[i] = get_alive(ref, workers[i], name=name, stall_timeout_s=stall_timeout_s)
            except ActorStalled as error:
                lost += 1
                log.warning("%s (attempt %d); restarting it", error, attempt + 1)
                restart(workers[i], name=name)
            except WORKER_FAILURES as error:
                lost += 1
                log.warning("%s died during generation (attempt %d): %s", name, attempt + 1, error)
        pending = [i for i in pending if i not in results]
        for i in pending:
            wait_until_alive(workers[i], name=f"rollout worker {i}")
        if not pending:
            break
    if pending:
        raise RunFailed(
            f"rollout worker(s) {pending} failed {max_retries + 1} times in one step; raise rollout.max_retries "
            "or ray.max_restarts, or look at the worker logs"
        )
    parts = [results[i][0] for i in range(len(chunks))]
    return concat_rollouts(parts), generation_stats([results[i][1] for i in range(len(chunks))], lost=lost)


def generation_stats(stats: list[dict], *, lost: int) -> dict[str, float]:
    """One generation's figures (`generate`'s) from each engine's `stats`, `lost` chunks retried."""
    out = {
        "lost": float(lost),
        "generated_tokens": float(sum(s["generated_tokens"] for s in stats)),
        # Workers load in parallel: a step's weight sync takes as long as the slowest worker's.
        **{key: float(max(s[key] for s in stats)) for key in ("load_seconds", "load_fetch_seconds", "load_bytes")},
    }
    # The slowest worker's: the native engine's JAX compiles, and each engine's own time (`EngineHost.generate`).
    for key in ("compile_seconds", "engine_seconds"):
        if all(key in s for s in stats):
            out[key] = float(max(s[key] for s in stats))
    if all("slot_utilisation" in s for s in stats):  # the native engine's; vLLM schedules its own batch
        out["slot_utilisation"] = float(np.mean([s["slot_utilisation"] for s in stats]))
    return out


def _repeat(values: list, n: int) -> list:
    return [v for v in values for _ in range(n)]


def rollout_metrics(scored: Scored, *, success_threshold: float, correctness_reward: str) -> dict[str, float]:
    """`rollout/` metrics of the trained batch: rewards, accuracy, lengths, truncation."""
    rollouts = scored.rollouts
    lengths = rollouts.completion_lengths.astype(np.float64)
    correct_on = scored.per_reward.get(correctness_reward, scored.rewards)
    return {
        **scored.reward_metrics,
        "rollout/accuracy": float(np.mean(correct_on >= success_threshold)),
        "rollout/response_length_mean": float(lengths.mean()),
        "rollout/response_length_max": float(lengths.max()),
        "rollout/response_length_min": float(lengths.min()),
        "rollout/truncated_frac": float(np.mean(rollouts.finish_reason == FINISH_LENGTH)),
        "rollout/policy_version": float(rollouts.policy_version.min()),
    }


def score(
    reward: Any,
    completions: list[str],
    texts: list[str],
    examples: list[dict],
    lengths: np.ndarray,
    *,
    max_retries: int,
    stall_timeout_s: float,
) -> tuple[np.ndarray, dict[str, np.ndarray], dict[str, float], int]:
    """Scores completions on the reward actor; a reward actor that dies or stalls is restarted and the call retried.

    Scoring is a pure function of its inputs, so a retried call returns what the lost one would have.

    Returns:
        `(rewards, per_reward, metrics, retries)`.

    Raises:
        RunFailed: the call still failed after `max_retries` retries.
    """
    for attempt in range(max_retries + 1):
        try:
            ref = reward.score.remote(texts, completions, examples, lengths)
            rewards, per_reward, metrics = get_alive(ref, reward, name="reward scorer", stall_timeout_s=stall_timeout_s)
            return np.asarray(rewards, np.float32), dict(per_reward), dict(metrics), attempt
        except ActorStalled as error:
            log.warning("%s (attempt %d); restarting it", error, attempt + 1)
            restart(reward, name="reward scorer")
        except WORKER_FAILURES as error:
            log.warning("reward scorer died while scoring (attempt %d): %s", attempt + 1, error)
        wait_until_alive(reward, name="reward scorer")
    raise RunFailed(
        f"the reward scorer failed {max_retries + 1} times in one step; raise rollout.max_retries or "
        "ray.max_restarts, or look at the reward actor's log"
    )


def _merge_scored(parts: list[Scored]) -> Scored:
    names = parts[0].per_reward.keys()
    return Scored(
        rollouts=concat_rollouts([p.rollouts for p in parts]),
        rewards=np.concatenate([p.rewards for p in parts]),
        per_reward={k: np.concatenate([p.per_reward[k] for p in parts]) for k in names},
        reward_metrics=parts[0].reward_metrics,
    )


def _select(scored: Scored, rows: np.ndarray) -> Scored:
    return Scored(
        select_rows(scored.rollouts, rows),
        scored.rewards[rows],
        {k: v[rows] for k, v in scored.per_reward.items()},
        scored.reward_metrics,
    )


class _Run:
    """The driver's side of one run: actors, prompt iterator, tracker (see `run`).

    Args:
        config: the validated RL config.
        rollout_delay: seconds every rollout worker sleeps before a generation, by sample seed (tests: a run's
            results must not depend on how fast the workers are); None for no delay.
    """

    def __init__(self, config: ConfigDict, rollout_delay: Callable[[int], float] | None = None):
        self.config = config
        self.plan = batch_plan(config)
        self.rollout_delay = rollout_delay
        # Model, tokenizer and data first: a bad file fails here, before Ray starts.
        self.source = run_setup.resolve_model_source(config.model, config.run_dir)  # converts a GGUF once, here
        self.tokenizer = run_setup.load_run_tokenizer(self.source)
        self.model_config = run_setup.model_config(config.model, self.source, self.tokenizer)
        self.prompts = build_mixture_from_config(
            config.data, self.tokenizer, paradigm="rl", batch_size=self.plan.prompts_per_step
        )
        # Draw one batch and put it back (the iterator's state is exact), and load the held-out prompts: a source
        # with no usable prompt (all longer than data.max_prompt_len, say) fails now, not after Ray started.
        start = self.prompts.get_state()
        # `rollout.warmup`: a fresh run's first batch stands for the prompt lengths (a resumed run's too).
        self.warmup_lengths = [len(ids) for ids in next(self.prompts).prompt_ids]
        self.prompts.set_state(start)
        if config.eval.during_training:
            load_eval_set(config, self.tokenizer)
        cache_len = config.data.max_seq_len
        if config.rollout.engine == "vllm" and config.eval.during_training:  # the workers evaluate too (`evaluate`)
            cache_len = max(cache_len, config.data.max_prompt_len + config.eval.max_new_tokens)
        self.engine_spec = engine_spec(config, self.model_config, self.tokenizer, cache_len=cache_len)
        self.placement = None
        self.evaluator = None
        self.lost_batches = 0
        self.reward_retries = 0
        self.store = self.reward = None
        self.trainers: list[Any] = []  # one actor per trainer process (`ray.trainer_processes`)
        self.trainer_calls = threading.Lock()  # every trainer process gets the calls in the same order
        self.workers: list[Any] = []
        self.warmups: list[Any] = []  # the workers' `warm_up` calls, until the first step reports them
        self.started_at: float | None = None  # `time.time()` when the trainer's `start` returned

    def start_actors(self) -> None:
        """Creates the parameter store, the trainer, the rollout workers and the reward scorer (Ray is up), and
        starts the workers' warm-up (`rollout.warmup`)."""
        config, model_config, source = self.config, self.model_config, self.source
        check_gpus(config)
        self.store = ParamStoreActor.options(num_cpus=ACTOR_CPUS["store"]).remote()
        self.trainers = start_trainers(config, self.store, self.engine_spec, self.model_config)
        restarts = dict(max_restarts=config.ray.max_restarts, max_task_retries=0)
        self.placement = WorkerPlacement(config)
        self.workers = (
            []
            if config.rollout.colocate
            else [
                RolloutWorker.options(
                    name=worker_name(config.run_dir, i), max_concurrency=2, **self.placement.options(i), **restarts
                ).remote(
                    model_config,
                    source.tokenizer_dir,
                    spec=self.engine_spec,
                    index=i,
                    cpu_cores=tuple(config.rollout.cpu_cores),
                )
                for i in range(config.rollout.num_workers)
            ]
        )
        if config.rollout.warmup and self.engine_spec.kind == "native":
            # Each worker compiles for its share of a batch (the first one's prompt lengths) while the trainer
            # starts; its first `generate` waits for that.
            sampling = rollout_sampling(config, self.tokenizer, config.seed)
            hosts = self.trainers[:1] if config.rollout.colocate else self.workers
            chunks = worker_chunks(len(self.warmup_lengths), len(hosts))
            self.warmups = [
                host.warm_up.remote([self.warmup_lengths[j] for j in chunk], sampling)
                for host, chunk in zip(hosts, chunks)
            ]
        self.reward = RewardWorker.options(num_cpus=ACTOR_CPUS["reward"], **restarts).remote(
            dict(config.rollout.rewards),
            reward_kwargs={name: dict(kwargs) for name, kwargs in config.rollout.reward_kwargs.items()},
            timeout_s=config.rollout.reward_timeout_s,
            num_workers=config.rollout.reward_workers,
            max_failure_frac=config.rollout.max_reward_failure_frac,
        )

    def named_actors(self) -> list[tuple[Any, str]]:
        """`(handle, name)` of every actor started so far."""
        named = [(self.store, "parameter store"), *self.named_trainers(), (self.reward, "reward scorer")]
        named += [(w, f"rollout worker {i}") for i, w in enumerate(self.workers)]
        return [(a, n) for a, n in named if a is not None]

    def wait_ready(self) -> None:
        """Waits until every actor is constructed; raises the first construction error (a bad checkpoint, ...).

        Liveness pings are answered only once an actor exists, so the stall clock starts after this.
        """
        refs = [(actor.ready.remote(), name) for actor, name in self.named_actors()]
        for ref, name in refs:
            get_within(ref, name=name, timeout_s=max(STARTUP_TIMEOUT_S, self.config.ray.stall_timeout_s))
        where = self.on_trainer("describe")
        log.info(
            "trainer: mesh %s over %d devices in %d process(es), %d in each",
            where["mesh"],
            where["devices"],
            where["processes"],
            where["local_devices"],
        )

    def _generate_scored(self, seed: int, snapshot: ParamsSnapshot) -> tuple[Scored, dict[str, float]]:
        batch = next(self.prompts)
        sampling = rollout_sampling(self.config, self.tokenizer, seed)
        t0 = time.perf_counter()
        delay_s = self.rollout_delay(seed) if self.rollout_delay else 0.0
        if self.config.rollout.colocate:  # the trainer's engine: its failure is the trainer's, which ends the run
            chunk = chunk_sampling(sampling, 0)  # sampled as a one-worker run's only chunk
            rollouts, stats = self.on_trainer("generate", batch.prompt_ids, chunk, snapshot, delay_s)
            stats = generation_stats([stats], lost=0)
        else:
            rollouts, stats = generate(
                self.workers,
                batch.prompt_ids,
                sampling,
                snapshot,
                max_retries=self.config.rollout.max_retries,
                stall_timeout_s=self.config.ray.stall_timeout_s,
                delay_s=delay_s,
            )
        rollout_seconds = time.perf_counter() - t0
        t1 = time.perf_counter()
        n = self.config.rollout.n_samples
        completions = [self.tokenizer.decode(ids, skip_special_tokens=True) for ids in rollouts.completions()]
        rewards, per_reward, reward_metrics, retries = score(
            self.reward,
            completions,
            _repeat(batch.prompt_texts, n),
            _repeat(batch.examples, n),
            rollouts.completion_lengths,
            max_retries=self.config.rollout.max_retries,
            stall_timeout_s=self.config.ray.stall_timeout_s,
        )
        scored = Scored(rollouts, rewards, per_reward, reward_metrics)
        timing = {"rollout": rollout_seconds, "reward": time.perf_counter() - t1, "reward_retries": retries, **stats}
        return scored, timing

    def collect(self, seed: int, snapshot: ParamsSnapshot) -> tuple[Scored, dict[str, float]]:
        """A step's scored batch (with DAPO refills), sampled with `snapshot`'s params, and its metrics."""
        scored, timing = self._generate_scored(seed, snapshot)
        totals = dict(timing)
        generations = 1
        metrics: dict[str, float] = {}
        if self.config.algo.dynamic_sampling:
            wanted = self.plan.global_batch_size
            parts, dropped, draws = [], [], 0
            while True:
                flat = constant_reward_groups(scored.rewards, scored.rollouts.group_id)
                parts.append(_select(scored, np.flatnonzero(~flat)))
                dropped.append(_select(scored, np.flatnonzero(flat)))
                kept = sum(p.rewards.shape[0] for p in parts)
                if kept >= wanted or draws >= self.config.algo.max_refill_draws:
                    break
                draws += 1
                scored, timing = self._generate_scored((seed + 7919 * draws) % 2**32, snapshot)
                generations += 1
                for k, v in timing.items():  # draws run one after another: their times and bytes add up
                    totals[k] += v
            short = max(wanted - kept, 0)
            pool = [p for p in parts if p.rewards.size] + [p for p in dropped if p.rewards.size]
            scored = _select(_merge_scored(pool), np.arange(wanted))
            metrics.update(
                {
                    "rollout/dynamic_sampling_draws": float(draws),
                    "rollout/dynamic_sampling_dropped_groups": float(
                        sum(p.rewards.size for p in dropped) // self.config.rollout.n_samples
                    ),
                    "rollout/dynamic_sampling_short_rows": float(short),
                }
            )
        self.lost_batches += int(totals["lost"])
        self.reward_retries += int(totals["reward_retries"])
        # Tokens per second of the engines' own time where they report it: the driver's wait (`rollout`) also holds
        # a colocated call's queue behind an evaluation, and misses what a worker generated while the driver evaluated.
        generating = totals.get("engine_seconds", totals["rollout"])
        metrics.update(
            {
                "rollout/lost_batches": float(self.lost_batches),
                "rollout/lost_batches_this_step": totals["lost"],
                "rollout/reward_retries": float(self.reward_retries),
                "rollout/generated_tokens": totals["generated_tokens"],
                "rollout/tokens_per_second": totals["generated_tokens"] / max(generating, 1e-9),
                "perf/rollout_seconds": totals["rollout"],
                "perf/weight_sync_seconds": totals["load_seconds"],
                "perf/weight_sync_fetch_seconds": totals["load_fetch_seconds"],
                "perf/weight_sync_bytes": totals["load_bytes"],
                "perf/reward_seconds": totals["reward"],
            }
        )
        metrics.update(self.warmup_metrics())
        if "slot_utilisation" in totals:  # the mean over the step's generations
            metrics["rollout/slot_utilisation"] = totals["slot_utilisation"] / generations
        if "compile_seconds" in totals:
            metrics["perf/rollout_compile_seconds"] = totals["compile_seconds"]
        if "engine_seconds" in totals:
            metrics["perf/rollout_engine_seconds"] = totals["engine_seconds"]
        metrics.update(self.prompts.metrics())  # rows skipped (by reason and source), examples taken per source
        return scored, metrics

    def warmup_metrics(self) -> dict[str, float]:
        """`perf/rollout_warmup_seconds` (the slowest worker's `warm_up`) and `perf/rollout_warmup_past_start_seconds`
        (how long the last warm-up to end ran after the trainer's start-up had ended: what the start-up did not
        hide, and a generation right after it waits for) at the first step after every warm-up ended (each
        worker's first generation waits for its own, so usually step 1); {} before, after, or where one failed or
        its worker died."""
        if not self.warmups:
            return {}
        done, _ = ray.wait(self.warmups, num_returns=len(self.warmups), timeout=0)
        if len(done) < len(self.warmups):
            return {}
        refs, self.warmups = self.warmups, []
        try:
            stats = ray.get(refs)
        except WORKER_FAILURES as error:
            log.warning("a rollout worker's warm-up did not report: %s", error)
            return {}
        if not all(stats):
            return {}  # it failed: the worker logged why
        seconds = max(s["seconds"] for s in stats)
        cut = sum(not s["complete"] for s in stats)
        finish = (
            "the tail's programs compile when a generation first needs them"
            if self.config.rollout.colocate
            else "each finishes it once that is done"
        )
        log.info(
            "rollout %s warmed up in %.1f s%s",
            "engine (colocated)" if self.config.rollout.colocate else "workers",
            seconds,
            f"; {cut} cut short by the first generation ({finish})" if cut else "",
        )
        metrics = {"perf/rollout_warmup_seconds": seconds}
        if self.started_at is not None:
            metrics["perf/rollout_warmup_past_start_seconds"] = self.past_start(max(s["ended_at"] for s in stats))
        return metrics

    def past_start(self, at: float) -> float:
        """Seconds from the trainer's start-up's end (`started_at`) to `at` (`time.time()` in an actor: wall clocks of
        one machine, or of several as far as they agree); 0 for a moment before it."""
        return max(0.0, at - self.started_at)

    def named_trainers(self) -> list[tuple[Any, str]]:
        """`(handle, name)` of the trainer's processes: "trainer", or "trainer process <i>" when several."""
        if len(self.trainers) == 1:
            return [(self.trainers[0], "trainer")]
        return [(t, f"trainer process {i}") for i, t in enumerate(self.trainers)]

    def on_trainer(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """Calls a trainer method and waits for it, watched by liveness pings (a stalled trainer ends the run).

        With several trainer processes the call goes to each (submitted under one lock, so that every process
        runs the same sequence of collective programs) and process 0's answer is returned.
        """
        with self.trainer_calls:
            refs = [(getattr(t, method).remote(*args, **kwargs), t, name) for t, name in self.named_trainers()]
        answers = [
            get_alive(ref, t, name=name, stall_timeout_s=self.config.ray.stall_timeout_s) for ref, t, name in refs
        ]
        return answers[0]

    def snapshot(self) -> ParamsSnapshot | None:
        """The store's front version (bounded by `ray.stall_timeout_s`)."""
        return latest_snapshot(self.store, timeout_s=self.config.ray.stall_timeout_s)

    def evaluate(self, step: int) -> dict[str, float]:
        """`eval/` metrics of the newest published params.

        Native engine: the trainer evaluates its own params, on a native engine of its own, or with
        `rollout.colocate` on the rollout engine it holds (`actors.ColocatedEngine`). vLLM: the rollout workers
        generate (the evaluation runs on the engine that samples the rollouts; no second vLLM engine), the driver
        scores with `eval.reward` and writes the samples to `eval_results_step<step>.json`.
        """
        t0 = time.perf_counter()
        if self.engine_spec.kind == "native":
            metrics = self.on_trainer("evaluate", step)
        else:
            if self.evaluator is None:
                from feynrl_jax.train.sft_loop import evaluation_on

                self.evaluator = evaluation_on(WorkersEngine(self), self.config, self.model_config, self.tokenizer)
            metrics = self.evaluator(self.snapshot(), step)
        return {**metrics, "perf/eval_seconds": time.perf_counter() - t0}

    def close(self) -> None:
        if self.evaluator is not None:
            self.evaluator.close()
        try:
            closing = [(a.close.remote(), n) for a, n in (*self.named_trainers(), (self.reward, "reward scorer")) if a]
            for ref, name in closing:
                try:
                    get_within(ref, name=name, timeout_s=max(self.config.ray.stall_timeout_s, 60))
                except (ActorStalled, *WORKER_FAILURES) as error:
                    log.warning("closing the %s failed: %s", name, error)
        finally:
            for actor, _ in self.named_actors():
                ray.kill(actor, no_restart=True)
            if self.placement is not None:
                self.placement.remove()


class WorkersEngine:
    """The rollout workers as one `RolloutEngine` holding a published version (evaluation on the workers).

    `load_params` takes a `ParamsSnapshot`: the workers load it with their next generation.
    """

    def __init__(self, driver: _Run):
        self.driver = driver
        self.snapshot: ParamsSnapshot | None = None

    def load_params(self, snapshot: ParamsSnapshot, version: int) -> None:
        self.snapshot = snapshot

    def generate(self, prompts: list[list[int]], sampling: SamplingParams) -> Rollouts:
        config = self.driver.config
        rollouts, _ = generate(
            self.driver.workers,
            prompts,
            sampling,
            self.snapshot,
            max_retries=config.rollout.max_retries,
            stall_timeout_s=config.ray.stall_timeout_s,
        )
        return rollouts


def run(config: ConfigDict, *, rollout_delay: Callable[[int], float] | None = None) -> dict[str, float]:
    """Trains `config` (paradigm "rl") to `config.train.steps`, sync or async, resuming if it can.

    Starts a local Ray instance (or connects to `ray.address`) unless this process is already connected.

    Args:
        config: the RL config.
        rollout_delay: test hook: seconds a rollout worker sleeps before a generation, by its sample seed.

    Returns:
        The last step's metrics merged with the final evaluation's (when `eval.during_training`).

    Raises:
        ValueError: the config is not an RL config.
        FileExistsError: the run folder holds checkpoints but `checkpoint.resume` is False.
    """
    if config.paradigm != "rl":
        raise ValueError(f"rl_loop.run needs config.paradigm='rl', got {config.paradigm!r}")
    # The trainer's processes each have this machine's kind of devices (on GPUs: Ray decides, the trainer checks).
    trainer_devices = None if config.ray.trainer_gpus else jax.local_device_count() * config.ray.trainer_processes
    validate(config, num_devices=trainer_devices)
    with RunLock(config.run_dir):
        driver = _Run(config, rollout_delay)
        started = start_ray(config.ray)
        try:
            return _train(driver)
        finally:
            if started:
                ray.shutdown()


def start_trainers(config: ConfigDict, store: Any, spec: Any, model_config: Any) -> list[Any]:
    """The trainer's actors: one, or `ray.trainer_processes` joined into one `jax.distributed` job whose
    coordinator runs in process 0 (its node's address, a free port there); each gets the driver's `model_config`
    (the policy's, from the same model and tokenizer), so none loads the tokenizer to start."""
    options = trainer_options(config)
    processes = config.ray.trainer_processes
    # The record travels with the actors: an algorithm registered in this process only (a loss defined in a
    # notebook) trains too.
    algorithm = get_algorithm(config.algo.name)
    if processes == 1:
        return [
            TrainerActor.options(**options).remote(config, store, spec, algorithm=algorithm, model_config=model_config)
        ]
    trainers = [
        TrainerActor.options(**options).remote(
            config, store, spec, process_id=i, algorithm=algorithm, model_config=model_config
        )
        for i in range(processes)
    ]
    address = get_within(
        trainers[0].coordinator_address.remote(), name="trainer process 0", timeout_s=STARTUP_TIMEOUT_S
    )
    log.info("trainer: %d processes joining one JAX job, coordinator %s", processes, address)
    for trainer in trainers:  # each joins in its own process; `ready()` waits for it and reports its error
        trainer.join.remote(address)
    return trainers


def _checkpoint_due(config: ConfigDict, step: int) -> bool:
    return step % checkpoint_every(config) == 0 or step == config.train.steps


def _train(driver: _Run) -> dict[str, float]:
    config = driver.config
    wall0 = time.perf_counter()
    pipeline = None
    try:
        driver.start_actors()
        driver.wait_ready()
        restored = driver.on_trainer("start")
        driver.started_at = time.time()
        run_setup.write_resolved_config(config, config.run_dir)  # once the checkpoint it describes is known to be good
        log.info("trainer ready after %.1f s", time.perf_counter() - wall0)
        start, version = restored["step"], restored["policy_version"]
        in_flight = []
        if restored["data_state"] is not None:
            prompts_state, in_flight = restore_state(restored["data_state"])
            driver.prompts.set_state(prompts_state)
        rng = (
            jax.random.key(config.seed)
            if restored["rng"] is None
            else jax.random.wrap_key_data(jnp.asarray(restored["rng"], jnp.uint32))
        )
        staleness = config.train.max_staleness
        log.info(
            "RL %s: %s, %s, old log-probabilities %s, off-policy correction %s; starting at step %d (version %d)",
            config.run_dir,
            config.algo.name,
            f"async (train.max_staleness={staleness})" if staleness else "sync",
            "recomputed by the trainer" if config.train.recompute_old_logprobs else "taken from the engine",
            effective_off_policy(config),
            start,
            version,
        )
        pipeline = RolloutPipeline(
            driver.collect,
            driver.prompts.get_state,
            first_step=start + 1,
            last_step=config.train.steps,
            max_staleness=staleness,
            rng=rng,
            restored=in_flight,
        )
        pipeline.publish(version, driver.snapshot())
        evaluate = config.eval.during_training
        tracker = Tracker(
            config.run_dir,
            total_steps=config.train.steps,
            initial_step=start,
            jsonl=config.tracking.jsonl,
            use_wandb=config.tracking.wandb,
            wandb_project=config.tracking.wandb_project,
            wandb_name=config.name,
            config=run_setup.config_dict(config),
            progress_bar=config.tracking.progress_bar,
        )
        before = after = None
        last: dict[str, float] = {}
        try:
            if evaluate and start == 0:
                before = driver.evaluate(0)
                tracker.log(0, before)
                print(f"held-out accuracy before training: {before['eval/accuracy']:.4f}", flush=True)
            for step in range(start + 1, config.train.steps + 1):
                t0 = time.perf_counter()
                batch, waited = pipeline.take(step)
                scored = batch.scored
                metrics = dict(batch.metrics)
                metrics.update(
                    rollout_metrics(
                        scored, success_threshold=config.eval.success_threshold, correctness_reward=config.eval.reward
                    )
                )
                rollouts = scored.rollouts
                metrics.update(staleness_metrics(rollouts.policy_version, rollouts.completion_mask, version, staleness))
                metrics["perf/trainer_wait_seconds"] = waited
                t1 = time.perf_counter()
                metrics.update(
                    driver.on_trainer("train", rollouts, scored.rewards, step=step, shuffle_seed=batch.shuffle_seed)
                )
                if "perf/update_compiled_at" in metrics:  # when the compile-ahead ended, from the start-up's end
                    compiled = driver.past_start(metrics.pop("perf/update_compiled_at"))
                    metrics["perf/update_compile_past_start_seconds"] = compiled
                version = int(metrics["train/policy_version"])
                pipeline.publish(version, driver.snapshot())
                metrics["perf/train_seconds"] = time.perf_counter() - t1
                if _checkpoint_due(config, step):
                    t2 = time.perf_counter()
                    rng_after, data_state = pipeline.checkpoint_state(step)
                    driver.on_trainer("save", step, rng_after, data_state, force=step == config.train.steps)
                    metrics["perf/checkpoint_seconds"] = time.perf_counter() - t2
                if evaluate and (
                    step == config.train.steps or (config.train.eval_every and step % config.train.eval_every == 0)
                ):
                    after = driver.evaluate(step)
                    metrics.update(after)
                metrics["perf/step_seconds"] = time.perf_counter() - t0
                if step % config.train.log_every == 0 or step == config.train.steps:
                    tracker.log(step, metrics)
                last = metrics
        finally:
            tracker.close()
    finally:
        if pipeline is not None:
            pipeline.close()
        driver.close()
    if before is not None and after is not None:
        print(
            f"held-out accuracy: before {before['eval/accuracy']:.4f} -> after {after['eval/accuracy']:.4f} "
            f"({config.train.steps} steps, {time.perf_counter() - wall0:.0f} s)",
            flush=True,
        )
    if config.tracking.jsonl:
        from feynrl_jax.tracking.plots import plot_run

        plot_run(config.run_dir)
    return last
