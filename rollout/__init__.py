"""Rollouts: sampling settings, the `Rollouts` record, the engine `Protocol`, the native JAX engine, rewards.

`SamplingParams`, `Rollouts`, `RolloutEngine` (types.py) import only numpy. `NativeEngine` (native_engine.py,
JAX and `feynrl_jax.models`) is imported on first access, so `feynrl_jax.rollout.rewards` worker processes do
not pay for JAX.
"""

from feynrl_jax.rollout.types import FINISH_LENGTH, FINISH_STOP, RolloutEngine, Rollouts, SamplingParams

__all__ = ["FINISH_LENGTH", "FINISH_STOP", "NativeEngine", "RolloutEngine", "Rollouts", "SamplingParams"]


def __getattr__(name: str):
    if name == "NativeEngine":
        from feynrl_jax.rollout.native_engine import NativeEngine

        return NativeEngine
    raise AttributeError(f"module 'feynrl_jax.rollout' has no attribute {name!r}")
