"""Examples read from local JSONL and Parquet files.

Both readers validate every row when the source is opened, so a bad row is reported before training starts,
not thousands of steps in. A bad row raises :class:`~feynrl_jax.data.examples.BadRowError` naming the file and
the 1-based row (the line number in a JSONL file), or, with ``on_bad_row="skip"``, is dropped and counted in
``source.skipped`` under its kind ("malformed_json", "missing_field", "wrong_type", "empty_text",
"unknown_role", "not_utf8") and logged: the first :data:`MAX_LOGGED_BAD_ROWS` one line each, then one summary
per file with the counts and an example row.
"""

from __future__ import annotations

import json
import logging
import os
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

from feynrl_jax.data.examples import (
    BadRowError,
    DataError,
    RowProblem,
    check_on_bad_row,
    rename_columns,
    validate_example,
)

log = logging.getLogger(__name__)

MAX_LOGGED_BAD_ROWS = 3
"""Skipped bad rows logged one line each, per file; the rest are counted and summarised in one line."""


class ExampleSource(Sequence):
    """A validated, random-access list of examples in the common format.

    Attributes:
        name: a label for error messages and metrics (usually the file path).
        examples: the valid examples, in file order.
        skipped: rows dropped under ``on_bad_row="skip"``, counted by kind.
        row_numbers: the 1-based row (JSONL line) of each valid example.
        rows: the number of data rows read (valid plus skipped).
        skip_examples: the first few skipped rows, as "row 3: malformed JSON: ..." (for messages).
    """

    def __init__(
        self,
        name: str,
        examples: list[dict[str, Any]],
        skipped: Counter | None = None,
        rows: int | None = None,
        row_numbers: list[int] | None = None,
        skip_examples: list[str] | None = None,
    ):
        self.name = name
        self.examples = examples
        self.skipped = Counter(skipped or {})
        self.rows = len(examples) if rows is None else rows
        self.row_numbers = list(range(1, len(examples) + 1)) if row_numbers is None else row_numbers
        self.skip_examples = list(skip_examples or [])

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, index):
        return self.examples[index]

    def __repr__(self) -> str:
        return f"ExampleSource({self.name!r}, {len(self)} examples, skipped={dict(self.skipped)})"


def collect_rows(
    name: str,
    rows: Iterable[tuple[int, Any]],
    *,
    required: tuple[str, ...],
    on_bad_row: str,
    columns: Mapping[str, str] | None = None,
) -> ExampleSource:
    """Validates ``(row_number, raw_row_or_BadRowError)`` pairs into an :class:`ExampleSource`.

    Args:
        name: the file or data set name for error messages.
        rows: pairs of a 1-based row number and either a decoded row or a :class:`BadRowError` found while
            decoding it.
        required: fields the caller needs (see :func:`validate_example`).
        on_bad_row: "error" raises on the first bad row, "skip" drops it, counts it by kind and logs it (the
            first few rows one line each, then one summary line).
        columns: example field -> column name in the file, for files whose columns are named differently.
    """
    check_on_bad_row(on_bad_row)
    examples, row_numbers, skipped, skip_examples, count = [], [], Counter(), [], 0
    for row, raw in rows:
        count += 1
        try:
            if isinstance(raw, BadRowError):
                raise raw
            try:
                examples.append(validate_example(rename_columns(raw, columns), required=required))
                row_numbers.append(row)
            except RowProblem as problem:
                renamed = {f: c for f, c in (columns or {}).items() if f != c}
                hint = f" (columns read as fields: {renamed})" if renamed else ""
                raise BadRowError(name, row, problem.kind, problem.reason + hint) from None
        except BadRowError as error:
            if on_bad_row == "error":
                raise
            skipped[error.kind] += 1
            if len(skip_examples) < MAX_LOGGED_BAD_ROWS:
                skip_examples.append(f"row {error.row}: {error.reason}")
                log.warning("%s, row %d skipped (on_bad_row=skip; %s): %s", name, error.row, error.kind, error.reason)
    if skipped:
        counts = ", ".join(f"{kind}: {n}" for kind, n in sorted(skipped.items()))
        log.warning(
            "%s: skipped %d of %d rows as bad rows (%s) with on_bad_row=skip; e.g. %s",
            name,
            sum(skipped.values()),
            count,
            counts,
            skip_examples[0],
        )
    return ExampleSource(name, examples, skipped, count, row_numbers, skip_examples)


def _jsonl_rows(path: str) -> Iterator[tuple[int, Any]]:
    with open(path, "rb") as f:
        for line_number, raw_line in enumerate(f, start=1):
            try:
                line = raw_line.decode("utf-8")
            except UnicodeDecodeError as error:
                yield (
                    line_number,
                    BadRowError(
                        path, line_number, "not_utf8", f"not valid UTF-8 ({error.reason} at byte {error.start})"
                    ),
                )
                continue
            if not line.strip():
                continue
            try:
                yield line_number, json.loads(line)
            except json.JSONDecodeError as error:
                yield (
                    line_number,
                    BadRowError(
                        path, line_number, "malformed_json", f"malformed JSON: {error.msg} at column {error.colno}"
                    ),
                )


def read_jsonl(
    path: str, *, required: tuple[str, ...] = (), on_bad_row: str = "error", columns: Mapping[str, str] | None = None
) -> ExampleSource:
    """Reads a JSONL file of examples (one JSON object per line; blank lines are ignored).

    Args:
        path: the local file.
        required: fields every row must have beyond ``prompt`` (e.g. ``("response",)`` for SFT).
        on_bad_row: "error" or "skip" (see the module docstring).
        columns: example field -> column name, when the file names its columns differently.

    Returns:
        The validated examples. Row numbers in errors are 1-based line numbers.
    """
    if not os.path.isfile(path):
        raise DataError(f"JSONL file not found: {path}")
    return collect_rows(path, _jsonl_rows(path), required=required, on_bad_row=on_bad_row, columns=columns)


def read_parquet(
    path: str, *, required: tuple[str, ...] = (), on_bad_row: str = "error", columns: Mapping[str, str] | None = None
) -> ExampleSource:
    """Reads a Parquet file of examples with pyarrow; columns are the example fields.

    Args:
        path: the local file.
        required: fields every row must have beyond ``prompt``.
        on_bad_row: "error" or "skip". Rows are numbered from 1 in file order.
        columns: example field -> column name, when the file names its columns differently.
    """
    import pyarrow.parquet as pq

    if not os.path.isfile(path):
        raise DataError(f"Parquet file not found: {path}")
    try:
        table = pq.read_table(path)
    except Exception as error:  # pyarrow raises several types for a corrupt file
        raise DataError(f"{path}: cannot read as Parquet: {error}") from error
    rows = ((i, row) for i, row in enumerate(table.to_pylist(), start=1))
    return collect_rows(path, rows, required=required, on_bad_row=on_bad_row, columns=columns)


def from_examples(
    name: str, raw_examples: Iterable[Any], *, required: tuple[str, ...] = (), on_bad_row: str = "error"
) -> ExampleSource:
    """Validates in-memory examples (rows numbered from 1) into an :class:`ExampleSource`."""
    rows = ((i, raw) for i, raw in enumerate(raw_examples, start=1))
    return collect_rows(name, rows, required=required, on_bad_row=on_bad_row)
