"""Splitting a batch into micro-batches that stay evenly spread over the batch-sharded devices.

A batch ``[B, ...]`` is split into ``M`` micro-batches of ``B / M`` rows. Taking contiguous blocks of rows would
put each micro-batch on a fraction of the devices (rows are sharded in contiguous blocks), so rows are dealt out
instead: the batch is cut into units of ``rows_per_example`` consecutive rows (2 for DPO's chosen/rejected
pairs), and unit ``j`` goes to micro-batch ``j mod M``. Each device then holds ``1 / M`` of every micro-batch and
no rows move between devices.
"""

from __future__ import annotations

from typing import Any

import jax


def _split_leaf(x: jax.Array, num: int, rows_per_example: int) -> jax.Array:
    b = x.shape[0]
    units = b // rows_per_example
    x = x.reshape(units // num, num, rows_per_example, *x.shape[1:])
    x = jax.numpy.swapaxes(x, 0, 1)
    return x.reshape(num, b // num, *x.shape[3:])


def _merge_leaf(x: jax.Array, rows_per_example: int) -> jax.Array:
    num, rows = x.shape[:2]
    x = x.reshape(num, rows // rows_per_example, rows_per_example, *x.shape[2:])
    x = jax.numpy.swapaxes(x, 0, 1)
    return x.reshape(num * rows, *x.shape[3:])


def check_divisible(batch_rows: int, num: int, rows_per_example: int, batch_shards: int) -> None:
    """Raises a ``ValueError`` unless ``B`` splits into ``num`` micro-batches evenly over the shards.

    Args:
        batch_rows: ``B``.
        num: number of micro-batches.
        rows_per_example: rows that must stay together (2 for DPO pairs).
        batch_shards: number of devices the batch rows are split over (``data * fsdp``).
    """
    unit = num * rows_per_example * batch_shards
    if num < 1 or batch_rows % unit:
        raise ValueError(
            f"batch of {batch_rows} rows cannot be split into {num} micro-batch(es) of whole "
            f"{rows_per_example}-row examples over {batch_shards} batch shard(s): B must be a multiple of "
            f"{num} x {rows_per_example} x {batch_shards} = {unit}"
        )


def split_microbatches(batch: Any, num: int, rows_per_example: int = 1) -> Any:
    """``[B, ...]`` leaves to ``[num, B / num, ...]``, micro-batch ``m`` holding example units ``m, m + num, ...``."""
    return jax.tree.map(lambda x: _split_leaf(x, num, rows_per_example), batch)


def merge_microbatches(stacked: Any, rows_per_example: int = 1) -> Any:
    """Inverse of ``split_microbatches``: ``[num, B / num, ...]`` back to ``[B, ...]`` in the original row order."""
    return jax.tree.map(lambda x: _merge_leaf(x, rows_per_example), stacked)
