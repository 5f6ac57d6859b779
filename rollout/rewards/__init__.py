"""Rewards: callables ``(prompt, completion, example) -> float``, a registry, and a process-pool scorer.

Built-in rewards (registered names, imported lazily): ``math_verify`` (math-verify answer verification),
``gsm8k`` (last ``####`` number, exact), ``reasoning_gym`` (the task's own scorer), ``format`` (answer tags),
``dapo_overlong`` (DAPO's soft overlong penalty), ``latency`` (waits like a remote judge, scores 0).
:class:`RewardScorer` runs a weighted sum of them in worker
processes with a per-call timeout and returns per-reward metrics; a reward that fails on too much of a batch
raises :class:`RewardError` (an ``InputError``, exit code 2). A reward whose own time bound fires raises
:class:`RewardTimeout`, which the scorer counts as a timeout.

This package imports neither ``feynrl_jax.losses`` nor ``ray`` nor ``torch``; of the rest of the package, only
``feynrl_jax.errors``.
"""

from feynrl_jax.rollout.rewards.answer_extraction import (
    after_last_gsm8k_marker,
    last_boxed_content,
    last_nonempty_line,
    last_number,
    last_tag_content,
    parse_number,
)
from feynrl_jax.rollout.rewards.format_reward import FORMAT_PATTERNS, format_reward
from feynrl_jax.rollout.rewards.gsm8k import gsm8k_reward
from feynrl_jax.rollout.rewards.overlong_penalty import (
    COMPLETION_LENGTH_KEY,
    dapo_overlong_penalty,
    dapo_overlong_reward,
)
from feynrl_jax.rollout.rewards.process_pool import PoolResult, RewardTimeout, TimeoutProcessPool
from feynrl_jax.rollout.rewards.registry import RewardFn, available_rewards, register_reward, resolve_reward
from feynrl_jax.rollout.rewards.scorer import RewardError, RewardScorer
from feynrl_jax.rollout.rewards.weighted_sum import WeightedSum, bind_reward

__all__ = [
    "COMPLETION_LENGTH_KEY",
    "FORMAT_PATTERNS",
    "PoolResult",
    "RewardError",
    "RewardFn",
    "RewardScorer",
    "RewardTimeout",
    "TimeoutProcessPool",
    "WeightedSum",
    "after_last_gsm8k_marker",
    "available_rewards",
    "bind_reward",
    "dapo_overlong_penalty",
    "dapo_overlong_reward",
    "format_reward",
    "gsm8k_reward",
    "last_boxed_content",
    "last_nonempty_line",
    "last_number",
    "last_tag_content",
    "parse_number",
    "register_reward",
    "resolve_reward",
]
