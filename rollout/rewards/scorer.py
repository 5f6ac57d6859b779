"""The entry point the RL loops call: score a batch of completions with a weighted sum of rewards.

Every reward runs in the :class:`~feynrl_jax.rollout.rewards.process_pool.TimeoutProcessPool` (uniformly safe:
``math_verify_reward``'s ``SIGALRM`` bound needs a process's main thread, and any reward may hang); a timeout or an
exception (a failed call) scores 0 for that reward on that item, is counted in the metrics and logged (one line per
reward and batch, with its first error). A reward that fails on more than ``max_failure_frac`` of a batch's items
raises :class:`RewardError` naming the reward, the fraction and its first error with the item's data row: training
on its zeros would give zero advantages and learn nothing (e.g. data without the ``answer`` field the reward reads).

Metrics (namespace ``rollout/``), per reward ``<name>`` (the spec string) and for the weighted ``total``:
``rollout/reward/<name>/{mean,std,min,max}``; per reward also ``.../timeouts`` and ``.../errors`` (counts in this
batch) and ``.../failed_frac`` (their sum over the batch size); ``rollout/reward_failed_frac`` (failed calls over
all calls of the batch, every reward); and ``perf/reward/seconds`` (wall time of the call).

Workers are spawned: a script that builds a scorer must guard its entry point with ``if __name__ == "__main__":``
(the spawn method re-imports the main module in every worker), and rewards must be importable module-level
functions. Workers import only the reward modules they run (math-verify, reasoning-gym), not JAX.
"""

from __future__ import annotations

import inspect
import logging
import math
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from feynrl_jax.errors import InputError
from feynrl_jax.rollout.rewards.overlong_penalty import COMPLETION_LENGTH_KEY
from feynrl_jax.rollout.rewards.process_pool import STATUS_ERROR, STATUS_OK, STATUS_TIMEOUT, TimeoutProcessPool
from feynrl_jax.rollout.rewards.weighted_sum import bind_reward

logger = logging.getLogger(__name__)

TOTAL = "total"


class RewardError(InputError):
    """A reward failed (raised or timed out) on more than the allowed fraction of a batch; exit code 2."""


