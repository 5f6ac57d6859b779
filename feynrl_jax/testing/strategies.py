"""Hypothesis strategies that draw what the train step passes a loss, as sequences with several layouts.

A :class:`LossExample` holds an even number of token sequences (DPO reads sequences as interleaved
chosen/rejected pairs) and the choices that lay them out in rows:

* ``unpacked()``: one sequence per row, ``[N, max_length]``, right-padded;
* ``padded()``: the same rows right-padded wider, ``[N, max_length + pad]``;
* ``packed()``: several sequences per row in order (segment ids 1, 2, ...), ``[N / 2, 2 * max_length]``; rows
  left over are pure padding;
* ``micro_batches()``: the unpacked rows cut at even row indices (whole pairs in every micro-batch);
* ``ratio_one()``: the same example with ``old_logprobs == behavior_logprobs == logprobs`` and one advantage per
  sequence (what group estimators produce).

Shapes come from small pools (``num_sequences`` and the fixed widths above), so a jitted loss compiles a handful
of times; lengths, prompt lengths, values, masks, packings and cuts are drawn freely. Every position with
``loss_mask`` 0 (prompt tokens, fully masked sequences, padding) holds garbage (normal values times
``GARBAGE_SCALE``, drawn per layout), so a loss that reads a masked position changes between layouts. The first
token of every sequence has logprob 0 and mask 0 (token alignment, docs/CONTRACTS.md); the first two sequences
(the first pair) always have a valid token, so every loss has a positive denominator.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import strategies as st

from feynrl_jax.losses import TrainBatch

# Per-token float fields of a TrainBatch, all filled.
BATCH_FLOAT_FIELDS = ("advantages", "old_logprobs", "ref_logprobs", "behavior_logprobs", "values", "returns")
# The per-token inputs the train step passes a loss besides the batch: `values` here are the critic's predictions.
INPUT_FIELDS = ("logprobs", "entropy", "values")
GARBAGE_SCALE = 5.0
PAD = 4


@dataclasses.dataclass(frozen=True)
class LossInputs:
    """One layout of an example: the loss's arguments and where each sequence sits.

    Attributes:
        logprobs: [B, T] f32 current-policy log-probabilities (<= 0; 0 on the first token of each sequence).
        batch: the TrainBatch, every optional field filled.
        entropy: [B, T] f32 per-token entropy (>= 0).
        values: [B, T] f32 critic predictions.
        spans: per sequence, ``(row, start, length)``.
        name: the layout's name, for messages ("unpacked", "packed", ...).
    """

    logprobs: jax.Array
    batch: TrainBatch
    entropy: jax.Array
    values: jax.Array
    spans: tuple[tuple[int, int, int], ...]
    name: str

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.logprobs.shape)

    def per_sequence(self, array) -> list[np.ndarray]:
        """Slices ``array`` [B, T] into each sequence's tokens, in sequence order."""
        array = np.asarray(array)
        return [array[row, start : start + n] for row, start, n in self.spans]


def _draw_sequence(rng: np.random.Generator, length: int, prompt: int) -> dict[str, np.ndarray]:
    """Per-token arrays of one sequence; positions before ``prompt`` are masked (their values become garbage)."""
    logprobs = -rng.uniform(0.05, 3.0, length).astype(np.float32)
    logprobs[0] = 0.0  # the first token has no prediction
    noise = lambda scale: (scale * rng.normal(size=length)).astype(np.float32)  # noqa: E731
    mask = np.zeros(length, np.float32)
    mask[prompt:] = 1.0
    return {
        "tokens": rng.integers(1, 100, length).astype(np.int32),
        "loss_mask": mask,
        "advantages": (rng.normal() + noise(0.3)).astype(np.float32),
        "old_logprobs": logprobs + noise(0.3),
        "ref_logprobs": logprobs + noise(0.3),
        "behavior_logprobs": logprobs + noise(0.3),
        "values": noise(1.0),
        "returns": noise(1.0),
        "logprobs": logprobs,
        "entropy": rng.uniform(0.0, 3.0, length).astype(np.float32),
        "critic": noise(1.0),
    }


