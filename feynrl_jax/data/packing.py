"""Fixed-shape token batches, and sequence packing with ``segment_ids``.

Conventions (docs/CONTRACTS.md): every per-token array is ``[B, T]`` and aligned with ``tokens``;
``segment_ids`` is 0 on padding and 1, 2, ... for the sequences packed into a row; ``positions`` restart at 0
in every segment; the first token of every segment has ``loss_mask`` 0 (it has no prediction).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from feynrl_jax.data.tokenization import TokenizedSequence


@dataclass(frozen=True)
class TokenBatch:
    """A host batch of token rows, ready to become a ``TrainBatch``.

    Attributes:
        tokens: ``[B, T]`` int32 token ids (``pad_id`` on padding).
        positions: ``[B, T]`` int32, restarting at 0 in each segment (0 on padding).
        segment_ids: ``[B, T]`` int32, 0 on padding, 1.. per packed sequence.
        loss_mask: ``[B, T]`` float32, 1 on trained (response) tokens.
    """

    tokens: np.ndarray
    positions: np.ndarray
    segment_ids: np.ndarray
    loss_mask: np.ndarray

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.tokens.shape)


class RowPacker:
    """Fills a ``[B, T]`` batch row by row: each sequence goes into the current row if it fits, else the next.

    Args:
        batch_size: B.
        seq_len: T.
        pad_id: the token id written on padding.
        packing: with False, every sequence takes a row of its own.
    """

    def __init__(self, batch_size: int, seq_len: int, pad_id: int, *, packing: bool):
        if batch_size <= 0 or seq_len <= 1:
            raise ValueError(f"batch_size must be > 0 and seq_len > 1, got {batch_size}, {seq_len}")
        self.batch_size, self.seq_len, self.packing = batch_size, seq_len, packing
        self.tokens = np.full((batch_size, seq_len), pad_id, np.int32)
        self.positions = np.zeros((batch_size, seq_len), np.int32)
        self.segment_ids = np.zeros((batch_size, seq_len), np.int32)
        self.loss_mask = np.zeros((batch_size, seq_len), np.float32)
        self._row, self._fill, self._segments = 0, 0, 0

    def _row_is_used(self) -> bool:
        return self._segments > 0

    def try_add(self, sequence: TokenizedSequence) -> bool:
        """Places ``sequence`` and returns True, or returns False when the batch has no room for it.

        Raises:
            ValueError: the sequence is longer than ``seq_len`` (filter those before packing).
        """
        n = len(sequence)
        if n > self.seq_len:
            raise ValueError(f"a sequence of {n} tokens cannot fit in rows of {self.seq_len}")
        if self._row_is_used() and (not self.packing or self._fill + n > self.seq_len):
            self._row, self._fill, self._segments = self._row + 1, 0, 0
        if self._row >= self.batch_size:
            return False
        row, start = self._row, self._fill
        self._segments += 1
        self.tokens[row, start : start + n] = sequence.tokens
        self.positions[row, start : start + n] = np.arange(n, dtype=np.int32)
        self.segment_ids[row, start : start + n] = self._segments
        self.loss_mask[row, start : start + n] = sequence.loss_mask
        self.loss_mask[row, start] = 0.0
        self._fill += n
        return True

    @property
    def empty(self) -> bool:
        return self._row == 0 and not self._row_is_used()

    def batch(self) -> TokenBatch:
        return TokenBatch(self.tokens, self.positions, self.segment_ids, self.loss_mask)


def pack_sequences(
    sequences: Sequence[TokenizedSequence], *, batch_size: int, seq_len: int, pad_id: int, packing: bool = True
) -> tuple[TokenBatch, int]:
    """Packs as many of ``sequences`` (in order) as fit into one ``[batch_size, seq_len]`` batch.

    Returns:
        The batch and the number of sequences placed (the rest did not fit).
    """
    packer = RowPacker(batch_size, seq_len, pad_id, packing=packing)
    placed = 0
    for sequence in sequences:
        if not packer.try_add(sequence):
            break
        placed += 1
    return packer.batch(), placed
