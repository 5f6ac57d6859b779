"""The entry point the RL loops call: score a batch of completions with a weighted sum of rewards.

Every reward runs in the :class:`~feynrl_jax.rollout.rewards.process_pool.TimeoutProcessPool` (uniformly safe:
math-verify's ``signal.alarm`` needs a process's main thread, and any reward may hang); a timeout or an exception
scores 0 for that reward on that item and is counted in the metrics, never raised.

Metrics (namespace ``rollout/``), per reward ``<name>`` (the spec string) and for the weighted ``total``:
``rollout/reward/<name>/{mean,std,min,max}``; per reward also ``.../timeouts`` and ``.../errors`` (counts in this
batch); and ``perf/reward/seconds`` (wall time of the call).

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

from feynrl_jax.rollout.rewards.overlong_penalty import COMPLETION_LENGTH_KEY
from feynrl_jax.rollout.rewards.process_pool import STATUS_ERROR, STATUS_TIMEOUT, TimeoutProcessPool
from feynrl_jax.rollout.rewards.weighted_sum import bind_reward

logger = logging.getLogger(__name__)

TOTAL = "total"


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

        Raises:
          ValueError: on no rewards, a reserved or unknown reward name, a bad import path, a non-finite weight,
            kwargs for a reward not in ``specs``, or a reward whose required arguments are missing.
          TypeError: when a reward is not callable or not picklable.
        """
        if not specs:
            raise ValueError("RewardScorer needs at least one reward in specs")
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
        for row, index, message in result.errors[:3]:
            logger.warning("reward %r failed on row %d: %s", self.names[index], row, message)

        total = result.values @ self.weights if n else np.zeros(0)
        per_reward = {name: result.values[:, i].astype(np.float32) for i, name in enumerate(self.names)}
        metrics: dict[str, float] = {}
        for i, name in enumerate(self.names):
            metrics.update(_summary(f"rollout/reward/{name}", result.values[:, i]))
            metrics[f"rollout/reward/{name}/timeouts"] = float(np.sum(result.status[:, i] == STATUS_TIMEOUT))
            metrics[f"rollout/reward/{name}/errors"] = float(np.sum(result.status[:, i] == STATUS_ERROR))
        metrics.update(_summary(f"rollout/reward/{TOTAL}", total))
        metrics["perf/reward/seconds"] = time.perf_counter() - start
        return total.astype(np.float32), per_reward, metrics


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
