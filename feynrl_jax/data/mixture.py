"""A deterministic mixture of example sources whose iterator state checkpoints exactly.

The sampler is index-based and needs no randomness beyond one permutation per source and epoch:

- Source order: each source is shuffled once per epoch with ``numpy.random.default_rng([seed, crc32(name),
  epoch])`` (or kept in file order with ``shuffle=False``), so a source's stream is a pure function of the
  seed and its name; adding or removing another source does not change it.
- Interleaving: smooth weighted round-robin. Draw ``i`` goes to the source with the largest deficit
  ``w_k * (i + 1) - n_k`` (``w`` normalised weights, ``n_k`` draws so far from source ``k``; ties to the
  first name), so after any number of draws every source is within one draw of its exact share.

The state is therefore a small JSON dict: the number of draws, the draws per source, and counters.
grain's ``MapDataset.shuffle`` computes the same kind of index permutation, but costs milliseconds per element
here (measured: ~8 ms per ``ds[i]`` on the 2-core CI machine), which a training loop cannot afford.

An optional ``transform`` turns each example into what the consumer needs (e.g. token ids). It may return
:class:`Skip` to drop the example (an over-long prompt). Skips are never silent:

- counted by source and reason in the state (:meth:`ExampleStream.skip_counts` adds the bad rows each source
  dropped when it was read, so one dict holds every row a run did not train on);
- logged: the first :data:`MAX_LOGGED_SKIPS` of each source one line each, then one summary per source when its
  first pass ends (the transform is deterministic, so later passes skip the same examples);
- fatal when nothing is left: a source whose first full pass yields no usable example raises a
  :class:`~feynrl_jax.data.examples.DataError` naming the source, its file or task, and the reasons, as soon as
  that pass ends (one pass of the transform, never a fixed number of draws; a source with no usable row at all
  fails when the stream is built).

Each example handed out is a shallow copy of the source's dict with two fields added: ``source`` (the mixture
name of its source) and ``row`` (its 1-based row in that source's file).
"""

from __future__ import annotations

import dataclasses
import logging
import zlib
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from feynrl_jax.data.examples import DataError

log = logging.getLogger(__name__)

MAX_LOGGED_SKIPS = 3
"""Skipped examples logged one line each, per source; the rest are counted and summarised once."""


@dataclass(frozen=True)
class Skip:
    """Returned by a transform to drop an example.

    Attributes:
        reason: its counter key, e.g. "prompt_too_long".
        length: the size that broke the budget, in tokens (None when the reason is not a length).
        limit: the budget as the user sets it, for messages, e.g. "data.max_prompt_len=256".
    """

    reason: str
    length: int | None = None
    limit: str = ""

    def describe(self) -> str:
        """E.g. "prompt_too_long: 300 tokens > data.max_prompt_len=256"."""
        if self.length is None:
            return self.reason
        return f"{self.reason}: {self.length} tokens > {self.limit}"


@dataclass(frozen=True)
class MixtureSource:
    """One weighted source of a mixture.

    Attributes:
        examples: a random-access sequence of examples (e.g. an ``ExampleSource``, whose ``name``, ``rows``,
            ``skipped`` and ``skip_examples`` name it and its bad rows in messages and counters).
        weight: the relative sampling weight (>= 0; 0 leaves the source out); normalised over the mixture.
    """

    examples: Sequence[dict[str, Any]]
    weight: float = 1.0


def source_label(name: str, examples: Sequence[Any]) -> str:
    """How messages name a source: its config key and its file or task, e.g. "data.sources.train (a.jsonl)"."""
    origin = getattr(examples, "name", None)
    return f"data.sources.{name}" + (f" ({origin})" if origin and origin != name else "")


@dataclasses.dataclass
class _SkipNotes:
    """What a stream remembers about one source's skips for its messages (in memory, not in the state)."""

    logged: int = 0
    example: str | None = None
    lengths: dict[str, tuple[int, int, str]] = dataclasses.field(default_factory=dict)

    def add(self, row: int, skip: Skip) -> None:
        if self.example is None:
            self.example = f"row {row}: {skip.describe()}"
        if skip.length is not None:
            low, high, _ = self.lengths.get(skip.reason, (skip.length, skip.length, skip.limit))
            self.lengths[skip.reason] = (min(low, skip.length), max(high, skip.length), skip.limit)


def _describe_counts(counts: Mapping[str, int], lengths: Mapping[str, tuple[int, int, str]]) -> str:
    """E.g. "missing_field: 2, prompt_too_long: 998 with 300 to 512 tokens > data.max_prompt_len=256"."""
    parts = []
    for reason, n in sorted(counts.items()):
        text = f"{reason}: {n}"
        if reason in lengths:
            low, high, limit = lengths[reason]
            text += f" with {low} tokens" if low == high else f" with {low} to {high} tokens"
            text += f" > {limit}" if limit else ""
        parts.append(text)
    return ", ".join(parts)


