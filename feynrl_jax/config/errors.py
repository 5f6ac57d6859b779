"""The error a bad config raises, and the "did you mean" suggestion it carries."""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Iterable


@dataclasses.dataclass(frozen=True)
class Problem:
    """One thing wrong with a config.

    Attributes:
        key: the dotted path of the offending key, e.g. "optim.lr".
        message: one sentence that names the key and says what is wrong.
    """

    key: str
    message: str


class ConfigError(ValueError):
    """A config that must not run; lists every problem found, each naming its key."""

    def __init__(self, problems: Iterable[Problem]):
        self.problems: tuple[Problem, ...] = tuple(problems)
        if not self.problems:
            raise ValueError("ConfigError needs at least one problem")
        lines = [p.message for p in self.problems]
        header = "invalid config: " if len(lines) == 1 else f"invalid config ({len(lines)} problems):\n  "
        super().__init__(header + "\n  ".join(lines))

    @property
    def keys(self) -> tuple[str, ...]:
        """The dotted keys named by the problems, in the order found."""
        return tuple(p.key for p in self.problems)


def closest(name: str, candidates: Iterable[str]) -> str | None:
    """The candidate most similar to `name`, or None when nothing is close.

    Dotted paths are compared whole first (so "optim.lrr" finds "optim.lr"), then by their last component (so
    "optim.learning_rat" still finds something when the section is right).
    """
    candidates = list(candidates)
    match = difflib.get_close_matches(name, candidates, n=1, cutoff=0.6)
    if match:
        return match[0]
    leaf = name.rsplit(".", 1)[-1]
    by_leaf = {c.rsplit(".", 1)[-1]: c for c in candidates}
    match = difflib.get_close_matches(leaf, list(by_leaf), n=1, cutoff=0.6)
    return by_leaf[match[0]] if match else None


def suggestion(name: str, candidates: Iterable[str]) -> str:
    """A " (did you mean X?)" suffix for an error message, or "" when nothing is close."""
    match = closest(name, candidates)
    return f" (did you mean {match}?)" if match else ""
