"""GSM8K-style exact numeric answer reward.

GSM8K (Cobbe et al. 2021, "Training Verifiers to Solve Math Word Problems") ends every reference solution with
``#### <number>``; models trained on it learn to end theirs the same way. The reward takes the number after the
LAST ``####`` marker of the completion, drops ``$``, thousands commas and trailing punctuation, and compares it
with the gold number exactly (as fractions: ``3.50 == 3.5``, ``1,000 == 1000``).
"""

from __future__ import annotations

from fractions import Fraction
from typing import Any

from feynrl_jax.rollout.rewards.answer_extraction import after_last_gsm8k_marker, last_number, parse_number


def gold_number(example: dict[str, Any], answer_key: str) -> Fraction:
    """Returns the gold number of ``example[answer_key]`` (a GSM8K solution ending in ``#### n``, or just ``n``).

    Raises:
      KeyError: when the example has no ``answer_key`` field.
      ValueError: when the gold answer holds no number (naming the key and the value).
    """
    if answer_key not in example:
        raise KeyError(f"example has no gold answer field {answer_key!r} (fields: {sorted(example)})")
    gold_text = str(example[answer_key])
    marked = after_last_gsm8k_marker(gold_text)
    value = parse_number(marked if marked is not None else gold_text)
    if value is None:
        raise ValueError(f"gold answer field {answer_key!r} holds no number: {gold_text[-200:]!r}")
    return value


def gsm8k_reward(
    prompt: str,
    completion: str,
    example: dict[str, Any],
    *,
    answer_key: str = "answer",
    fallback_last_number: bool = False,
) -> float:
    """Scores 1.0 when the number after the completion's last ``####`` equals the gold number, else 0.0.

    Args:
      prompt: unused.
      completion: the generated text.
      example: the data row; ``example[answer_key]`` is the gold answer.
      answer_key: the field holding the gold answer.
      fallback_last_number: without a ``####`` marker, grade the last number of the completion instead of
        scoring 0 (the "flexible" GSM8K grading; the default is the strict one).

    Returns:
      1.0 or 0.0.
    """
    del prompt
    gold = gold_number(example, answer_key)
    marked = after_last_gsm8k_marker(completion)
    if marked is not None:
        predicted = parse_number(marked)
    elif fallback_last_number:
        predicted = last_number(completion)
    else:
        predicted = None
    return float(predicted is not None and predicted == gold)
