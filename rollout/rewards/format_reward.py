"""Format reward: is the completion laid out in the expected tags?

Used by DeepSeek-R1 (DeepSeek-AI 2025, "DeepSeek-R1: Incentivizing Reasoning Capability in LLMs via Reinforcement
Learning") next to the accuracy reward to teach ``<think>...</think><answer>...</answer>``. The layout is a regular
expression matched against the WHOLE completion; the presets require well-formed tags: exactly one block of each,
no nested or stray tags of the same name, a non-blank answer.
"""

from __future__ import annotations

import re
from typing import Any


def _block(tag: str, *, nonblank: bool = False) -> str:
    """Regex of one ``<tag>...</tag>`` block whose content holds no other ``<tag>`` or ``</tag>``."""
    guard = rf"(?!\s*</{tag}>)" if nonblank else ""
    return rf"<{tag}>{guard}(?:(?!</?{tag}>).)*</{tag}>"


_NO_ANSWER_TAG = r"(?:(?!</?answer>).)*"

FORMAT_PATTERNS: dict[str, str] = {
    # "<think>reasoning</think> <answer>final</answer>", nothing else around it but whitespace.
    "think_answer": rf"\s*{_block('think')}\s*{_block('answer', nonblank=True)}\s*",
    # Free text, then exactly one non-blank "<answer>...</answer>" block ending the completion.
    "answer": rf"{_NO_ANSWER_TAG}{_block('answer', nonblank=True)}\s*",
}


def format_reward(
    prompt: str,
    completion: str,
    example: dict[str, Any],
    *,
    pattern: str = "think_answer",
) -> float:
    """Scores 1.0 when the whole completion matches the layout ``pattern``, else 0.0.

    Args:
      prompt: unused.
      completion: the generated text.
      example: unused.
      pattern: a preset name from :data:`FORMAT_PATTERNS` (``"think_answer"``, ``"answer"``) or a regular
        expression, matched with ``re.fullmatch`` and ``re.DOTALL``.

    Returns:
      1.0 or 0.0.
    """
    del prompt, example
    regex = FORMAT_PATTERNS.get(pattern, pattern)
    return float(re.fullmatch(regex, completion, flags=re.DOTALL) is not None)
