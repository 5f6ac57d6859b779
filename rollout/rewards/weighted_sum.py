"""A weighted sum of rewards, as one reward.

``WeightedSum({"math_verify": 1.0, "format": 0.1})`` is itself a reward ``(prompt, completion, example) -> float``:
useful where one callable is expected (evaluation, a nested spec). The
:class:`~feynrl_jax.rollout.rewards.scorer.RewardScorer` forms the same weighted sum itself, from rewards it runs
separately, so each keeps its own metrics and its own timeout.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from typing import Any

from feynrl_jax.rollout.rewards.process_pool import worker_imports as imports_of
from feynrl_jax.rollout.rewards.registry import RewardFn, resolve_reward


def bind_reward(spec: str, kwargs: Mapping[str, Any] | None = None) -> RewardFn:
    """Resolves ``spec`` and binds keyword arguments to it (a picklable :func:`functools.partial`)."""
    fn = resolve_reward(spec)
    return functools.partial(fn, **kwargs) if kwargs else fn


class WeightedSum:
    """The reward ``sum_k weight_k * reward_k(prompt, completion, example)``.

    Picklable when its rewards are (module-level functions), so it runs in worker processes.
    """

    def __init__(
        self,
        weights: Mapping[str, float],
        *,
        reward_kwargs: Mapping[str, Mapping[str, Any]] | None = None,
    ):
        """Builds the sum.

        Args:
          weights: reward spec (registered name or ``"module:function"``) -> weight.
          reward_kwargs: reward spec -> keyword arguments bound to that reward.

        Raises:
          ValueError: on an empty ``weights``, a non-finite weight, or ``reward_kwargs`` for a reward not in
            ``weights``.
        """
        if not weights:
            raise ValueError("WeightedSum needs at least one reward")
        reward_kwargs = dict(reward_kwargs or {})
        for name in reward_kwargs:
            if name not in weights:
                raise ValueError(f"reward_kwargs names reward {name!r}, which is not among {sorted(weights)}")
        self.weights = {}
        self.rewards = {}
        for name, weight in weights.items():
            if not math.isfinite(float(weight)):
                raise ValueError(f"weight of reward {name!r} must be finite, got {weight!r}")
            self.weights[name] = float(weight)
            self.rewards[name] = bind_reward(name, reward_kwargs.get(name))

    @property
    def worker_imports(self) -> tuple[str, ...]:
        """The modules its rewards ask a worker process to import at start-up (``process_pool``)."""
        return tuple(dict.fromkeys(m for fn in self.rewards.values() for m in imports_of(fn)))

    def __call__(self, prompt: str, completion: str, example: dict[str, Any]) -> float:
        """Returns the weighted sum of every reward on this item."""
        return sum(w * float(self.rewards[name](prompt, completion, example)) for name, w in self.weights.items())
