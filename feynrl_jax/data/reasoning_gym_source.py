"""Procedural reasoning-gym tasks as example sources, with a held-out split by seed.

reasoning-gym derives item ``i`` of a data set with base seed ``s`` from ``Random(s + i)`` (most tasks), so two
data sets with nearby base seeds share items. The splits here interleave instead: the train split takes the
items at even offsets ``s + 0, s + 2, ...`` and the test split those at odd offsets ``s + 1, s + 3, ...``, so
the two never share a generator seed whatever their sizes. Small tasks can still produce the same question
from two seeds; :func:`reasoning_gym_split` also drops every test item whose question is in the train set,
and asserts that the splits share no question.

Examples carry ``answer`` (the oracle answer) and ``metadata`` with the task name, the seed, the item offset
and the original reasoning-gym entry (``metadata["entry"]``), which the task's ``score_answer`` needs.
"""

from __future__ import annotations

import random
from collections import Counter
from typing import Any

from feynrl_jax.data.examples import DataError
from feynrl_jax.data.file_sources import ExampleSource


def _create(task: str, size: int, seed: int, config: dict[str, Any] | None):
    import reasoning_gym

    try:
        return reasoning_gym.create_dataset(task, size=size, seed=seed, **(config or {}))
    except Exception as error:  # unknown task names and bad options raise several types
        raise DataError(f"reasoning-gym task {task!r} (config {config}): {error}") from error


def _example(task: str, seed: int, index: int, entry: dict[str, Any], response_template: str | None) -> dict[str, Any]:
    example = {
        "prompt": entry["question"],
        "answer": str(entry["answer"]),
        "metadata": {"source": f"reasoning_gym/{task}", "task": task, "seed": seed, "index": index, "entry": entry},
    }
    if response_template is not None:
        example["response"] = response_template.format(answer=entry["answer"], question=entry["question"])
    return example


SPLITS = ("train", "test")


def reasoning_gym_source(
    task: str,
    *,
    size: int,
    seed: int,
    split: str = "train",
    config: dict[str, Any] | None = None,
    response_template: str | None = None,
) -> ExampleSource:
    """Generates ``size`` items of one split of a reasoning-gym task.

    Args:
        task: a reasoning-gym task name, e.g. "basic_arithmetic", "chain_sum".
        size: number of items.
        seed: the base seed.
        split: "train" (generator offsets 0, 2, 4, ...) or "test" (offsets 1, 3, 5, ...).
        config: task options passed to ``reasoning_gym.create_dataset`` (e.g. ``{"max_terms": 3}``).
        response_template: when given, each example gets ``response = template.format(answer=..., question=...)``
            for SFT, e.g. ``"The answer is {answer}."``.
    """
    if split not in SPLITS:
        raise DataError(f"reasoning-gym task {task!r}: split must be one of {SPLITS}, got {split!r}")
    if size <= 0:
        raise DataError(f"reasoning-gym task {task!r}: size must be positive, got {size}")
    dataset = _create(task, 2 * size, seed, config)
    parity = SPLITS.index(split)
    examples = [_example(task, seed, 2 * i + parity, dataset[2 * i + parity], response_template) for i in range(size)]
    return ExampleSource(f"reasoning_gym/{task}[{split}, seed={seed}]", examples)


def reasoning_gym_split(
    task: str,
    *,
    train_size: int,
    eval_size: int,
    seed: int,
    config: dict[str, Any] | None = None,
    response_template: str | None = None,
) -> tuple[ExampleSource, ExampleSource]:
    """A train set and a held-out evaluation set of one task that share no generator seed and no question.

    The evaluation set is the "test" split with every question of the train set (and repeats) removed,
    counted in ``eval.skipped["overlaps_train"]`` / ``["duplicate"]``; up to ``4 * eval_size`` test items are
    drawn to fill ``eval_size``.

    Returns:
        ``(train, eval)`` sources.

    Raises:
        DataError: not enough distinct evaluation questions exist (the task's space is too small).
    """
    train = reasoning_gym_source(
        task, size=train_size, seed=seed, split="train", config=config, response_template=response_template
    )
    train_questions = {example["prompt"] for example in train.examples}
    pool = reasoning_gym_source(
        task, size=4 * eval_size, seed=seed, split="test", config=config, response_template=response_template
    )
    examples, skipped, seen = [], Counter(), set()
    for example in pool.examples:
        if example["prompt"] in train_questions:
            skipped["overlaps_train"] += 1
            continue
        if example["prompt"] in seen:
            skipped["duplicate"] += 1
            continue
        seen.add(example["prompt"])
        examples.append(example)
        if len(examples) == eval_size:
            break
    if len(examples) < eval_size:
        raise DataError(
            f"reasoning-gym task {task!r}: only {len(examples)} held-out questions not in the train set "
            f"(wanted {eval_size}; dropped {dict(skipped)}); use a smaller train_size or a harder config"
        )
    held_out = ExampleSource(
        f"reasoning_gym/{task}[held-out, seed={seed}]", examples, skipped, len(examples) + sum(skipped.values())
    )
    assert_disjoint(train, held_out)
    return train, held_out


def assert_disjoint(train: ExampleSource, held_out: ExampleSource) -> None:
    """Checks that a train and a held-out source share no generator item (task, seed, offset) and no question.

    Raises:
        DataError: naming up to three shared items or questions.
    """

    def keys(source):
        return {
            (e["metadata"].get("task"), e["metadata"].get("seed"), e["metadata"].get("index")) for e in source.examples
        }

    shared_items = keys(train) & keys(held_out)
    if shared_items:
        raise DataError(f"train and held-out share generator items: {sorted(shared_items)[:3]}")
    shared = {e["prompt"] for e in train.examples} & {e["prompt"] for e in held_out.examples}
    if shared:
        raise DataError(f"train and held-out share questions: {sorted(shared)[:3]}")


def _wrong_answer(answer: str, rng: random.Random, other_answers: list[str]) -> str:
    try:
        value = int(answer)
    except ValueError:
        candidates = [a for a in other_answers if a != answer]
        if not candidates:
            raise DataError(f"cannot build a wrong answer for {answer!r}: no other answer to borrow") from None
        return rng.choice(candidates)
    offset = rng.choice([-1, 1]) * rng.randint(1, max(2, abs(value) // 2 + 1))
    return str(value + offset)


def preference_pairs(source: ExampleSource, *, response_template: str, seed: int) -> ExampleSource:
    """DPO pairs from a task with oracle answers: ``chosen`` states the right answer, ``rejected`` a wrong one.

    A wrong answer is the right integer plus a non-zero random offset, or, for non-integer answers, another
    item's answer. Deterministic under ``seed``.

    Args:
        source: examples with ``answer`` (e.g. from :func:`reasoning_gym_source`).
        response_template: how a completion states an answer, e.g. ``"The answer is {answer}."``.
        seed: the seed for the wrong answers.
    """
    rng = random.Random(seed)
    answers = [example["answer"] for example in source.examples]
    pairs = []
    for example in source.examples:
        wrong = _wrong_answer(example["answer"], rng, answers)
        pair = dict(example)
        pair.pop("response", None)
        pair["chosen"] = response_template.format(answer=example["answer"], question=example["prompt"])
        pair["rejected"] = response_template.format(answer=wrong, question=example["prompt"])
        pair["metadata"] = {**example["metadata"], "rejected_answer": wrong}
        pairs.append(pair)
    return ExampleSource(
        f"{source.name}/pairs", pairs, source.skipped, source.rows, source.row_numbers, source.skip_examples
    )
