"""The Ray actors of an RL run: parameter store, rollout workers, reward scorer, trainer.

Parameters travel through Ray's shared-memory object store: the trainer fetches its params to host, `ray.put`s
every leaf and hands the references to `ParamStoreActor` (nested in a list, so Ray passes the references
instead of resolving them), which keeps them in a `DoubleBufferedStore`. The driver reads a published version as
a `ParamsSnapshot` (references only, one complete version, never a mix) and hands it to the rollout workers with
each generation; a worker fetches the leaves, checks the writer's checksum and loads them into its engine. The
store holds at most two versions (front, and the back buffer being written); an older version's arrays live on
only while a snapshot of it is held (by the driver, for a generation the schedule has not run yet).

Each actor imports JAX and its models inside its own process, after pinning itself to its CPU cores when the
config names them; the driver only moves numpy records between them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import ray

from feynrl_jax.orchestration.engine_host import EngineHost
from feynrl_jax.orchestration.engines import EngineSpec, publish_format
from feynrl_jax.orchestration.liveness import CONCURRENCY_GROUPS, LIVENESS_GROUP, get_within
from feynrl_jax.orchestration.param_store import (
    DoubleBufferedStore,
    StoreError,
    checksum_leaves,
    flatten_params,
    unflatten_params,
)
from feynrl_jax.orchestration.runtime import openmp_threads_from_cores, pin_cpu_cores

log = logging.getLogger(__name__)


@contextlib.contextmanager
def kept_until_ready(actor: Any):
    """Keeps an error of an actor's construction in `actor.init_error`, for its `ready()` to raise.

    Ray reports an exception raised in `__init__` as an `ActorDiedError` that holds only the traceback's text;
    raised by a method instead, it reaches the driver as itself (a `ConfigError`, an `InputError`) and the command
    line reports it in one line.
    """
    actor.init_error = None
    try:
        yield
    except Exception as error:
        log.exception("construction of %s failed", type(actor).__name__)
        actor.init_error = error


def ready(actor: Any) -> int:
    """The process id once `actor` is constructed; raises the error its construction kept, if any."""
    if actor.init_error is not None:
        raise actor.init_error
    return os.getpid()


@ray.remote(concurrency_groups=CONCURRENCY_GROUPS)
class ParamStoreActor:
    """A `DoubleBufferedStore` whose leaves are Ray object references (each wrapped in a one-element list)."""

    def __init__(self):
        self._store = DoubleBufferedStore()
        self._base: tuple[dict[str, list], int] | None = None
        self.init_error = None

    def ready(self) -> int:
        return ready(self)

    @ray.method(concurrency_group=LIVENESS_GROUP)
    def ping(self) -> int:
        """The process id; answered by its own thread (`liveness`)."""
        return os.getpid()

    def begin(self, version: int) -> None:
        self._store.begin(version)

    def write(self, version: int, leaves: Mapping[str, list]) -> None:
        """Writes `{name: [ObjectRef]}` into the back buffer of `version`."""
        for name, wrapped in leaves.items():
            self._store.write(version, name, wrapped)

    def publish(self, version: int, checksum: int) -> int:
        """Flips `version` to the front with the writer's checksum of the arrays; returns the version."""
        return self._store.publish(version, checksum=checksum).version

    def set_base(self, leaves: Mapping[str, list], checksum: int) -> None:
        """Keeps `{name: [ObjectRef]}` as the frozen base params of a LoRA run (its versions carry adapters only);
        a restarted trainer sets it again."""
        self._base = (dict(leaves), checksum)

    def latest(self) -> tuple[int, dict[str, list], int, tuple[dict[str, list], int] | None] | None:
        """`(version, {name: [ObjectRef]}, checksum, base)` of the published version (`base`: the LoRA base's
        `({name: [ObjectRef]}, checksum)` or None), or None before the first."""
        snapshot = self._store.latest()
        if snapshot is None:
            return None
        return snapshot.version, dict(snapshot.leaves), snapshot.checksum, self._base

    def version(self) -> int:
        return self._store.version()

    def versions_held(self) -> int:
        return self._store.versions_held()


