"""The fixed metric namespaces; every metric name starts with one of them (cleanrl-style)."""

from __future__ import annotations

NAMESPACES = ("loss/", "train/", "rollout/", "eval/", "perf/")
"""``loss/`` the objective and its parts, ``train/`` optimisation (lr, grad norm, data counters), ``rollout/``
generation (reward, lengths, KL to the behaviour policy), ``eval/`` held-out evaluation, ``perf/`` throughput
and timings."""


def check_metric_name(name: str) -> str:
    """Returns ``name`` if it lies in one of :data:`NAMESPACES` and has a non-empty rest; raises otherwise.

    Raises:
        ValueError: naming the metric and the allowed namespaces.
    """
    if not isinstance(name, str) or not any(name.startswith(ns) and len(name) > len(ns) for ns in NAMESPACES):
        raise ValueError(
            f"metric name {name!r} is outside the fixed namespaces {NAMESPACES}; rename it, e.g. 'train/{name}'"
        )
    return name
