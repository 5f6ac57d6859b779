"""Padding-free RL updates: a mini-batch's sequences packed into as few rows as they fit in, the rest skipped.

An RL mini-batch is `[U, L]`: one unit per row (a sample in the row layout, a group in the shared-prefix layout
of `feynrl_jax.train.shared_prefix`), each padded to the widest one the config allows. Most of a row is padding
when completions stop early. `pack_units` moves the units, first-fit by decreasing length, into as few rows of
the same width as they fit in, each unit keeping its tokens, positions and per-token fields, its segment ids
renumbered so that every segment of a row stays distinct (`feynrl_jax.models.segments`: a continuation segment
still finds its prompt, the row's latest segment starting at position 0). The result has the same `[U, L]`
shape (the train step compiles once), with the filled rows placed where `microbatch.split_microbatches` deals
them to the first micro-batches: the others hold padding alone and the train step skips them
(`step.make_train_step`, `lax.cond`). A step then costs what its real tokens cost, rounded up to whole
micro-batches.

Losses, log-probabilities and gradients are those of the unpacked mini-batch (the loss contract: padding
invariance, packed = unpacked; sums reduce in another order, so float32 results agree to rounding).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from feynrl_jax.losses import TrainBatch


@dataclasses.dataclass(frozen=True)
class PackStats:
    """What packing did to one mini-batch.

    Attributes:
        units: units (non-empty rows) packed.
        chunks: the parts they were written in (more than `units` when a group was split between rows).
        rows: rows they fill.
        micro_batches: micro-batches holding them (the others are skipped).
        tokens: non-padding tokens.
        slots: token slots of the micro-batches that run (`micro_batches x rows per micro-batch x L`).
    """

    units: int
    chunks: int
    rows: int
    micro_batches: int
    tokens: int
    slots: int


def unit_spans(segment_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """`(start, end)` `[U]` of each row's non-padding columns (`0, 0` for an empty row).

    Raises:
        ValueError: naming the row whose non-padding columns are not contiguous.
    """
    used = segment_ids != 0
    width = used.shape[1]
    any_used = used.any(axis=1)
    start = np.where(any_used, np.argmax(used, axis=1), 0)
    end = np.where(any_used, width - np.argmax(used[:, ::-1], axis=1), 0)
    inside = (np.arange(width)[None, :] >= start[:, None]) & (np.arange(width)[None, :] < end[:, None])
    gaps = np.flatnonzero((inside & ~used).any(axis=1))
    if gaps.size:
        raise ValueError(f"row {int(gaps[0])} has padding between its tokens; only contiguous rows can be packed")
    return start, end


Chunk = tuple[int, list[tuple[int, int]]]
"""A unit's part placed in one row: `(unit row, [(start, end) column ranges of that row, in order])`."""


def _pieces(segment_ids: np.ndarray, start: int, end: int) -> list[tuple[int, int]]:
    """The runs of equal segment ids in columns `[start, end)` of one row: its root, then its continuations."""
    ids = segment_ids[start:end]
    cuts = [start, *(start + np.flatnonzero(ids[1:] != ids[:-1]) + 1).tolist(), end]
    return list(zip(cuts[:-1], cuts[1:], strict=True))


def pack_rows(segment_ids: np.ndarray, start: np.ndarray, end: np.ndarray) -> list[list[Chunk]]:
    """Rows of chunks: first-fit by decreasing unit length, a unit that fits in no row's room split between rows.

    A unit of the shared-prefix layout (a root, its prompt, then continuations, its completions) that does not fit
    whole is split at continuation boundaries: each part is written behind its own copy of the root, so every
    continuation still follows its prompt (a copy of a prompt carries no loss-mask token, so nothing is counted
    twice). A unit of one segment (a sample of the row layout) is never split.
    """
    width = segment_ids.shape[1]
    rows: list[list[Chunk]] = []
    free: list[int] = []

    def place(chunk: Chunk, n: int, row: int | None) -> None:
        merged: list[tuple[int, int]] = []
        for a, b in chunk[1]:  # adjacent column ranges as one
            merged[-1:] = [(merged[-1][0], b)] if merged and merged[-1][1] == a else [*merged[-1:], (a, b)]
        chunk = (chunk[0], merged)
        if row is None:
            rows.append([chunk])
            free.append(width - n)
        else:
            rows[row].append(chunk)
            free[row] -= n

    for u in np.argsort(-(end - start), kind="stable"):
        u, n = int(u), int(end[u] - start[u])
        if n == 0:
            break
        fits = [r for r, room in enumerate(free) if room >= n]
        if fits or len(pieces := _pieces(segment_ids[u], int(start[u]), int(end[u]))) == 1:
            place((u, [(int(start[u]), int(end[u]))]), n, fits[0] if fits else None)
            continue
        root, rest = pieces[0], pieces[1:]
        root_n = root[1] - root[0]
        while rest:
            # The row with the most room that takes the root and the next continuation, else a new row.
            need = root_n + rest[0][1] - rest[0][0]
            candidates = [r for r, room in enumerate(free) if room >= need]
            row = max(candidates, key=lambda r: free[r]) if candidates else None
            room = free[row] if row is not None else width
            taken, used = [], root_n
            while rest and used + rest[0][1] - rest[0][0] <= room:
                used += rest[0][1] - rest[0][0]
                taken.append(rest.pop(0))
            place((u, [root, *taken]), used, row)
    return rows


def pack_units(batch: TrainBatch, *, num_micro: int, pad_id: int) -> tuple[TrainBatch, PackStats]:
    """Packs a host mini-batch `[U, L]` into the first micro-batches of a batch of the same shape.

    Args:
        batch: a host (NumPy) `TrainBatch`, one unit per row, each unit's non-padding columns contiguous.
        num_micro: the micro-batches the train step splits the `U` rows into (`grad_accum`; `U` a multiple).
        pad_id: the token written on padding.

    Returns:
        `(packed batch, PackStats)`: filled row `k` sits at index `(k % R) * num_micro + k // R` (`R = U /
        num_micro` rows per micro-batch), which `split_microbatches` deals to micro-batch `k // R`.
    """
    segment_ids = np.asarray(batch.segment_ids)
    units, width = segment_ids.shape
    per_micro = units // num_micro
    start, end = unit_spans(segment_ids)
    rows = pack_rows(segment_ids, start, end)
    fields = {f.name: getattr(batch, f.name) for f in dataclasses.fields(batch)}
    fields = {name: np.asarray(value) for name, value in fields.items() if value is not None}
    out = {name: np.full(v.shape, pad_id if name == "tokens" else 0, v.dtype) for name, v in fields.items()}
    tokens = 0
    for k, chunks in enumerate(rows):
        row = (k % per_micro) * num_micro + k // per_micro
        column, base = 0, 0
        for u, ranges in chunks:
            top = 0
            for a, b in ranges:
                target = slice(column, column + b - a)
                for name, value in fields.items():
                    out[name][row, target] = value[u, a:b]
                segments = segment_ids[u, a:b]
                out["segment_ids"][row, target] = segments + base
                top = max(top, int(segments.max()))
                column += b - a
                tokens += b - a
            base += top
    micro = -(-len(rows) // per_micro)
    stats = PackStats(
        units=int((end > start).sum()),
        chunks=sum(len(chunks) for chunks in rows),
        rows=len(rows),
        micro_batches=micro,
        tokens=tokens,
        slots=micro * per_micro * width,
    )
    return dataclasses.replace(batch, **out), stats