def publish_base(store: Any, base: Any, *, timeout_s: float) -> dict[str, float]:
    """Puts the frozen base params of a LoRA run (host, nested numpy) in the object store once and gives the store
    their references: every later version carries the adapters alone.

    Returns:
        `perf/publish_base_bytes`.
    """
    leaves = {name: np.asarray(leaf) for name, leaf in flatten_params(base).items()}
    refs = {name: [ray.put(leaf)] for name, leaf in leaves.items()}
    get_within(store.set_base.remote(refs, checksum_leaves(leaves)), name="parameter store", timeout_s=timeout_s)
    return {"perf/publish_base_bytes": float(sum(leaf.nbytes for leaf in leaves.values()))}


def publish_params(store: Any, params: Any, version: int, *, timeout_s: float) -> dict[str, float]:
    """Publishes host `params` (a nested dict of numpy arrays) as `version`: begin, write, flip.

    Args:
        store: the `ParamStoreActor`.
        params: host params.
        version: the policy version.
        timeout_s: bound on each call to the store (`ray.stall_timeout_s`).

    Returns:
        `perf/publish_bytes` and `perf/publish_put_seconds`.

    Raises:
        ActorStalled: the store did not answer within `timeout_s`.
    """
    t0 = time.perf_counter()
    leaves = {name: np.asarray(leaf) for name, leaf in flatten_params(params).items()}
    checksum = checksum_leaves(leaves)
    get_within(store.begin.remote(version), name="parameter store", timeout_s=timeout_s)
    refs = {name: [ray.put(leaf)] for name, leaf in leaves.items()}
    get_within(store.write.remote(version, refs), name="parameter store", timeout_s=timeout_s)
    get_within(store.publish.remote(version, checksum), name="parameter store", timeout_s=timeout_s)
    return {
        "perf/publish_bytes": float(sum(leaf.nbytes for leaf in leaves.values())),
        "perf/publish_put_seconds": time.perf_counter() - t0,
    }


@dataclasses.dataclass(frozen=True)
class ParamsSnapshot:
    """One published version as the store holds it: object references, not arrays.

    Handing a snapshot to a rollout worker (inside an argument, so Ray passes the references through unresolved)
    pins that version: its arrays stay in the object store while any holder keeps the snapshot, whatever the
    trainer publishes meanwhile.

    Attributes:
        version: the policy version.
        refs: `{leaf name: [ObjectRef]}` (a LoRA run's: the adapters alone).
        checksum: the publisher's checksum of the arrays (`checksum_leaves`).
        base: a LoRA run's frozen base params, `({leaf name: [ObjectRef]}, checksum)`, published once; None
            otherwise.
    """

    version: int
    refs: dict[str, list]
    checksum: int
    base: tuple[dict[str, list], int] | None = None


def latest_snapshot(store: Any, *, timeout_s: float | None = None) -> ParamsSnapshot | None:
    """The store's published version as a `ParamsSnapshot`, or None before the first publish.

    Raises:
        ActorStalled: the store did not answer within `timeout_s` (None: no bound).
    """
    snapshot = get_within(store.latest.remote(), name="parameter store", timeout_s=timeout_s)
    return None if snapshot is None else ParamsSnapshot(*snapshot)


def fetch_snapshot(snapshot: ParamsSnapshot, *, verify: bool = True, base: bool = False) -> dict[str, Any]:
    """The snapshot's params (or, with `base`, its LoRA base params) as a nested dict of numpy arrays.

    Raises:
        StoreError: when `verify` and the fetched bytes do not match the writer's checksum.
    """
    refs, checksum = snapshot.base if base else (snapshot.refs, snapshot.checksum)
    names = sorted(refs)
    arrays = ray.get([refs[name][0] for name in names])
    leaves = dict(zip(names, arrays, strict=True))
    if verify and checksum_leaves(leaves) != checksum:
        what = "base parameters" if base else "parameters"
        raise StoreError(f"version {snapshot.version}: fetched {what} do not match the publisher's checksum {checksum}")
    return unflatten_params(leaves)


