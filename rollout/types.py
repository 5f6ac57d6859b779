"""The data types every rollout engine shares: sampling settings, the `Rollouts` record and the engine `Protocol`.

An engine turns prompts (token ids) into sampled completions. Whatever engine produced them (the native JAX
engine, vLLM), the trainer receives the same `Rollouts` record: one row per sample, rows of one prompt
consecutive, every per-token array aligned with `completion_ids`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np

# Finish reasons stored in `Rollouts.finish_reason`.
FINISH_STOP = 0
FINISH_LENGTH = 1


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How to sample completions.

    The sampling distribution of every token is built in this order: logits are divided by `temperature`; stop
    tokens are masked while fewer than `min_new_tokens` tokens were generated; only the `top_k` most likely
    tokens are kept; only the smallest most-likely set whose probability reaches `top_p` is kept; the result is
    renormalised. Engines report each token's log-probability under exactly that distribution.

    Attributes:
      temperature: softmax temperature, > 0. Also used for the reported log-probabilities when `greedy`.
      top_k: keep the k most likely tokens; 0 turns top-k off.
      top_p: nucleus sampling mass in (0, 1]; 1.0 turns top-p off.
      greedy: take the most likely token (argmax); `top_k`, `top_p` and `seed` are then ignored.
      max_new_tokens: completion length cap, >= 1; a completion that reaches it finishes with reason "length".
      min_new_tokens: stop tokens cannot be sampled before this many tokens were generated (0 <= it <=
        `max_new_tokens`). Stop strings are not checked before it either.
      stop_token_ids: a completion ends (reason "stop") right after sampling one of these ids; the stop token is
        part of the completion. Include the tokenizer's EOS id here: engines add nothing on their own.
      stop_strings: a completion ends once its decoded text contains one of these strings; it is truncated after
        the token that completed the string.
      n: samples per prompt (a GRPO group), >= 1.
      seed: base of every random draw; the same seed, prompts and params give the same rollouts.
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    greedy: bool = False
    max_new_tokens: int = 128
    min_new_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    stop_strings: tuple[str, ...] = ()
    n: int = 1
    seed: int = 0

    def __post_init__(self):
        # Lists are accepted for convenience and stored as tuples so the record stays hashable.
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        object.__setattr__(self, "stop_strings", tuple(self.stop_strings))
        _check(
            isinstance(self.temperature, int | float) and math.isfinite(self.temperature) and self.temperature > 0,
            "temperature",
            f"must be a finite number > 0, got {self.temperature!r}",
        )
        _check(_is_int(self.top_k) and self.top_k >= 0, "top_k", f"must be an int >= 0 (0 = off), got {self.top_k!r}")
        _check(
            isinstance(self.top_p, int | float) and 0.0 < self.top_p <= 1.0,
            "top_p",
            f"must be in (0, 1] (1 = off), got {self.top_p!r}",
        )
        _check(isinstance(self.greedy, bool), "greedy", f"must be a bool, got {self.greedy!r}")
        _check(
            _is_int(self.max_new_tokens) and self.max_new_tokens >= 1,
            "max_new_tokens",
            f"must be an int >= 1, got {self.max_new_tokens!r}",
        )
        _check(
            _is_int(self.min_new_tokens) and 0 <= self.min_new_tokens <= self.max_new_tokens,
            "min_new_tokens",
            f"must be an int in [0, max_new_tokens={self.max_new_tokens}], got {self.min_new_tokens!r}",
        )
        for token in self.stop_token_ids:
            _check(_is_int(token) and token >= 0, "stop_token_ids", f"must hold ints >= 0, got {token!r}")
        for text in self.stop_strings:
            _check(isinstance(text, str) and text, "stop_strings", f"must hold non-empty strings, got {text!r}")
        _check(_is_int(self.n) and self.n >= 1, "n", f"must be an int >= 1, got {self.n!r}")
        _check(
            _is_int(self.seed) and 0 <= self.seed < 2**32, "seed", f"must be an int in [0, 2**32), got {self.seed!r}"
        )


def _is_int(value: Any) -> bool:
    return isinstance(value, int | np.integer) and not isinstance(value, bool)


def _check(ok: bool, field: str, message: str) -> None:
    if not ok:
        raise ValueError(f"SamplingParams.{field} {message}")


@dataclasses.dataclass(frozen=True)
class Rollouts:
    """Sampled completions, one row per sample; the `n` rows of one prompt are consecutive.

    Attributes:
      prompt_ids: `[N, P]` int32, right-padded with the pad id.
      prompt_lengths: `[N]` int32, real tokens in each `prompt_ids` row.
      completion_ids: `[N, C]` int32, right-padded with the pad id (C = `max_new_tokens`).
      completion_mask: `[N, C]` float32, 1 on generated tokens (the stop token included), 0 on padding.
      behavior_logprobs: `[N, C]` float32, log-probability of each generated token under the exact sampling
        distribution used (temperature, min-new-tokens masking, top-k and top-p applied); 0 on padding.
      finish_reason: `[N]` int32, `FINISH_STOP` (0) or `FINISH_LENGTH` (1).
      group_id: `[N]` int32, index of the row's prompt in the `generate` call.
      policy_version: `[N]` int32, version of the params (`load_params`) that sampled the row.
    """

    prompt_ids: np.ndarray
    prompt_lengths: np.ndarray
    completion_ids: np.ndarray
    completion_mask: np.ndarray
    behavior_logprobs: np.ndarray
    finish_reason: np.ndarray
    group_id: np.ndarray
    policy_version: np.ndarray

    def __post_init__(self):
        n = self.prompt_ids.shape[0]
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if value.shape[0] != n:
                raise ValueError(f"Rollouts.{field.name} has {value.shape[0]} rows, prompt_ids has {n}")
        c = self.completion_ids.shape
        for name in ("completion_mask", "behavior_logprobs"):
            if getattr(self, name).shape != c:
                raise ValueError(f"Rollouts.{name} has shape {getattr(self, name).shape}, completion_ids has {c}")

    @property
    def completion_lengths(self) -> np.ndarray:
        """`[N]` int32: generated tokens per row."""
        return self.completion_mask.sum(axis=1).astype(np.int32)

    def completions(self) -> list[list[int]]:
        """The completions as lists of token ids, padding removed."""
        return [row[:length].tolist() for row, length in zip(self.completion_ids, self.completion_lengths)]


def assemble_rollouts(
    prompts: Sequence[Sequence[int]],
    rows: Sequence[tuple[int, int]],
    completions: Sequence[Sequence[int]],
    logprobs: Sequence[Sequence[float]],
    finish_reason: np.ndarray,
    *,
    width: int,
    pad_id: int,
    policy_version: int,
) -> Rollouts:
    """Pads the per-row outputs of an engine into a `Rollouts` record (shared by every engine).

    Args:
      prompts: the prompts of the `generate` call (token ids).
      rows: `(prompt index, sample index)` of each output row; rows of one prompt are consecutive.
      completions: each row's generated token ids.
      logprobs: each row's behaviour log-probabilities, one per generated token.
      finish_reason: `[N]` int32, `FINISH_STOP` or `FINISH_LENGTH` per row.
      width: the completion width C (`max_new_tokens`).
      pad_id: the id written on padding.
      policy_version: the params version that sampled every row.
    """
    num = len(rows)
    prompt_ids = np.full((num, max(len(p) for p in prompts)), pad_id, np.int32)
    prompt_lengths = np.zeros(num, np.int32)
    completion_ids = np.full((num, width), pad_id, np.int32)
    mask = np.zeros((num, width), np.float32)
    behavior = np.zeros((num, width), np.float32)
    for r, (p, _) in enumerate(rows):
        prompt_ids[r, : len(prompts[p])] = prompts[p]
        prompt_lengths[r] = len(prompts[p])
        length = len(completions[r])
        completion_ids[r, :length] = completions[r]
        mask[r, :length] = 1.0
        behavior[r, :length] = logprobs[r]
    return Rollouts(
        prompt_ids=prompt_ids,
        prompt_lengths=prompt_lengths,
        completion_ids=completion_ids,
        completion_mask=mask,
        behavior_logprobs=behavior,
        finish_reason=np.asarray(finish_reason, np.int32),
        group_id=np.array([p for p, _ in rows], np.int32),
        policy_version=np.full(num, policy_version, np.int32),
    )


@runtime_checkable
class RolloutEngine(Protocol):
    """What the RL loop needs from a rollout engine (native JAX, vLLM, ...)."""

    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams) -> Rollouts:
        """Samples `sampling.n` completions for each prompt (token ids, no padding)."""
        ...

    def load_params(self, params: Any, version: int) -> None:
        """Replaces the policy params; later rollouts carry `policy_version == version`."""
        ...
