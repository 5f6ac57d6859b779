"""Scoring with reasoning-gym's own task scorers (Stojanovski et al. 2025, "Reasoning Gym").

A reasoning-gym entry is ``{"question", "answer", "metadata"}`` where ``metadata["source_dataset"]`` names the task
that generated it (also inside composite datasets). Each task scores an answer with its ``score_answer(answer,
entry)`` (exact, partial or numeric-tolerance credit, in [0, 1]); this reward extracts the completion's answer
(last ``<answer>`` block, else its last non-empty line) and applies the scorer of the entry's own task, obtained
from ``reasoning_gym.get_score_answer_fn(source_dataset)``.

reasoning-gym is imported where the reward runs, not where this module is: importing it takes 2-3 s (all its tasks,
with matplotlib and SymPy among their dependencies), and the process that builds a scorer only resolves and pickles
this function for its worker processes. ``worker_imports`` has those workers import it while they start.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from typing import Any

from feynrl_jax.rollout.rewards.answer_extraction import last_nonempty_line, last_tag_content


@functools.cache
def _score_fn(source_dataset: str) -> Callable[[str | None, dict[str, Any]], float]:
    """The task's ``score_answer`` (cached: building the dataset object can be slow for some tasks)."""
    import reasoning_gym

    return reasoning_gym.get_score_answer_fn(source_dataset)


def extract_reasoning_gym_answer(completion: str, *, answer_tag: str = "answer") -> str | None:
    """Returns the last ``<answer_tag>`` block's content, else the completion's last non-empty line, else None."""
    tagged = last_tag_content(completion, answer_tag)
    return tagged if tagged is not None else last_nonempty_line(completion)


def reasoning_gym_reward(
    prompt: str,
    completion: str,
    example: dict[str, Any],
    *,
    answer_key: str = "answer",
    metadata_key: str = "metadata",
    question_key: str = "question",
    answer_tag: str = "answer",
) -> float:
    """Scores the completion's answer with the scorer of the reasoning-gym task that generated ``example``.

    Args:
      prompt: used as the entry's question when the example has no ``question_key`` field.
      completion: the generated text.
      example: the data row: a reasoning-gym entry, or a row that carries its fields. ``example[metadata_key]``
        is the entry's metadata (a dict, or its JSON string as stored in Parquet/JSONL files) with
        ``"source_dataset"``, or a dict that holds the whole original entry under ``"entry"`` (the layout of
        ``feynrl_jax.data``'s reasoning-gym source); ``example[answer_key]`` is the oracle answer.
      answer_key: the field holding the oracle answer.
      metadata_key: the field holding the entry's metadata.
      question_key: the field holding the question.
      answer_tag: the tag whose last block holds the final answer.

    Returns:
      The task's score in [0, 1].

    Raises:
      KeyError: when a required field is missing (named in the message).
      ValueError: when the metadata is not a dict (or JSON of one) or names an unregistered task.
    """
    for key in (answer_key, metadata_key):
        if key not in example:
            raise KeyError(f"example has no field {key!r} (fields: {sorted(example)})")
    metadata = example[metadata_key]
    if isinstance(metadata, str):
        metadata = json.loads(metadata)
    if isinstance(metadata, dict) and "source_dataset" not in metadata and isinstance(metadata.get("entry"), dict):
        metadata = metadata["entry"].get("metadata", metadata)
    if not isinstance(metadata, dict) or "source_dataset" not in metadata:
        raise ValueError(f"example field {metadata_key!r} must be a dict with 'source_dataset', got {metadata!r}")
    entry = {
        "question": example.get(question_key, prompt),
        "answer": example[answer_key],
        "metadata": metadata,
    }
    answer = extract_reasoning_gym_answer(completion, answer_tag=answer_tag)
    return float(_score_fn(metadata["source_dataset"])(answer, entry))


reasoning_gym_reward.worker_imports = ("reasoning_gym",)  # see process_pool: imported at a worker's start-up