def fetch_params(store: Any, *, verify: bool = True) -> tuple[int, dict[str, Any]] | None:
    """The store's published version as `(version, nested params of numpy arrays)`, or None before the first.

    Raises:
        StoreError: when `verify` and the fetched bytes do not match the writer's checksum.
    """
    snapshot = latest_snapshot(store)
    if snapshot is None:
        return None
    return snapshot.version, fetch_snapshot(snapshot, verify=verify)


def worker_name(run_dir: str, index: int) -> str:
    """The Ray actor name of rollout worker `index` of the run in `run_dir` (`ray.get_actor(name)` finds it)."""
    return f"rollout_worker_{index}@{os.path.abspath(run_dir)}"


WARMUP_GROUP = "warmup"
"""A rollout worker's concurrency group for `warm_up`: a thread of its own, so that `status` and a `generate` that
waits for the engine stay answerable meanwhile."""


@ray.remote(concurrency_groups={**CONCURRENCY_GROUPS, WARMUP_GROUP: 1})
class RolloutWorker:
    """A Ray actor that owns the run's rollout engine (`EngineHost`) and loads each version from the store.

    A vLLM engine starts in the constructor (its start-up errors are raised by `ready()`) and receives its first
    weights with the first `generate`; a native engine is built by `warm_up` on placeholder weights, or else from the
    first version it receives.

    Args:
        model_config: the policy's `ModelConfig`.
        tokenizer_dir: folder of the tokenizer (detokenises for stop strings).
        spec: the engine to build (`engines.engine_spec`).
        index: the worker's index (logs).
        cpu_cores: CPU cores to pin this process to before JAX starts (`rollout.cpu_cores`); () for none.
    """

    def __init__(
        self,
        model_config: Any,
        tokenizer_dir: str,
        *,
        spec: EngineSpec,
        index: int,
        cpu_cores: Sequence[int] = (),
    ):
        self.host = None
        with kept_until_ready(self):
            pin_cpu_cores(cpu_cores)
            if spec.kind == "native":  # a vLLM engine keeps its own thread settings
                openmp_threads_from_cores()
            self.host = EngineHost(model_config, tokenizer_dir, spec, index=index, fetch=fetch_snapshot)

    def ready(self) -> int:
        """The process id; raises what the construction raised."""
        return ready(self)

    @ray.method(concurrency_group=LIVENESS_GROUP)
    def ping(self) -> int:
        """The process id; answered by its own thread (`liveness`) while a generation runs."""
        return os.getpid()

    def status(self) -> dict[str, Any]:
        """`{"pid", "engine", "version", "generating", "generate_calls", "warming_up", "warm_up_left", "cpu_cores",
        "gpu_ids"}` (answers while a generation runs); `warm_up_left`: the programs a native engine's warm-up cut
        short has yet to compile (`NativeEngine.warm_up_left`)."""
        return {
            "pid": os.getpid(),
            **self.host.status(),
            "cpu_cores": sorted(os.sched_getaffinity(0)),
            "gpu_ids": [str(i) for i in ray.get_gpu_ids()],
        }

    def load(self, snapshot: ParamsSnapshot) -> dict[str, float]:
        """`EngineHost.load`: the snapshot's weights into the engine unless it holds that version already."""
        return self.host.load(snapshot)

    def detokenize(self, ids: Sequence[int]) -> str:
        """Token ids to text (stop strings)."""
        return self.host.detokenize(ids)

    @ray.method(concurrency_group=WARMUP_GROUP)
    def warm_up(self, prompt_lengths: Sequence[int], sampling: Any) -> dict[str, float]:
        """`EngineHost.warm_up`. The driver calls it at start-up (`rollout.warmup`), so that the worker compiles
        while the trainer starts instead of in the first generation, which waits for it."""
        return self.host.warm_up(prompt_lengths, sampling)

    def generate(
        self, prompts: Sequence[Sequence[int]], sampling: Any, snapshot: ParamsSnapshot, delay_s: float = 0.0
    ) -> tuple[Any, dict]:
        """`EngineHost.generate`: `sampling.n` completions per prompt with the params of `snapshot`."""
        return self.host.generate(prompts, sampling, snapshot, delay_s)


