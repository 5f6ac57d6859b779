"""The reward registry: names and ``"module:function"`` strings resolved to reward callables.

A reward is any callable ``(prompt: str, completion: str, example: dict) -> float``. It is known to the rest of the
system by a string, which is either

- a registered name: a built-in (``"math_verify"``, ``"gsm8k"``, ``"reasoning_gym"``, ``"format"``,
  ``"dapo_overlong"``, ``"latency"``) or one added with the :func:`register_reward` decorator, or
- an import path ``"package.module:function"`` (``"package.module:Class.attribute"`` also works), imported with
  :mod:`importlib` when resolved.

Built-in rewards are registered lazily, as import paths, so ``import feynrl_jax.rollout.rewards`` stays cheap and
the heavy dependencies (math-verify, sympy, reasoning-gym) are imported only by the processes that use them.

Rewards run in spawned worker processes (see :mod:`feynrl_jax.rollout.rewards.process_pool`), where they arrive by
pickling, i.e. by module and qualified name: a reward must be a module-level function (or a picklable object such
as a :func:`functools.partial` of one), never a lambda or a closure.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any, Protocol


class RewardFn(Protocol):
    """A reward: ``(prompt, completion, example) -> float``.

    ``example`` is the data row the prompt came from (gold answer, metadata, ...); rewards read the fields they
    need from it and never modify it.
    """

    def __call__(self, prompt: str, completion: str, example: dict[str, Any]) -> float: ...


_PACKAGE = "feynrl_jax.rollout.rewards"

# Built-in rewards, by name, as lazy import paths.
_BUILTIN_REWARDS: dict[str, str] = {
    "math_verify": f"{_PACKAGE}.math_answer:math_verify_reward",
    "gsm8k": f"{_PACKAGE}.gsm8k:gsm8k_reward",
    "reasoning_gym": f"{_PACKAGE}.reasoning_gym_reward:reasoning_gym_reward",
    "format": f"{_PACKAGE}.format_reward:format_reward",
    "dapo_overlong": f"{_PACKAGE}.overlong_penalty:dapo_overlong_reward",
    "latency": f"{_PACKAGE}.latency:latency_reward",
}

# Rewards registered at run time with `register_reward`.
_REGISTERED_REWARDS: dict[str, RewardFn] = {}


def register_reward(name: str) -> Callable[[RewardFn], RewardFn]:
    """Registers a reward under ``name`` (a decorator); the function is returned unchanged.

    Args:
      name: the registry name; must not contain ``":"`` (that marks an import path) or ``"/"`` (it becomes part
        of metric names), and must not be taken already.

    Returns:
      The decorator.

    Raises:
      ValueError: on a malformed or already registered name.
    """
    if not name or ":" in name or "/" in name:
        raise ValueError(f"reward name {name!r} must be non-empty and contain neither ':' nor '/'")
    if name in _BUILTIN_REWARDS or name in _REGISTERED_REWARDS:
        raise ValueError(f"reward name {name!r} is already registered")

    def decorator(fn: RewardFn) -> RewardFn:
        if not callable(fn):
            raise TypeError(f"reward {name!r}: {fn!r} is not callable")
        _REGISTERED_REWARDS[name] = fn
        return fn

    return decorator


def available_rewards() -> list[str]:
    """Returns every registered reward name (built-in and user-registered), sorted."""
    return sorted({*_BUILTIN_REWARDS, *_REGISTERED_REWARDS})


def _import_path(path: str) -> Any:
    """Imports ``"module:attr.attr"`` and returns the attribute, with errors that name ``path``."""
    module_name, sep, attr_path = path.partition(":")
    if not sep or not module_name or not attr_path:
        raise ValueError(f"reward {path!r}: an import path must look like 'package.module:function'")
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"reward {path!r}: cannot import module {module_name!r}: {e}") from e
    for attr in attr_path.split("."):
        try:
            obj = getattr(obj, attr)
        except AttributeError as e:
            raise ValueError(f"reward {path!r}: module {module_name!r} has no attribute {attr_path!r}") from e
    return obj


def resolve_reward(spec: str | RewardFn) -> RewardFn:
    """Turns a reward name, an import path or a callable into the reward callable.

    Args:
      spec: a registered name (``"math_verify"``), an import path (``"my_pkg.rewards:exact_match"``) or a
        callable, which is returned as is.

    Returns:
      The reward callable.

    Raises:
      ValueError: for an unknown name, an import path whose module or attribute does not exist (the message names
        the string).
      TypeError: when the resolved object is not callable.
    """
    if not isinstance(spec, str):
        if not callable(spec):
            raise TypeError(f"reward {spec!r} is neither a string nor a callable")
        return spec
    if ":" in spec:
        fn = _import_path(spec)
    elif spec in _REGISTERED_REWARDS:
        fn = _REGISTERED_REWARDS[spec]
    elif spec in _BUILTIN_REWARDS:
        fn = _import_path(_BUILTIN_REWARDS[spec])
    else:
        raise ValueError(
            f"unknown reward {spec!r}: use one of {available_rewards()} or an import path 'package.module:function'"
        )
    if not callable(fn):
        raise TypeError(f"reward {spec!r} resolved to {type(fn).__name__} {fn!r}, which is not callable")
    return fn
