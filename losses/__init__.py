"""feynrl_jax.losses: every algorithm as a pure, model-free, jittable function of arrays.

Imports only jax, numpy, chex and the standard library. See losses/README.md for the table of algorithms.

The names below are loaded when first read (PEP 562), so `feynrl_jax.losses.registry` (plain data: what the config
layer validates against) imports without JAX; `from feynrl_jax.losses import grpo_loss` works as usual.
"""

from __future__ import annotations

import importlib
from typing import Any

# Public name -> the submodule that defines it (a submodule itself maps to None).
_EXPORTS: dict[str, str | None] = {
    "advantages": None,
    "aggregation": None,
    "kl": None,
    "off_policy": None,
    "sequences": None,
    "value": None,
    "registry": None,
    "AGGREGATIONS": "aggregation",
    "LossSum": "aggregation",
    "aggregate": "aggregation",
    "TrainBatch": "batch",
    "cispo_loss": "cispo",
    "dpo_loss": "dpo",
    "ipo_loss": "dpo",
    "grpo_loss": "grpo",
    "gspo_loss": "gspo",
    "KL_ESTIMATORS": "kl",
    "k1": "kl",
    "k2": "kl",
    "k3": "kl",
    "kl_estimate": "kl",
    "kl_reward_penalty": "kl",
    "Metric": "metrics",
    "combine_metrics": "metrics",
    "compute_metrics": "metrics",
    "p3o_loss": "p3o",
    "ppo_loss": "ppo",
    "ALGORITHMS": "registry",
    "Algorithm": "registry",
    "get_algorithm": "registry",
    "register_algorithm": "registry",
    "sft_loss": "sft",
    "clipped_value_error": "value",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module = _EXPORTS[name]
    if module is None:
        return importlib.import_module(f"{__name__}.{name}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
