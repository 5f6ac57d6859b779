"""A process's rollout engine and the rules around it: which version it holds, one generation at a time, the
start-up warm-up and its finisher.

Two kinds of process host one. A rollout worker (`actors.RolloutWorker`) fetches each version from the parameter
store (`fetch`). A trainer whose engine is colocated with it (`rollout.colocate`, `actors.TrainerActor`) hands its
engine its own params (`local_params`), which the engine places on the process's first device: nothing is fetched,
checked or copied to host, and the engine releases its copy of the params and its KV cache after every generation,
so that the update that follows has that memory (verl's "hybrid engine" idea: one process holds the policy for
both; Sheng et al. 2024, HybridFlow).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from feynrl_jax.compile_clock import compile_clock
from feynrl_jax.orchestration.engines import EngineSpec, build_native, build_vllm
from feynrl_jax.orchestration.param_store import flatten_params

log = logging.getLogger(__name__)


class EngineHost:
    """Owns one rollout engine (`EngineSpec`); loads the params of the version each `generate` call names.

    A vLLM engine starts in the constructor and receives its first weights with the first `generate`; a native
    engine is built by `warm_up` on placeholder weights, or else from the first version it receives.

    Args:
        model_config: the policy's `ModelConfig`.
        tokenizer_dir: folder of the tokenizer (detokenises for stop strings), checked here.
        spec: the engine to build.
        index: the host's index (logs).
        fetch: `fetch(snapshot, base=False) -> nested params` of a store snapshot (a rollout worker's
            `actors.fetch_snapshot`); None where `local_params` is given.
        local_params: a colocated native engine's source: `local_params(version)` returns the trainer's params of
            that version (raises for any other); the engine places them on this process's first device, where it
            runs as a rollout worker's runs on its one device (`_build_native`). None for a rollout worker.
    """

    def __init__(
        self,
        model_config: Any,
        tokenizer_dir: str,
        spec: EngineSpec,
        *,
        index: int,
        fetch: Callable[..., Any] | None = None,
        local_params: Callable[[int], Any] | None = None,
    ):
        if (fetch is None) == (local_params is None):
            raise ValueError("EngineHost needs exactly one of fetch (a rollout worker) and local_params (colocated)")
        if local_params is not None and spec.kind != "native":
            raise ValueError(f"a colocated engine must be native, got {spec.kind!r}")
        self.model_config, self.spec, self.index = model_config, spec, index
        self.fetch, self.local_params = fetch, local_params
        # A colocated engine frees its params and KV cache after each generation (the trainer's update follows).
        self.release_after_generate = local_params is not None
        self.engine = None
        self.base_loaded = False  # a LoRA run's base weights are in the engine (fetched once)
        self.version = -1
        self.generating = False
        self.generate_calls = 0
        # One generation, load, warm-up or warm-up finish at a time (an evaluation may call meanwhile).
        self.engine_lock = threading.Lock()
        # Generations waiting for or holding the engine: a warm-up (or its finish) yields to them.
        self.generations, self.generations_lock = 0, threading.Lock()
        self.warming_up = False  # a warm-up or its finish holds the engine
        # Set when `warm_up` returns, whatever it returns (and by a closing `TrainerActor`, to wake its waiters).
        self.warm_up_ended = threading.Event()
        self.finisher: threading.Thread | None = None  # finishes a warm-up cut short (`_finish_warm_up_soon`)
        self.finish_failed = False
        # Loaded by the first `detokenize` (stop strings): a run without them never imports transformers here,
        # 1.3-1.5 s of every worker's start. A folder missing on this node still fails here.
        from feynrl_jax.checkpoints.tokenizer import check_tokenizer_folder

        self.tokenizer_dir, self.tokenizer = check_tokenizer_folder(tokenizer_dir), None
        self.tokenizer_lock = threading.Lock()
        self.clock = compile_clock() if spec.kind == "native" else None  # vLLM compiles with torch
        if spec.kind == "vllm":
            self.engine = build_vllm(spec, model_config)

    def status(self) -> dict[str, Any]:
        """`{"engine", "version", "generating", "generate_calls", "warming_up", "warm_up_left"}`."""
        return {
            "engine": type(self.engine).__name__ if self.engine is not None else None,
            "version": self.version,
            "generating": self.generating,
            "generate_calls": self.generate_calls,
            "warming_up": self.warming_up,
            "warm_up_left": getattr(self.engine, "warm_up_left", 0),
        }

    def load(self, snapshot: Any) -> dict[str, float]:
        """Loads the weights of `snapshot` (an `actors.ParamsSnapshot`) into the engine unless it holds that version
        already: fetched from the store, or a colocated engine's from the trainer (`local_params`).

        Returns:
            The weight sync's figures: `load_seconds` (fetch and load), `load_fetch_seconds` (from the object
            store, checksum included; 0 colocated) and `load_bytes`; all 0 when the version is already loaded.
        """
        if self.version == snapshot.version:
            return {"load_seconds": 0.0, "load_fetch_seconds": 0.0, "load_bytes": 0.0}
        if self.local_params is not None:
            return self._load_local(snapshot.version)
        t0 = time.perf_counter()
        weights = self.fetch(snapshot)
        nbytes = _nbytes(weights)
        lora_sync = snapshot.base is not None  # a LoRA run: `weights` are the adapters alone
        vllm = self.spec.kind == "vllm"
        base = None
        if lora_sync and not self.base_loaded:  # the base, once per worker
            base = self.fetch(snapshot, base=True)
            nbytes += _nbytes(base)
            if not vllm:  # the native engine is built or loaded below with base and adapters together
                from feynrl_jax.models import lora

                weights = lora.combine(base, weights)
        fetched = time.perf_counter()
        self.version = -1  # until this load completes: a failed one leaves no version loaded, and the next reloads
        if vllm and lora_sync:
            if base is not None:
                self.engine.load_weights(base, snapshot.version)
            self.engine.load_adapter_weights(weights, snapshot.version)
        elif vllm:
            self.engine.load_weights(weights, snapshot.version)
        elif self.engine is None:
            self.engine = self._build_native(weights, snapshot.version)
        elif lora_sync and base is None:  # the base is in the engine already
            self.engine.load_adapters(weights, snapshot.version)
        else:  # plain weights, or a LoRA policy's first load (base and adapters) into an engine built by `warm_up`
            self.engine.load_params(weights, snapshot.version)
        self.base_loaded = self.base_loaded or base is not None
        self.version = snapshot.version
        return {
            "load_seconds": time.perf_counter() - t0,
            "load_fetch_seconds": fetched - t0,
            "load_bytes": nbytes,
        }

    def _load_local(self, version: int) -> dict[str, float]:
        """A colocated engine's load: the trainer's params of `version`, copied onto the engine's device (the engine's
        own per-layer copy in `model.param_dtype`; a LoRA policy's base and adapters together)."""
        t0 = time.perf_counter()
        params = self.local_params(version)
        self.version = -1
        if self.engine is None:
            self.engine = self._build_native(params, version)
        else:
            self.engine.load_params(params, version)
        self.version = version
        return {"load_seconds": time.perf_counter() - t0, "load_fetch_seconds": 0.0, "load_bytes": _nbytes(params)}

    def _build_native(self, params: Any, version: int) -> Any:
        """A native engine holding `params`. A colocated one places them (and its decode state) on a one-device mesh
        of this process's first device: the trainer's params arrive placed on the trainer's mesh, and an engine whose
        arrays were placed now one way, now another, would compile its programs again for each (the warm-up's
        placeholder weights come from host memory). A colocated one also runs the trainer's held-out evaluation
        (greedy, `actors.ColocatedEngine`) beside its sampled rollouts, so it takes `greedy` traced
        (`NativeEngine`'s `traced_greedy`): both run one set of decode programs."""
        kwargs = {}
        if self.local_params is not None:
            import jax

            mesh = jax.sharding.Mesh(np.array(jax.local_devices()[:1]), ("rollout",))
            kwargs["param_shardings"] = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
            kwargs["traced_greedy"] = True
        return build_native(self.spec, self.model_config, params, version, detokenize=self.detokenize, **kwargs)

    def detokenize(self, ids: Sequence[int]) -> str:
        """Token ids to text (stop strings)."""
        with self.tokenizer_lock:  # the engine's stop strings and a remote call may ask at once
            if self.tokenizer is None:
                from feynrl_jax.checkpoints import load_tokenizer

                self.tokenizer = load_tokenizer(self.tokenizer_dir)
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def warm_up(self, prompt_lengths: Sequence[int], sampling: Any) -> dict[str, float]:
        """Native engine: builds the engine on placeholder weights (`feynrl_jax.models.placeholder_params`) unless
        it exists, and compiles the programs that a batch of prompts of `prompt_lengths` sampled with `sampling`
        runs (`NativeEngine.warm_up`), so that the first generation finds them compiled. A generation that comes
        meanwhile cuts the narrowed tail's part short. A rollout worker finishes it once that generation is done
        and no other waits (`_finish_warm_up_soon`); a colocated engine does not (a finisher would need the params
        it frees after each generation, during the trainer's update): a generation whose tail first narrows to one
        of those widths compiles its programs. A colocated engine frees the placeholder weights and state at the
        warm-up's end.

        Returns:
            `NativeEngine.warm_up`'s figures and `ended_at` (`time.time()` at its end); {} for a vLLM engine (it
            warmed itself up when it started) or where the warm-up failed: the failure is logged, and the first
            generation compiles what it needs.
        """
        try:
            return self._warm_up(prompt_lengths, sampling)
        finally:
            self.warm_up_ended.set()

    def wait_for_warm_up(self, timeout_s: float) -> None:
        """Returns once `warm_up_ended` is set (`warm_up` returned, whatever it returned), or after `timeout_s` with a
        warning."""
        if not self.warm_up_ended.wait(timeout_s):
            log.warning("rollout engine %d: the warm-up did not end in %.0f s; going on", self.index, timeout_s)

    def _warm_up(self, prompt_lengths: Sequence[int], sampling: Any) -> dict[str, float]:
        if self.spec.kind != "native":
            return {}
        with self.engine_lock, self._holding_for_warm_up():
            try:
                if self.engine is None:
                    from feynrl_jax.models import lora, placeholder_params

                    placeholder = placeholder_params(self.model_config)
                    self.engine = self._build_native(placeholder, -1)
                    if self.model_config.lora_rank:  # later syncs load the adapters alone: that program too
                        self.engine.load_adapters(lora.adapters_of(placeholder), -1)
                stats = self.engine.warm_up(prompt_lengths, sampling, stop=self._generation_waits)
            except Exception:
                log.warning(
                    "rollout engine %d: the warm-up failed; the first generation compiles instead",
                    self.index,
                    exc_info=True,
                )
                return {}
            finally:
                if self.release_after_generate and self.engine is not None and self.version == -1:
                    self.engine.release_memory()
        return {**stats, "ended_at": time.time()}

    def generate(
        self, prompts: Sequence[Sequence[int]], sampling: Any, snapshot: Any, delay_s: float = 0.0
    ) -> tuple[Any, dict]:
        """Samples `sampling.n` completions per prompt with the params of `snapshot` (exactly that version).

        The engine switches version only here, between two calls, so every token of a call carries the same
        version and its exact behaviour log-probability.

        Args:
            prompts: token ids of each prompt.
            sampling: the `SamplingParams`.
            snapshot: the version to sample with (`actors.ParamsSnapshot`).
            delay_s: seconds to sleep first (tests: a slow worker must not change what a run computes).

        Returns:
            `(Rollouts, stats)`: the engine's `last_stats`, the weight sync's figures (`load`), `engine_seconds`
            (from the call's start here to its end: waiting for the engine (a warm-up), loading, generating and,
            colocated, freeing; not the time the call queued in its actor before it started) and, native engine,
            `compile_seconds` (JAX's backend compiles during the call, the load's included).
        """
        entered = time.perf_counter()
        with self.generations_lock:
            self.generations += 1
        try:
            with self.engine_lock:
                self.generating = True
                self.generate_calls += 1
                try:
                    if delay_s:
                        time.sleep(delay_s)
                    compiled = self.clock.seconds() if self.clock else 0.0
                    sync = self.load(snapshot)
                    rollouts = self.engine.generate(prompts, sampling)
                    stats = {**self.engine.last_stats, **sync}
                    if self.clock:
                        stats["compile_seconds"] = self.clock.seconds() - compiled
                finally:
                    self.generating = False
                    if self.release_after_generate and self.engine is not None:
                        self.version = -1  # the next generation loads the trainer's params again
                        self.engine.release_memory()
            stats["engine_seconds"] = time.perf_counter() - entered
            return rollouts, stats
        finally:
            with self.generations_lock:
                self.generations -= 1
            self._finish_warm_up_soon()

    def _generation_waits(self) -> bool:
        """Whether a generation waits for the engine or holds it (a warm-up's `stop`)."""
        return self.generations > 0

    @contextlib.contextmanager
    def _holding_for_warm_up(self):
        """`warming_up` (`status`) while the body runs; call it holding the engine."""
        self.warming_up = True
        try:
            yield
        finally:
            self.warming_up = False

    def _finish_warm_up_soon(self) -> None:
        """A native engine whose warm-up a generation cut short: compiles what it left (`NativeEngine.finish_warm_up`)
        in a thread of its own, once no generation waits, and yields to the next one as the warm-up does; so the
        narrowed tail's programs compile while the worker waits for work (a sync run's update), not in the
        generation whose tail first narrows to them. Not a colocated engine's (`warm_up`)."""
        if self.spec.kind != "native" or self.release_after_generate or self.finish_failed:
            return
        if not getattr(self.engine, "warm_up_left", 0):
            return
        with self.generations_lock:  # two generations ending at once start one finisher
            if self.finisher is not None and self.finisher.is_alive():
                return
            self.finisher = threading.Thread(target=self._finish_warm_up, name="finish_warm_up", daemon=True)
            self.finisher.start()

    def _finish_warm_up(self) -> None:
        with self.engine_lock, self._holding_for_warm_up():
            if self._generation_waits():
                return  # the next generation's end tries again
            try:
                stats = self.engine.finish_warm_up(stop=self._generation_waits)
            except Exception:
                self.finish_failed = True
                log.warning(
                    "rollout engine %d: finishing the warm-up failed; a batch compiles what it needs",
                    self.index,
                    exc_info=True,
                )
                return
        if stats["complete"]:
            log.info(
                "rollout engine %d: finished the warm-up that a generation cut short (the last part in %.1f s)",
                self.index,
                stats["seconds"],
            )


def _nbytes(tree: Any) -> float:
    """The bytes of a params tree's arrays (host or device: a device array is not copied to host to count)."""
    leaves = flatten_params(tree).values()
    return float(sum(leaf.nbytes if hasattr(leaf, "nbytes") else np.asarray(leaf).nbytes for leaf in leaves))
