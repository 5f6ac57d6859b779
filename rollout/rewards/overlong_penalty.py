"""DAPO's soft overlong punishment (Yu et al. 2025, "DAPO: An Open-Source LLM Reinforcement Learning System at
Scale", eq. 13).

With ``L_max`` the maximum completion length and ``L_cache`` the punishment interval, a completion of ``|y|``
tokens gets

    R_length(y) = 0                                  if |y| <= L_max - L_cache
                  ((L_max - L_cache) - |y|) / L_cache  if L_max - L_cache < |y| <= L_max
                  -1                                 if |y| > L_max

which is added to the correctness reward (give it weight 1 in a weighted sum). DAPO used L_max = 20480,
L_cache = 4096 (with 16384 "expected" tokens). A completion cut at the engine's ``max_new_tokens`` has
``|y| = L_max`` and gets -1 when ``max_length`` is set to ``max_new_tokens``.

The length is counted in tokens, which a reward that sees only text cannot know: the scorer puts it in each
example under :data:`COMPLETION_LENGTH_KEY` (``RewardScorer.score(..., completion_lengths=...)``).
"""

from __future__ import annotations

from typing import Any

COMPLETION_LENGTH_KEY = "completion_length"


def dapo_overlong_penalty(length: int, *, max_length: int, cache_length: int) -> float:
    """The soft overlong penalty of one completion, in [-1, 0].

    Args:
      length: the completion length in tokens, ``|y|``.
      max_length: ``L_max``, the length at (and beyond) which the penalty is -1.
      cache_length: ``L_cache``, the width of the linear ramp before ``max_length``; ``0 < cache_length <=
        max_length``.

    Returns:
      0 up to ``max_length - cache_length`` tokens, then linear down to -1 at ``max_length``, -1 beyond.

    Raises:
      ValueError: on a negative length or an invalid ``cache_length``.
    """
    if not 0 < cache_length <= max_length:
        raise ValueError(f"need 0 < cache_length <= max_length, got cache_length={cache_length}, {max_length=}")
    if length < 0:
        raise ValueError(f"completion length must be >= 0, got {length}")
    expected = max_length - cache_length
    if length <= expected:
        return 0.0
    if length <= max_length:
        return (expected - length) / cache_length
    return -1.0


def dapo_overlong_reward(
    prompt: str,
    completion: str,
    example: dict[str, Any],
    *,
    max_length: int,
    cache_length: int,
    length_key: str = COMPLETION_LENGTH_KEY,
) -> float:
    """:func:`dapo_overlong_penalty` as a reward; the token length comes from ``example[length_key]``.

    Args:
      prompt: unused.
      completion: unused (the length is in tokens, not characters).
      example: the data row; ``example[length_key]`` is the completion length in tokens, which
        ``RewardScorer.score(..., completion_lengths=...)`` fills in.
      max_length: ``L_max`` (usually the engine's ``max_new_tokens``).
      cache_length: ``L_cache``.
      length_key: the field holding the token length.

    Returns:
      The penalty in [-1, 0].

    Raises:
      KeyError: when the example has no ``length_key`` field.
    """
    del prompt, completion
    if length_key not in example:
        raise KeyError(
            f"example has no token length field {length_key!r}: pass completion_lengths to RewardScorer.score"
        )
    return dapo_overlong_penalty(int(example[length_key]), max_length=max_length, cache_length=cache_length)
