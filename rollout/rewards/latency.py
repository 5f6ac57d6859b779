"""A reward that only waits: the latency of a remote judge or a code sandbox, without the judge.

Real RL rewards are often latency-bound (a sandbox that runs the program, an LLM judge behind an API): the
scorer's processes sit idle while the batch waits for answers. Add this reward with weight 0 next to the real
one to give a run that latency and see how much of it async RL (`train.max_staleness >= 1`) hides:

    --config.rollout.rewards='{"gsm8k": 1.0, "latency": 0.0}'
    rollout.reward_kwargs = {"latency": {"delay_s": 0.05}}    # seconds per completion

With `rollout.reward_workers = w` processes, a batch of N completions waits about `N * delay_s / w` seconds.
"""

from __future__ import annotations

import time
from typing import Any


def latency_reward(prompt: str, completion: str, example: dict[str, Any], *, delay_s: float = 0.05) -> float:
    """Sleeps `delay_s` seconds and returns 0.0 (use it with weight 0 beside the reward that scores).

    Raises:
        ValueError: when `delay_s` is negative or not finite.
    """
    del prompt, completion, example
    if not 0.0 <= delay_s < float("inf"):
        raise ValueError(f"latency reward: delay_s must be a finite number >= 0, got {delay_s!r}")
    time.sleep(delay_s)
    return 0.0
