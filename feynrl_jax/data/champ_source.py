"""CHAMP competition-math problems (the installed ``champ_dataset`` package) as evaluation examples.

CHAMP (Mao et al., 2024, "CHAMP: A Competition-level Dataset for Fine-Grained Analyses of LLMs' Mathematical
Reasoning Capabilities") has 270 problems in five categories, each with a final answer string. The prompt is
the package's own zero-shot instruction ("Solve the following problem. Make sure to show your work before
giving the final answer.") followed by the problem text.
"""

from __future__ import annotations

import functools

from feynrl_jax.data.examples import DataError
from feynrl_jax.data.file_sources import ExampleSource

CHAMP_INSTRUCTION = "Solve the following problem. Make sure to show your work before giving the final answer."


@functools.lru_cache(maxsize=4)
def _problems(version: str) -> tuple[tuple[str, str, str, str], ...]:
    """(identifier, category, text, answer) of every problem; the 70 MB file is parsed once per process."""
    import champ_dataset

    try:
        dataset = champ_dataset.load(version)
    except FileNotFoundError as error:
        raise DataError(f"CHAMP version {version!r} is not shipped with champ_dataset: {error}") from error
    return tuple((p.identifier, p.category, p.text, p.answer) for p in dataset.problems.values())


def champ_source(
    *, version: str = "v0", categories: tuple[str, ...] | None = None, limit: int | None = None
) -> ExampleSource:
    """Loads CHAMP problems as examples with ``prompt``, ``answer`` and metadata (id, category).

    Args:
        version: the data file shipped with the package ("v0").
        categories: keep only these categories (e.g. ``("Combinatorics",)``); None keeps all.
        limit: keep the first ``limit`` problems (in the package's order) after filtering.
    """
    problems = _problems(version)
    known = sorted({category for _, category, _, _ in problems})
    if categories is not None:
        unknown = sorted(set(categories) - set(known))
        if unknown:
            raise DataError(f"CHAMP has no categories {unknown}; known: {known}")
    examples = [
        {
            "prompt": f"{CHAMP_INSTRUCTION}\n\n{text}",
            "answer": answer,
            "metadata": {"source": f"champ/{version}", "id": identifier, "category": category},
        }
        for identifier, category, text, answer in problems
        if categories is None or category in categories
    ]
    if limit is not None:
        examples = examples[:limit]
    return ExampleSource(f"champ/{version}", examples)
