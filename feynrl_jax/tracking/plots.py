"""PNG curves of a run from its ``metrics.jsonl`` (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

import os
from collections.abc import Callable

from feynrl_jax.tracking.metrics_file import read_metrics


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
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_metrics(run_dir)
    names = sorted({k for r in records for k in r if k not in ("step", "time")})
    out_dir = os.path.join(run_dir, "plots")
    os.makedirs(out_dir, exist_ok=True)
    paths = []
    for panel, selects in PANELS.items():
        chosen = [n for n in names if selects(n)]
        series = {}
        for name in chosen:
            points = [(r["step"], r[name]) for r in records if isinstance(r.get(name), int | float)]
            if points:
                series[name] = points
        if not series:
            continue
        fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
        for name, points in series.items():
            steps, values = zip(*points)
            ax.plot(steps, values, marker="." if len(points) < 50 else None, label=name)
        ax.set_xlabel("step")
        ax.set_title(f"{panel} - {os.path.basename(os.path.normpath(run_dir))}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
        fig.tight_layout()
        path = os.path.join(out_dir, f"{panel}.png")
        fig.savefig(path)
        plt.close(fig)
        paths.append(path)
    return paths