@ray.remote(concurrency_groups=CONCURRENCY_GROUPS)
class RewardWorker:
    """A `RewardScorer` (timeout-safe process pool) inside an actor; it raises `RewardError` when more than
    `max_failure_frac` of a batch's calls of one reward fail (`rollout.max_reward_failure_frac`)."""

    def __init__(
        self,
        specs: Mapping[str, float],
        *,
        reward_kwargs: Mapping[str, Mapping[str, Any]],
        timeout_s: float,
        num_workers: int,
        max_failure_frac: float,
    ):
        with kept_until_ready(self):
            from feynrl_jax.rollout.rewards import RewardScorer

            self.scorer = RewardScorer(
                dict(specs),
                reward_kwargs=dict(reward_kwargs),
                timeout_s=timeout_s,
                num_workers=num_workers,
                max_failure_frac=max_failure_frac,
            )

    def ready(self) -> int:
        """The process id; raises what the construction raised."""
        return ready(self)

    @ray.method(concurrency_group=LIVENESS_GROUP)
    def ping(self) -> int:
        """The process id; answered by its own thread (`liveness`) while scoring runs."""
        return os.getpid()

    def score(
        self,
        prompts: list[str],
        completions: list[str],
        examples: list[dict],
        completion_lengths: np.ndarray,
    ) -> tuple[np.ndarray, dict[str, np.ndarray], dict[str, float]]:
        return self.scorer.score(prompts, completions, examples, completion_lengths=completion_lengths)

    def close(self) -> None:
        self.scorer.close()


