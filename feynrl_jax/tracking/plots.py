"""PNG curves of a run from its ``metrics.jsonl``.

Figures are drawn with matplotlib's object-oriented API and saved through its Agg canvas: no display is needed,
and the process's pyplot backend is left alone (a notebook that calls :func:`plot_run` keeps showing its plots).
"""

from __future__ import annotations

import os
from collections.abc import Callable

from feynrl_jax.tracking.metrics_file import metric_series, read_metrics


def _is_rate(name: str) -> bool:
    return any(part in name for part in ("per_s", "throughput", "/s", "mfu"))


PANELS: dict[str, Callable[[str], bool]] = {
    "loss": lambda name: name.startswith("loss/"),
    "reward": lambda name: "reward" in name,
    "kl": lambda name: "kl" in name.partition("/")[2].lower(),
    "entropy": lambda name: "entropy" in name,
    "lengths": lambda name: "length" in name or name.endswith("_len"),
    "throughput": lambda name: name.startswith("perf/") and _is_rate(name),
    "timing": lambda name: name.startswith("perf/") and not _is_rate(name),
}
"""Plot name -> which metric names it draws. A metric can appear in several plots (e.g. ``loss/kl`` in loss)."""


def plot_run(run_dir: str) -> list[str]:
    """Writes one PNG per panel of :data:`PANELS` that has data into ``run_dir/plots/``.

    Args:
        run_dir: a run folder with ``metrics.jsonl`` (malformed lines, such as a last line cut short by a crash,
            are skipped with a warning; see :func:`read_metrics`).

    Returns:
        The paths written (``run_dir/plots/<panel>.png``), in :data:`PANELS` order; a panel whose metrics never
        appear is left out.
    """
    from matplotlib.figure import Figure

    records = read_metrics(run_dir)
    names = sorted({k for r in records for k in r if k not in ("step", "time")})
    out_dir = os.path.join(run_dir, "plots")
    os.makedirs(out_dir, exist_ok=True)
    paths = []
    for panel, selects in PANELS.items():
        chosen = [n for n in names if selects(n)]
        series = {name: metric_series(records, name) for name in chosen}
        series = {name: curve for name, curve in series.items() if curve[0]}
        if not series:
            continue
        fig = Figure(figsize=(7, 4), dpi=100)
        ax = fig.subplots()
        for name, (steps, values) in series.items():
            ax.plot(steps, values, marker="." if len(steps) < 50 else None, label=name)
        ax.set_xlabel("step")
        ax.set_title(f"{panel} - {os.path.basename(os.path.normpath(run_dir))}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
        fig.tight_layout()
        path = os.path.join(out_dir, f"{panel}.png")
        fig.savefig(path)
        paths.append(path)
    return paths
