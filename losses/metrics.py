"""Metrics that combine exactly across micro-batches, devices and hosts.

A :class:`Metric` holds a ``total`` and a ``weight`` with a static ``reduce``:

* ``"mean"``: ``total`` is a weighted sum, ``weight`` its weight; combining adds both; the value is
  ``total / weight``.
* ``"max"`` / ``"min"``: ``total`` is the extreme value over the valid entries (``-inf`` / ``+inf`` when there
  are none), ``weight`` the number of valid entries; combining takes the extreme and adds weights.
* ``"last"``: ``total`` is a counter or a schedule's value (the train step's ``train/step``,
  ``train/nonfinite_streak``, ``train/nonfinite_total``, ``train/learning_rate``), ``weight`` the number of
  records combined; combining keeps the later one's ``total``.

A "mean", "max" or "min" metric with weight 0 reads as 0. Metric names use the ``loss/`` namespace.

A step's several optimizer updates (PPO epochs, mini-batches) combine with :func:`combine_updates`, by each
metric's ``reduce``, never by its name. The train step reports its metrics per update: every "mean" metric
(the loss's own, ``train/loss``, ``train/grad_norm``, ...) as its value with weight 1, so the updates of a step
count equally; "max" / "min" metrics keep their count of valid entries, so an update with none is ignored.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

_REDUCES = ("mean", "max", "min", "last")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Metric:
    """A metric as (total, weight), reduced by the static ``reduce`` ("mean", "max", "min" or "last").

    Attributes:
        total: [] weighted sum ("mean"), extreme value ("max"/"min") or latest value ("last").
        weight: [] total weight ("mean"), number of valid entries ("max"/"min") or of records ("last").
        reduce: static; how ``total`` combines.
    """

    total: jax.Array
    weight: jax.Array
    reduce: str = dataclasses.field(default="mean", metadata=dict(static=True))

    def __post_init__(self):
        if self.reduce not in _REDUCES:
            raise ValueError(f"Metric.reduce must be one of {_REDUCES}, got {self.reduce!r}")

    @property
    def value(self) -> jax.Array:
        """The metric's value; 0 when its weight is 0 (a "last" metric reads its ``total`` as it is)."""
        if self.reduce == "last":
            return self.total
        if self.reduce == "mean":
            nonzero = self.weight != 0
            return jnp.where(nonzero, self.total / jnp.where(nonzero, self.weight, 1), 0)
        return jnp.where(self.weight > 0, self.total, 0)


def mean_metric(values: jax.Array, mask: jax.Array) -> Metric:
    """The mask-weighted mean of ``values`` (any shape, ``mask`` broadcastable), as a Metric."""
    values = jax.lax.stop_gradient(values)
    mask = jnp.broadcast_to(mask, values.shape).astype(values.dtype)
    return Metric(jnp.sum(values * mask), jnp.sum(mask), "mean")


def max_metric(values: jax.Array, mask: jax.Array) -> Metric:
    """The maximum of ``values`` over entries where ``mask`` is non-zero, as a Metric."""
    values = jax.lax.stop_gradient(values)
    mask = jnp.broadcast_to(mask, values.shape)
    return Metric(jnp.max(jnp.where(mask > 0, values, -jnp.inf)), jnp.sum(mask > 0).astype(values.dtype), "max")


def min_metric(values: jax.Array, mask: jax.Array) -> Metric:
    """The minimum of ``values`` over entries where ``mask`` is non-zero, as a Metric."""
    values = jax.lax.stop_gradient(values)
    mask = jnp.broadcast_to(mask, values.shape)
    return Metric(jnp.min(jnp.where(mask > 0, values, jnp.inf)), jnp.sum(mask > 0).astype(values.dtype), "min")


def scalar_metric(value: jax.Array, weight: jax.Array) -> Metric:
    """A batch-level value (e.g. an ESS) weighted by ``weight`` (e.g. its number of tokens)."""
    value = jax.lax.stop_gradient(value)
    return Metric(value * weight, jnp.asarray(weight, value.dtype), "mean")


def last_metric(value: jax.Array) -> Metric:
    """A counter or a schedule's value (e.g. ``train/step``): combining keeps the later record's."""
    value = jax.lax.stop_gradient(jnp.asarray(value))
    return Metric(value, jnp.ones((), jnp.float32), "last")


def _combine(name: str, a: Metric, b: Metric) -> Metric:
    if a.reduce != b.reduce:
        raise ValueError(f"metric {name!r}: cannot combine reduce={a.reduce!r} with reduce={b.reduce!r}")
    if a.reduce == "mean":
        total = a.total + b.total
    elif a.reduce == "last":
        total = b.total
    elif a.reduce == "max":
        total = jnp.maximum(a.total, b.total)
    else:
        total = jnp.minimum(a.total, b.total)
    return Metric(total, a.weight + b.weight, a.reduce)


def combine_metrics(a: dict[str, Metric], b: dict[str, Metric]) -> dict[str, Metric]:
    """Combines the metrics of two micro-batches (or devices) exactly.

    Raises:
        ValueError: naming the metric when the two dicts have different keys or reduces.
    """
    if a.keys() != b.keys():
        raise ValueError(f"cannot combine metrics with different names: {sorted(a.keys() ^ b.keys())}")
    return {name: _combine(name, a[name], b[name]) for name in a}


def compute_metrics(metrics: dict[str, Metric]) -> dict[str, jax.Array]:
    """Reads every metric's value (0 for a metric with weight 0)."""
    return {name: m.value for name, m in metrics.items()}


def combine_updates(records: Sequence[Mapping[str, Metric]]) -> dict[str, float]:
    """Combines the metrics of a step's optimizer updates on the host, each by its ``reduce``.

    "mean": ``sum(total) / sum(weight)`` (the train step gives each update's mean weight 1, so this is the plain
    mean of the per-update values); "max" / "min": the extreme over the updates with valid entries; "last": the
    last update's value. Sums run in float64. One record reads as its values, like ``compute_metrics``.

    Args:
        records: one ``{name: Metric}`` per update, in order (device or host arrays), all with the same names.

    Returns:
        ``{name: value}`` as Python floats; a "mean", "max" or "min" metric with total weight 0 reads as 0.

    Raises:
        ValueError: when there is no record, or the records differ in names or in a metric's reduce.
    """
    if not records:
        raise ValueError("combine_updates needs at least one record")
    names = records[0].keys()
    for record in records[1:]:
        if record.keys() != names:
            raise ValueError(f"cannot combine update metrics with different names: {sorted(names ^ record.keys())}")
    out = {}
    for name in names:
        reduce = records[0][name].reduce
        if any(r[name].reduce != reduce for r in records):
            raise ValueError(f"metric {name!r}: the updates disagree on its reduce")
        totals = np.asarray([np.asarray(r[name].total, np.float64) for r in records])
        weights = np.asarray([np.asarray(r[name].weight, np.float64) for r in records])
        if reduce == "last":
            out[name] = float(totals[-1])
        elif reduce == "mean":
            weight = weights.sum()
            out[name] = float(totals.sum() / weight) if weight != 0 else 0.0
        else:
            valid = totals[weights > 0]
            extreme = np.max if reduce == "max" else np.min
            out[name] = float(extreme(valid)) if valid.size else 0.0
    return out