def _layout(
    sequences: tuple[dict[str, np.ndarray], ...], rows: list[list[int]], shape: tuple[int, int], seed: int, name: str
) -> LossInputs:
    """Places sequences into rows (left to right); every masked position gets garbage drawn from ``seed``."""
    b, t = shape
    rng = np.random.default_rng(seed)
    garbage = lambda: (GARBAGE_SCALE * rng.normal(size=(b, t))).astype(np.float32)  # noqa: E731
    arrays = {field: garbage() for field in (*BATCH_FLOAT_FIELDS, "logprobs", "entropy", "critic")}
    arrays["tokens"] = rng.integers(1, 100, (b, t)).astype(np.int32)
    arrays["loss_mask"] = np.zeros((b, t), np.float32)
    arrays["segment_ids"] = np.zeros((b, t), np.int32)
    arrays["positions"] = np.zeros((b, t), np.int32)
    valid = np.zeros((b, t), bool)
    spans: dict[int, tuple[int, int, int]] = {}
    for r, members in enumerate(rows):
        start = 0
        for segment, k in enumerate(members, start=1):
            seq = sequences[k]
            n = len(seq["tokens"])
            if start + n > t:
                raise ValueError(f"layout {name!r}: row {r} of width {t} cannot hold sequences {members}")
            keep = seq["loss_mask"] > 0
            for field, value in seq.items():
                if field == "tokens" or field == "loss_mask":
                    arrays[field][r, start : start + n] = value
                else:  # masked positions keep this layout's garbage
                    arrays[field][r, start : start + n] = np.where(keep, value, arrays[field][r, start : start + n])
            valid[r, start : start + n] = keep
            arrays["logprobs"][r, start] = 0.0
            arrays["segment_ids"][r, start : start + n] = segment
            arrays["positions"][r, start : start + n] = np.arange(n)
            spans[k] = (r, start, n)
            start += n
    arrays["logprobs"] = np.where(valid, arrays["logprobs"], -np.abs(arrays["logprobs"]))
    arrays["entropy"] = np.where(valid, arrays["entropy"], np.abs(arrays["entropy"]))
    batch = TrainBatch(
        tokens=jnp.asarray(arrays["tokens"]),
        positions=jnp.asarray(arrays["positions"]),
        segment_ids=jnp.asarray(arrays["segment_ids"]),
        loss_mask=jnp.asarray(arrays["loss_mask"]),
        **{field: jnp.asarray(arrays[field]) for field in BATCH_FLOAT_FIELDS},
    )
    return LossInputs(
        logprobs=jnp.asarray(arrays["logprobs"]),
        batch=batch,
        entropy=jnp.asarray(arrays["entropy"]),
        values=jnp.asarray(arrays["critic"]),
        spans=tuple(spans[k] for k in sorted(spans)),
        name=name,
    )


@dataclasses.dataclass(frozen=True, repr=False)
class LossExample:
    """Drawn sequences and the layout choices; every layout is rebuilt from these fields deterministically.

    Attributes:
        sequences: per sequence, a dict of per-token arrays (``tokens``, ``loss_mask``, the batch's float fields,
            ``logprobs``, ``entropy`` and ``critic``, the critic predictions passed as ``values``).
        max_length: the unpacked width T; every sequence is at most this long.
        packing: rows of the packed layout, each a list of sequence indices in order.
        cuts: even row indices where the unpacked rows are cut into micro-batches.
        seed: the NumPy seed the values were drawn with (layouts derive their garbage from it).
    """

    sequences: tuple[dict[str, np.ndarray], ...]
    max_length: int
    packing: tuple[tuple[int, ...], ...]
    cuts: tuple[int, ...]
    seed: int

    @property
    def num_sequences(self) -> int:
        return len(self.sequences)

    def unpacked(self, *, garbage: int = 0) -> LossInputs:
        """One sequence per row, ``[N, max_length]``; ``garbage`` picks the garbage at masked positions."""
        rows = [[k] for k in range(self.num_sequences)]
        shape = (self.num_sequences, self.max_length)
        return _layout(self.sequences, rows, shape, self.seed + 1 + garbage, "unpacked")

    def padded(self) -> LossInputs:
        """One sequence per row, right-padded to ``[N, max_length + PAD]``."""
        rows = [[k] for k in range(self.num_sequences)]
        shape = (self.num_sequences, self.max_length + PAD)
        return _layout(self.sequences, rows, shape, self.seed + 101, "padded")

    def packed(self) -> LossInputs:
        """Sequences packed in order into ``[N / 2, 2 * max_length]`` (segment ids 1, 2, ... per row)."""
        shape = (self.num_sequences // 2, 2 * self.max_length)
        return _layout(self.sequences, [list(r) for r in self.packing], shape, self.seed + 202, "packed")

    def micro_batches(self) -> list[LossInputs]:
        """The unpacked layout's rows cut at ``cuts`` into micro-batches (each its own ``[rows, max_length]``)."""
        bounds = [0, *self.cuts, self.num_sequences]
        parts = []
        for i, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:])):
            rows = [[k] for k in range(hi - lo)]
            name = f"micro-batch rows {lo}:{hi}"
            parts.append(_layout(self.sequences[lo:hi], rows, (hi - lo, self.max_length), self.seed + 303 + i, name))
        return parts

    def ratio_one(self) -> LossExample:
        """The same example with ``old_logprobs = behavior_logprobs = logprobs`` and one advantage per sequence."""
        sequences = []
        for seq in self.sequences:
            valid = seq["loss_mask"] > 0
            advantage = seq["advantages"][valid][0] if valid.any() else np.float32(0.0)
            sequences.append(
                {
                    **seq,
                    "advantages": np.full_like(seq["advantages"], advantage),
                    "old_logprobs": seq["logprobs"].copy(),
                    "behavior_logprobs": seq["logprobs"].copy(),
                }
            )
        return dataclasses.replace(self, sequences=tuple(sequences))

    def describe(self) -> str:
        """A one-line description: sequence lengths, prompt lengths, packing, cuts and the value seed."""
        lengths = [len(s["tokens"]) for s in self.sequences]
        prompts = [int(len(s["tokens"]) - s["loss_mask"].sum()) for s in self.sequences]
        return (
            f"{self.num_sequences} sequences of lengths {lengths} (masked prefixes {prompts}); unpacked "
            f"[{self.num_sequences}, {self.max_length}], padded [{self.num_sequences}, {self.max_length + PAD}], "
            f"packed rows {[list(r) for r in self.packing]} in [{self.num_sequences // 2}, {2 * self.max_length}], "
            f"micro-batch cuts at rows {list(self.cuts)}; value seed {self.seed}"
        )

    def __repr__(self) -> str:
        return f"LossExample({self.describe()})"

    def _repr_pretty_(self, printer, cycle) -> None:  # hypothesis and IPython print the short form too
        del cycle
        printer.text(repr(self))