@ray.remote(concurrency_groups={**CONCURRENCY_GROUPS, WARMUP_GROUP: 1})
class TrainerActor:
    """Runs `RLTrainer` (train step, state, reference, critic, checkpoints, evaluation) and publishes params.

    With `rollout.colocate` the run's one rollout engine lives here too (`EngineHost` on the trainer's first
    device, fed the trainer's own params; the driver calls `warm_up` and `generate` here instead of on a rollout
    worker): a publish then records the new version in the store without its arrays, since nothing reads them.

    With `ray.trainer_processes = P > 1` the trainer is P of these actors, one JAX process each, joined by
    `jax.distributed` into one job whose mesh spans all their devices: the driver makes every call on all of them
    in the same order (each a step of the same SPMD program); process 0 alone publishes to the store, and its
    answers are the ones the driver keeps. Such an actor is built in two calls: the constructor only records its
    place (`process_id`), then `join(coordinator_address)` joins the job and builds the trainer.

    Args:
        config: the validated RL config.
        store: the `ParamStoreActor` handle.
        spec: the rollout engine's `EngineSpec` (the format params are published in).
        process_id: this actor's process id in a trainer of `ray.trainer_processes` > 1 processes, else None.
        algorithm: the driver's record of `config.algo.name` (`feynrl_jax.losses.Algorithm`), registered in this
            process unless the name is known here already; None looks the name up here.
        model_config: the driver's `ModelConfig` of the policy (`RLTrainer`'s `model_config`); None: computed here.
    """

    def __init__(
        self,
        config: Any,
        store: Any,
        spec: EngineSpec,
        process_id: int | None = None,
        algorithm: Any = None,
        model_config: Any = None,
    ):
        if algorithm is not None:
            from feynrl_jax.losses.registry import adopt

            adopt(config.algo.name, algorithm)
        self.config, self.store, self.spec, self.model_config = config, store, spec, model_config
        self.store_timeout_s = config.ray.stall_timeout_s
        self.process_id = process_id
        self.init_error = None
        self.rollout = None  # the colocated rollout engine (`rollout.colocate`), built with the trainer
        self.closing = False
        if process_id is None:
            self._build()

    def _build(self) -> None:
        with kept_until_ready(self):
            pin_cpu_cores(self.config.train.cpu_cores)
            openmp_threads_from_cores()
            from feynrl_jax.train.rl_trainer import RLTrainer

            # A colocated engine's warm-up comes (`rl_loop` sends it) where it is on and native: the update's
            # compile-ahead waits for it.
            rollout = self.config.rollout
            warmed = rollout.colocate and rollout.warmup and self.spec.kind == "native"
            compile_after = self._after_warm_up if warmed else None
            self.trainer = RLTrainer(self.config, self.model_config, compile_after=compile_after)
            self.for_engine = publish_format(self.spec, self.trainer.model_config)
            # LoRA: the base is published once (`start`), every version carries the adapters alone.
            self.lora_sync = bool(self.trainer.model_config.lora_rank)
            if self.config.rollout.colocate:
                self.rollout = EngineHost(
                    self.trainer.model_config,
                    self.trainer.source.tokenizer_dir,
                    self.spec,
                    index=0,
                    local_params=self._engine_params,
                )

    def _after_warm_up(self) -> bool:
        """Holds the update's compile-ahead (`RLTrainer.compile_after`) until the colocated engine's warm-up ends.

        One process compiles one program at a time in effect: XLA:CPU's compiles share the process's threads, so a
        compile started beside a long one waits for it (measured on the 2-core machine: a one-operation program's
        0.05 s became 1.5-2.2 s beside the demo's train step; in the demo the warm-up's small programs took 5 s
        each). The first generation needs the warm-up's programs before the first update needs the train step, so
        these compile first and the update after, while the trainer evaluates and generates. Returns False where
        the trainer closes first (`close` wakes it: nothing to compile); waits at most `ray.stall_timeout_s`, then
        compiles anyway (`benchmarks/bench_compile_order.py` measures the two orders)."""
        self.rollout.wait_for_warm_up(self.config.ray.stall_timeout_s)
        return not self.closing

    def _engine_params(self, version: int) -> Any:
        """The colocated engine's params: the trainer's own, which must be `version`, in `model.param_dtype`
        (float32 masters rounded on the trainer's mesh, before the engine's host gathers them onto one device)."""
        from feynrl_jax.models.decoder import as_param_dtype

        if version != self.trainer.policy_version:
            raise StoreError(
                f"the colocated rollout engine was asked for version {version}, but the trainer holds version "
                f"{self.trainer.policy_version} (a colocated engine samples the trainer's current params only)"
            )
        return as_param_dtype(self.trainer.state.params, self.trainer.model_config)

    def coordinator_address(self) -> str:
        """`host:port` for the job's coordinator (process 0's): this node's address and a free port on it."""
        import socket

        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return f"{ray.util.get_node_ip_address()}:{port}"

    def join(self, coordinator_address: str) -> None:
        """Joins the trainer's `jax.distributed` job (before any JAX work in this process), then builds the
        trainer; an error is kept for `ready()`."""
        from feynrl_jax.sharding.multihost import initialize_distributed

        job = self.config.distributed
        with kept_until_ready(self):
            initialize_distributed(
                {
                    "FEYNRL_COORDINATOR_ADDRESS": coordinator_address,
                    "FEYNRL_NUM_PROCESSES": str(self.config.ray.trainer_processes),
                    "FEYNRL_PROCESS_ID": str(self.process_id),
                },
                initialization_timeout=job.initialization_timeout_s,
                heartbeat_timeout=job.heartbeat_timeout_s,
            )
        if self.init_error is None:
            self._build()

    def _publish(self, version: int) -> dict[str, float]:
        """Publishes the params, in the rollout engine's format, as `version`; returns the publish figures.

        Every trainer process gathers the params (a collective); process 0 alone writes them to the store. With a
        colocated engine (`rollout.colocate`) nothing is gathered: the version is recorded without arrays."""
        if self.rollout is not None:
            return publish_params(self.store, {}, version, timeout_s=self.store_timeout_s)
        t0 = time.perf_counter()
        if self.lora_sync:
            weights = self.for_engine.adapters(self.trainer.host_adapters())
        else:
            weights = self.for_engine.params(self.trainer.host_params())
        convert_seconds = time.perf_counter() - t0
        if self.process_id:
            return {}
        metrics = publish_params(self.store, weights, version, timeout_s=self.store_timeout_s)
        return {**metrics, "perf/publish_convert_seconds": convert_seconds}

    def describe(self) -> dict[str, Any]:
        """`RLTrainer.describe`: the trainer's processes, devices and mesh."""
        return self.trainer.describe()

    def ready(self) -> int:
        """The process id; raises what the construction raised (a bad checkpoint, a mesh that does not fit)."""
        return ready(self)

    @ray.method(concurrency_group=LIVENESS_GROUP)
    def ping(self) -> int:
        """The process id; answered by its own thread (`liveness`) while a step runs."""
        return os.getpid()

    def start(self) -> dict[str, Any]:
        """Builds or restores the state and publishes it; returns where the run starts (`Restored` fields)."""
        restored = self.trainer.start()
        if self.lora_sync and self.rollout is None:
            base = self.trainer.host_base()  # a collective with several trainer processes
            if not self.process_id:
                figures = publish_base(self.store, self.for_engine.base(base), timeout_s=self.store_timeout_s)
                log.info("published the frozen LoRA base once: %d bytes", figures["perf/publish_base_bytes"])
        self._publish(restored.policy_version)
        return dataclasses.asdict(restored)

    def train(self, rollouts: Any, rewards: np.ndarray, **kwargs: Any) -> dict[str, float]:
        """`RLTrainer.train`, then publishes the new version in the engine's format; adds `perf/publish_*`."""
        metrics = self.trainer.train(rollouts, rewards, **kwargs)
        t0 = time.perf_counter()
        metrics.update(self._publish(self.trainer.policy_version))
        metrics["perf/publish_seconds"] = time.perf_counter() - t0
        return metrics

    @ray.method(concurrency_group=WARMUP_GROUP)
    def warm_up(self, prompt_lengths: Sequence[int], sampling: Any) -> dict[str, float]:
        """The colocated engine's `EngineHost.warm_up`, in a thread of its own while the trainer starts."""
        return self.rollout.warm_up(prompt_lengths, sampling)

    def generate(
        self, prompts: Sequence[Sequence[int]], sampling: Any, snapshot: ParamsSnapshot, delay_s: float = 0.0
    ) -> tuple[Any, dict]:
        """The colocated engine's `EngineHost.generate` with the trainer's params of `snapshot.version`."""
        return self.rollout.generate(prompts, sampling, snapshot, delay_s)

    def save(self, step: int, rng: np.ndarray, data_state: Any, *, force: bool) -> bool:
        """`RLTrainer.save`: checkpoints the state with the driver's PRNG key and data state, when due."""
        return self.trainer.save(step, rng, data_state, force=force)

    def cpu_cores(self) -> list[int]:
        return sorted(os.sched_getaffinity(0))

    def evaluate(self, step: int) -> dict[str, float]:
        """`RLTrainer.evaluate`; with a colocated engine (`rollout.colocate`) on that engine (`ColocatedEngine`),
        whose warm-up and rollouts have compiled the programs an evaluation of its shapes runs, instead of a second
        engine compiling its own."""
        if self.rollout is not None and self.trainer.evaluator is None:
            from feynrl_jax.train.sft_loop import evaluation_on

            trainer = self.trainer
            engine = ColocatedEngine(self.rollout, lambda: trainer.policy_version)
            trainer.evaluator = evaluation_on(engine, self.config, trainer.model_config, trainer.tokenizer)
        return self.trainer.evaluate(step)

    def final_params(self) -> Any:
        return self.trainer.final_params()

    def close(self) -> None:
        self.closing = True
        if self.rollout is not None:
            self.rollout.warm_up_ended.set()  # a compile-ahead still waiting for it compiles nothing
        self.trainer.close()


class ColocatedEngine:
    """A colocated rollout engine (`EngineHost` with `local_params`) as a `RolloutEngine` for the trainer's held-out
    evaluation: each `generate` loads the trainer's current params (`version()`, the version the trainer holds) and
    frees them after, as a rollout does. `load_params` takes the evaluator's params and step and keeps nothing: the
    host loads the trainer's own (a LoRA policy's base and adapters, as its rollouts run them).
    """

    def __init__(self, host: EngineHost, version: Any):
        self.host, self.version = host, version

    def load_params(self, params: Any, version: int) -> None:
        del params, version  # the host takes the trainer's current params itself

    def generate(self, prompts: Sequence[Sequence[int]], sampling: Any) -> Any:
        snapshot = ParamsSnapshot(version=self.version(), refs={}, checksum=0)  # a colocated publish's record
        rollouts, _ = self.host.generate(prompts, sampling, snapshot)
        return rollouts