def _check_signature(name: str, fn: Any) -> None:
    """Fails early when a reward cannot be called as ``fn(prompt, completion, example)`` (e.g. missing kwargs)."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return  # Builtins and some C callables have no signature; nothing to check.
    try:
        signature.bind("prompt", "completion", {})
    except TypeError as e:
        raise ValueError(
            f"reward {name!r} cannot be called as (prompt, completion, example): {e} "
            f"(pass its required keyword arguments in reward_kwargs[{name!r}])"
        ) from e


class RewardScorer:
    """Scores (prompt, completion, example) triples with ``sum_k weight_k * reward_k`` in a worker pool.

    Example::

        with RewardScorer({"math_verify": 1.0, "format": 0.1}, timeout_s=5.0, num_workers=4) as scorer:
            rewards, per_reward, metrics = scorer.score(prompts, completions, examples)
    """

    def __init__(
        self,
        specs: Mapping[str, float],
        *,
        reward_kwargs: Mapping[str, Mapping[str, Any]] | None = None,
        timeout_s: float = 10.0,
        num_workers: int = 2,
        mp_context: str = "spawn",
        max_failure_frac: float = 1.0,
    ):
        """Resolves the rewards and starts the worker pool.

        Args:
          specs: reward spec -> weight. A spec is a registered name (``"math_verify"``, ``"gsm8k"``,
            ``"reasoning_gym"``, ``"format"``, ``"dapo_overlong"``, or one added with ``register_reward``) or an
            import path ``"package.module:function"``. Weights are finite floats (0 computes and logs a reward
            without training on it).
          reward_kwargs: reward spec -> keyword arguments for it (``{"math_verify": {"answer_key": "solution"},
            "dapo_overlong": {"max_length": 1024, "cache_length": 256}}``).
          timeout_s: the bound on one reward call on one item, in seconds.
          num_workers: worker processes.
          mp_context: ``"spawn"`` (default) or ``"forkserver"``.
          max_failure_frac: in [0, 1]; :meth:`score` raises :class:`RewardError` when one reward fails on more
            than this fraction of a batch's items (the RL loop passes ``rollout.max_reward_failure_frac``).
            1 never raises (evaluation).

        Raises:
          ValueError: on no rewards, a reserved or unknown reward name, a bad import path, a non-finite weight,
            kwargs for a reward not in ``specs``, a reward whose required arguments are missing, or
            ``max_failure_frac`` outside [0, 1].
          TypeError: when a reward is not callable or not picklable.
        """
        if not specs:
            raise ValueError("RewardScorer needs at least one reward in specs")
        if not 0.0 <= max_failure_frac <= 1.0:
            raise ValueError(f"max_failure_frac must be in [0, 1], got {max_failure_frac!r}")
        reward_kwargs = dict(reward_kwargs or {})
        for name in reward_kwargs:
            if name not in specs:
                raise ValueError(f"reward_kwargs names reward {name!r}, which is not among specs {sorted(specs)}")
        self.names: list[str] = []
        self.weights = np.zeros(len(specs), np.float64)
        functions = []
        for i, (name, weight) in enumerate(specs.items()):
            if name == TOTAL:
                raise ValueError(f"reward name {TOTAL!r} is reserved for the weighted sum's metrics")
            if not isinstance(weight, int | float) or not math.isfinite(weight):
                raise ValueError(f"weight of reward {name!r} must be a finite number, got {weight!r}")
            fn = bind_reward(name, reward_kwargs.get(name))
            _check_signature(name, fn)
            self.names.append(name)
            self.weights[i] = float(weight)
            functions.append(fn)
        self.timeout_s = float(timeout_s)
        self.max_failure_frac = float(max_failure_frac)
        self.last_errors: list[tuple[int, str, str]] = []
        """``(item, reward name, message)`` of every failed call of the last batch (the example errors)."""
        self._pool = TimeoutProcessPool(functions, num_workers=num_workers, timeout_s=timeout_s, mp_context=mp_context)

    @property
    def worker_pids(self) -> list[int]:
        """Process ids of the current worker processes."""
        return self._pool.worker_pids

    def close(self) -> None:
        """Stops the worker processes; idempotent."""
        self._pool.close()

    def __enter__(self) -> RewardScorer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def score(
        self,
        prompts: Sequence[str],
        completions: Sequence[str],
        examples: Sequence[Mapping[str, Any]],
        *,
        completion_lengths: Sequence[int] | np.ndarray | None = None,
    ) -> tuple[np.ndarray, dict[str, np.ndarray], dict[str, float]]:
        """Scores N completions.

        Args:
          prompts: N prompt strings.
          completions: N completion strings (decoded, without the prompt).
          examples: N data rows (dicts); row i is the example prompt i came from (the n samples of one prompt
            share it). They are not modified.
          completion_lengths: optional ``[N]`` token counts of the completions; each reward then sees them as
            ``example["completion_length"]`` (the DAPO overlong penalty needs them).

        Returns:
          ``(rewards, per_reward, metrics)``: ``rewards [N]`` float32, the weighted sum; ``per_reward`` maps each
          reward name to its unweighted ``[N]`` float32 values (0 where it failed or timed out); ``metrics`` maps
          metric names (see the module docstring) to floats.

        Raises:
          ValueError: when the lengths disagree or an example is not a mapping (naming the row).
          RewardError: a reward failed on more than ``max_failure_frac`` of the items.
        """
        start = time.perf_counter()
        n = len(prompts)
        if len(completions) != n or len(examples) != n:
            raise ValueError(
                f"prompts, completions and examples must have one entry per item, "
                f"got {n}, {len(completions)}, {len(examples)}"
            )
        if completion_lengths is not None and len(completion_lengths) != n:
            raise ValueError(f"completion_lengths has {len(completion_lengths)} entries for {n} items")
        rows = []
        for i in range(n):
            if not isinstance(examples[i], Mapping):
                raise ValueError(f"example of row {i} must be a mapping, got {type(examples[i]).__name__}")
            if not isinstance(prompts[i], str) or not isinstance(completions[i], str):
                raise ValueError(f"prompt and completion of row {i} must be strings")
            example = dict(examples[i])
            if completion_lengths is not None:
                example[COMPLETION_LENGTH_KEY] = int(completion_lengths[i])
            rows.append((prompts[i], completions[i], example))

        result = self._pool.map(rows)
        errors = sorted(result.errors)  # the pool lists them in the order the workers finished
        self.last_errors = [(row, self.names[index], message) for row, index, message in errors]
        failed = result.status != STATUS_OK  # [N, K]
        for i, name in enumerate(self.names):
            if failed[:, i].any():
                self._check_failures(name, i, failed[:, i], errors, examples)

        total = result.values @ self.weights if n else np.zeros(0)
        per_reward = {name: result.values[:, i].astype(np.float32) for i, name in enumerate(self.names)}
        metrics: dict[str, float] = {}
        for i, name in enumerate(self.names):
            metrics.update(_summary(f"rollout/reward/{name}", result.values[:, i]))
            metrics[f"rollout/reward/{name}/timeouts"] = float(np.sum(result.status[:, i] == STATUS_TIMEOUT))
            metrics[f"rollout/reward/{name}/errors"] = float(np.sum(result.status[:, i] == STATUS_ERROR))
            metrics[f"rollout/reward/{name}/failed_frac"] = float(np.mean(failed[:, i])) if n else 0.0
        metrics["rollout/reward_failed_frac"] = float(np.mean(failed)) if n else 0.0
        metrics.update(_summary(f"rollout/reward/{TOTAL}", total))
        metrics["perf/reward/seconds"] = time.perf_counter() - start
        return total.astype(np.float32), per_reward, metrics

    def _check_failures(
        self,
        name: str,
        index: int,
        failed: np.ndarray,
        errors: list[tuple[int, int, str]],
        examples: Sequence[Mapping[str, Any]],
    ) -> None:
        """Logs one line for reward ``name``'s failed calls (``failed [N]``); raises when they are too many.

        ``errors`` are the batch's ``(item, reward index, message)``, sorted; the first of this reward is quoted.
        """
        row, message = next((r, m) for r, k, m in errors if k == index)
        count = f"reward {name!r} failed on {int(failed.sum())}/{failed.size} completions"
        first = f"first error, row {row}{_data_row(examples[row])}: {message}"
        if failed.mean() > self.max_failure_frac:
            raise RewardError(f"{count} (limit rollout.max_reward_failure_frac={self.max_failure_frac:g}); {first}")
        logger.warning("%s; %s", count, first)


def _data_row(example: Mapping[str, Any]) -> str:
    """`` (data.sources.<source>, row <r>)`` when the example carries the mixture's ``source`` and ``row``."""
    if "source" in example and "row" in example:
        return f" (data.sources.{example['source']}, row {example['row']})"
    return ""


def _summary(prefix: str, values: np.ndarray) -> dict[str, float]:
    """Mean, std, min and max of ``values [N]`` under ``prefix`` (NaN for an empty batch)."""
    if values.size == 0:
        return {f"{prefix}/{stat}": math.nan for stat in ("mean", "std", "min", "max")}
    return {
        f"{prefix}/mean": float(np.mean(values)),
        f"{prefix}/std": float(np.std(values)),
        f"{prefix}/min": float(np.min(values)),
        f"{prefix}/max": float(np.max(values)),
    }
