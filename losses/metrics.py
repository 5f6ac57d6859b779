"""Metrics that combine exactly across micro-batches, devices and hosts.

A :class:`Metric` holds a ``total`` and a ``weight`` with a static ``reduce``:

* ``"mean"``: ``total`` is a weighted sum, ``weight`` its weight; combining adds both; the value is
  ``total / weight``.
* ``"max"`` / ``"min"``: ``total`` is the extreme value over the valid entries (``-inf`` / ``+inf`` when there
  are none), ``weight`` the number of valid entries; combining takes the extreme and adds weights.

A metric with weight 0 reads as 0. Metric names use the ``loss/`` namespace.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

_REDUCES = ("mean", "max", "min")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Metric:
    """A metric as (total, weight), reduced by the static ``reduce`` ("mean", "max" or "min").

    Attributes:
        total: [] weighted sum ("mean") or extreme value ("max"/"min").
        weight: [] total weight ("mean") or number of valid entries ("max"/"min").
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
        """The metric's value; 0 when its weight is 0."""
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


def _combine(name: str, a: Metric, b: Metric) -> Metric:
    if a.reduce != b.reduce:
        raise ValueError(f"metric {name!r}: cannot combine reduce={a.reduce!r} with reduce={b.reduce!r}")
    if a.reduce == "mean":
        total = a.total + b.total
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


def psum_metrics(metrics: dict[str, Metric], axis_name: str) -> dict[str, Metric]:
    """Combines metrics across a named mapped axis (inside ``shard_map``/``pmap``)."""
    out = {}
    for name, m in metrics.items():
        if m.reduce == "mean":
            total = jax.lax.psum(m.total, axis_name)
        elif m.reduce == "max":
            total = jax.lax.pmax(m.total, axis_name)
        else:
            total = jax.lax.pmin(m.total, axis_name)
        out[name] = Metric(total, jax.lax.psum(m.weight, axis_name), m.reduce)
    return out


def compute_metrics(metrics: dict[str, Metric]) -> dict[str, jax.Array]:
    """Reads every metric's value (0 for a metric with weight 0)."""
    return {name: m.value for name, m in metrics.items()}