class ExampleStream:
    """An iterator over a weighted mixture of sources, deterministic under ``seed``, with exact state.

    Args:
        sources: name (the ``data.sources`` key) -> :class:`MixtureSource`. A source with weight 0 is left out.
        seed: the shuffling seed.
        shuffle: shuffle each source (a new permutation every epoch).
        num_epochs: None repeats every source forever; an int ``E`` hands out each example of every source
            exactly ``E`` times (a source that runs out leaves the rotation), then stops.
        transform: maps an example (with ``source``/``row`` added) to the item handed out, or to
            :class:`Skip`.

    State (:meth:`get_state`): ``{"draws": int, "positions": {source: draws from it}, "skipped_by_source":
    {source: {reason: n}}, "taken": {source: n}}``; skipped examples count as draws. A state written before
    per-source counts existed (``"skipped": {reason: n}``) restores with those counts at zero.

    Raises:
        DataError: a source has no usable example: at construction when every row was dropped when it was read,
            while iterating when its first full pass ends without one (naming the source and the reasons).
    """

    def __init__(
        self,
        sources: Mapping[str, MixtureSource],
        *,
        seed: int,
        shuffle: bool = True,
        num_epochs: int | None = None,
        transform: Callable[[dict[str, Any]], Any] | None = None,
    ):
        active = {}
        for name in sorted(sources):
            source = sources[name]
            if source.weight < 0:
                raise DataError(f"{source_label(name, source.examples)}: weight must be >= 0, got {source.weight}")
            if source.weight == 0:
                continue
            if len(source.examples) == 0:
                raise DataError(_no_usable_rows(name, source.examples))
            active[name] = source
        if not active:
            raise DataError(f"the data mixture has no source with a positive weight: {sorted(sources)}")
        if num_epochs is not None and num_epochs < 1:
            raise DataError(f"num_epochs must be None or >= 1, got {num_epochs}")
        self.names = list(active)
        self._sources = active
        self._seed, self._shuffle, self._num_epochs = int(seed), shuffle, num_epochs
        total = sum(s.weight for s in active.values())
        self._weights = np.asarray([active[n].weight / total for n in self.names], np.float64)
        self._transform = transform
        self._permutations: dict[str, tuple[int, np.ndarray]] = {}
        self._draws = 0
        self._positions = dict.fromkeys(self.names, 0)
        self._skipped: dict[str, Counter] = {name: Counter() for name in self.names}
        self._taken: Counter = Counter()
        self._notes = {name: _SkipNotes() for name in self.names}
        self._peeked: tuple[int, tuple] | None = None

    def _label(self, name: str) -> str:
        return source_label(name, self._sources[name].examples)

    def _order(self, name: str, epoch: int) -> np.ndarray:
        cached = self._permutations.get(name)
        if cached is None or cached[0] != epoch:
            n = len(self._sources[name].examples)
            if self._shuffle:
                rng = np.random.default_rng([self._seed, zlib.crc32(name.encode()), epoch])
                order = rng.permutation(n)
            else:
                order = np.arange(n)
            cached = (epoch, order)
            self._permutations[name] = cached
        return cached[1]

    def _exhausted(self, name: str, position: int) -> bool:
        return self._num_epochs is not None and position >= self._num_epochs * len(self._sources[name].examples)

    def _choose(self, draws: int, positions: dict[str, int]) -> str:
        best, best_deficit = None, -np.inf
        for k, name in enumerate(self.names):
            if self._exhausted(name, positions[name]):
                continue
            deficit = self._weights[k] * (draws + 1) - positions[name]
            if deficit > best_deficit + 1e-12:
                best, best_deficit = name, deficit
        if best is None:
            raise StopIteration
        return best

    def _example(self, name: str, position: int) -> dict[str, Any]:
        examples = self._sources[name].examples
        n = len(examples)
        index = int(self._order(name, position // n)[position % n])
        example = dict(examples[index])
        row_numbers = getattr(examples, "row_numbers", None)
        example["source"] = name
        example["row"] = int(row_numbers[index]) if row_numbers is not None else index + 1
        return example

    def _advance(self) -> tuple:
        """From the current state, finds the next kept item; returns the state after it, its skips and the item.

        Raises:
            DataError: a source's first pass ended with every example skipped.
        """
        draws, positions, skips = self._draws, dict(self._positions), []
        while True:
            try:
                name = self._choose(draws, positions)
            except StopIteration:
                # The end of a finite stream: the skips on the way there are final, so record them.
                self._commit(draws, positions, skips)
                raise
            example = self._example(name, positions[name])
            draws += 1
            positions[name] += 1
            item = self._transform(example) if self._transform is not None else example
            if isinstance(item, Skip):
                skips.append((name, example["row"], item))
                if positions[name] == len(self._sources[name].examples) and self._taken[name] == 0:
                    raise DataError(self._nothing_usable(name, skips))
                continue
            return draws, positions, skips, name, item

    def _nothing_usable(self, name: str, pending: list[tuple[str, int, Skip]]) -> str:
        """The error for a source whose first pass skipped every example (``pending``: this draw's skips)."""
        examples = self._sources[name].examples
        counts = Counter(getattr(examples, "skipped", {})) + self._skipped[name]
        notes = dataclasses.replace(self._notes[name], lengths=dict(self._notes[name].lengths))
        for source, row, skip in pending:
            if source == name:
                counts[skip.reason] += 1
                notes.add(row, skip)
        rows = getattr(examples, "rows", len(examples))
        what = "rows" if rows != len(examples) else "examples"
        example = f"; e.g. {notes.example}" if notes.example else ""
        return (
            f"{self._label(name)}: all {rows} {what} were skipped ({_describe_counts(counts, notes.lengths)}), "
            f"nothing is left to train on{example}"
        )

    def _commit(self, draws: int, positions: dict[str, int], skips: list[tuple[str, int, Skip]]) -> None:
        """Moves the state to ``draws``/``positions``: counts and logs the skips on the way there."""
        before, self._draws, self._positions = self._positions, draws, positions
        for name, row, skip in skips:
            self._skipped[name][skip.reason] += 1
            notes = self._notes[name]
            notes.add(row, skip)
            if notes.logged < MAX_LOGGED_SKIPS:
                notes.logged += 1
                log.warning("%s, row %d skipped (%s)", self._label(name), row, skip.describe())
        for name in self.names:
            n = len(self._sources[name].examples)
            if before[name] < n <= positions[name] and self._skipped[name]:
                skipped = sum(self._skipped[name].values())
                log.warning(
                    "%s: %d of its %d examples were skipped in its first pass (%s); later passes skip the same "
                    "ones; e.g. %s",
                    self._label(name),
                    skipped,
                    n,
                    _describe_counts(self._skipped[name], self._notes[name].lengths),
                    self._notes[name].example,
                )

    def peek(self) -> Any:
        """The next item, without consuming it."""
        if self._peeked is None or self._peeked[0] != self._draws:
            self._peeked = (self._draws, self._advance())
        return self._peeked[1][-1]

    def __iter__(self):
        return self

    def __next__(self) -> Any:
        self.peek()
        draws, positions, skips, name, item = self._peeked[1]
        self._commit(draws, positions, skips)
        self._taken[name] += 1
        self._peeked = None
        return item

    def get_state(self) -> dict[str, Any]:
        """A JSON-serialisable snapshot: restoring it with :meth:`set_state` continues exactly from here."""
        return {
            "draws": self._draws,
            "positions": dict(self._positions),
            "skipped_by_source": {name: dict(self._skipped[name]) for name in self.names},
            "taken": dict(self._taken),
        }

    def set_state(self, state: Mapping[str, Any]) -> None:
        """Restores a snapshot from :meth:`get_state` (of a stream built with the same sources and seed)."""
        missing = {"draws", "positions", "taken"} - set(state)
        if missing:
            raise DataError(f"data iterator state lacks keys {sorted(missing)}: {dict(state)}")
        if set(state["positions"]) != set(self.names):
            raise DataError(
                f"data iterator state is for sources {sorted(state['positions'])}, this mixture has {self.names}"
            )
        by_source = state.get("skipped_by_source", {})  # absent in states written before per-source counts
        self._draws = int(state["draws"])
        self._positions = {name: int(state["positions"][name]) for name in self.names}
        self._skipped = {name: Counter({k: int(v) for k, v in by_source.get(name, {}).items()}) for name in self.names}
        self._taken = Counter({k: int(v) for k, v in state["taken"].items()})
        self._peeked = None

    def skip_counts(self) -> dict[str, dict[str, int]]:
        """Every row skipped so far, by source and reason: bad rows dropped when the source was read (kinds such
        as "malformed_json", from ``examples.skipped``) and examples the transform dropped ("prompt_too_long")."""
        out = {}
        for name in self.names:
            counts = Counter(getattr(self._sources[name].examples, "skipped", {})) + self._skipped[name]
            if counts:
                out[name] = dict(counts)
        return out

    @property
    def skipped(self) -> dict[str, int]:
        """Examples dropped by the transform so far, by reason (all sources)."""
        return dict(sum(self._skipped.values(), Counter()))

    @property
    def taken(self) -> dict[str, int]:
        """Examples handed out so far, by source."""
        return dict(self._taken)


def _no_usable_rows(name: str, examples: Sequence[Any]) -> str:
    """The error for a source left empty when it was read (every row bad, or an empty file)."""
    label = source_label(name, examples)
    skipped = dict(getattr(examples, "skipped", {}))
    if not skipped:
        return f"{label} has no examples"
    rows = getattr(examples, "rows", sum(skipped.values()))
    samples = list(getattr(examples, "skip_examples", ()))
    example = f"; e.g. {samples[0]}" if samples else ""
    return f"{label}: all {rows} rows were skipped as bad rows ({_describe_counts(skipped, {})}){example}"