@st.composite
def loss_examples(draw, *, num_sequences: tuple[int, ...] = (4,), max_length: int = 8) -> LossExample:
    """Draws a :class:`LossExample`.

    Args:
        draw: hypothesis's draw function (supplied by ``st.composite``).
        num_sequences: the pool of sequence counts N; each must be even and at least 2.
        max_length: the unpacked width T (at least 2); sequence lengths are drawn in ``[2, T]``.

    Returns:
        A strategy of LossExample.
    """
    if any(n < 2 or n % 2 for n in num_sequences):
        raise ValueError(f"num_sequences must hold even counts >= 2 (DPO reads pairs), got {num_sequences}")
    if max_length < 2:
        raise ValueError(f"max_length must be at least 2, got {max_length}")
    n = draw(st.sampled_from(num_sequences))
    lengths = [draw(st.integers(2, max_length)) for _ in range(n)]
    # The first pair always has a valid token; the others may be fully masked (prefix = length).
    prompts = [draw(st.integers(1, length - 1 if k < 2 else length)) for k, length in enumerate(lengths)]
    seed = draw(st.integers(0, 2**31 - 1))
    rng = np.random.default_rng(seed)
    sequences = tuple(_draw_sequence(rng, length, prompt) for length, prompt in zip(lengths, prompts))

    # Pack in order into N / 2 rows of width 2T. Next-fit puts at least two sequences (each <= T) in every closed
    # row, so a row may be closed early only while the sequences left still fit in the rows left.
    width, rows_left, packing, used = 2 * max_length, n // 2, [[]], 0
    for k, length in enumerate(lengths):
        remaining = n - k
        fits = used + length <= width
        can_break = packing[-1] and len(packing) + (remaining + 1) // 2 <= rows_left
        if packing[-1] and (not fits or (can_break and draw(st.booleans()))):
            packing.append([])
            used = 0
        packing[-1].append(k)
        used += length
    cuts = sorted(draw(st.sets(st.sampled_from(range(2, n, 2)), min_size=1))) if n > 2 else []
    return LossExample(
        sequences=sequences,
        max_length=max_length,
        packing=tuple(tuple(r) for r in packing),
        cuts=tuple(cuts),
        seed=seed,
    )


def loss_inputs(*, num_sequences: tuple[int, ...] = (4,), max_length: int = 8) -> st.SearchStrategy[LossInputs]:
    """Draws one layout (unpacked, padded or packed) of a :func:`loss_examples` example, for a user's own tests.

    Args:
        num_sequences: the pool of sequence counts (even).
        max_length: the unpacked width.

    Returns:
        A strategy of LossInputs.
    """
    layouts = st.sampled_from(("unpacked", "padded", "packed"))
    return st.tuples(loss_examples(num_sequences=num_sequences, max_length=max_length), layouts).map(
        lambda pair: getattr(pair[0], pair[1])()
    )


def train_batches(*, num_sequences: tuple[int, ...] = (4,), max_length: int = 8) -> st.SearchStrategy[TrainBatch]:
    """Draws a TrainBatch (one layout of a drawn example), every field filled.

    Args:
        num_sequences: the pool of sequence counts (even).
        max_length: the unpacked width.

    Returns:
        A strategy of TrainBatch.
    """
    return loss_inputs(num_sequences=num_sequences, max_length=max_length).map(lambda inputs: inputs.batch)
