"""The summary of a benchmark that runs two sides several times: medians per side, their ratio, and a JSON file."""

from __future__ import annotations

import json
import statistics


def report_sides(
    runs: dict[str, list[dict[str, float]]], base: str, other: str, *, settings: dict, json_path: str
) -> None:
    """Prints the medians of each figure over the runs of the sides `base` and `other` and their ratio other/base,
    and writes them, the settings and the runs to `json_path` unless it is empty."""
    medians = {side: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for side, rs in runs.items()}
    ratios = {k: medians[other][k] / medians[base][k] for k in medians[base] if medians[base][k] > 0}
    print(f"\n{'':34} {base:>9} {other:>9} {other + '/' + base:>16}")
    for key in medians[base]:
        ratio = f"{ratios[key]:.2f}x" if key in ratios else ""
        print(f"{key:34} {medians[base][key]:9.2f} {medians[other][key]:9.2f} {ratio:>16}")
    if json_path:
        with open(json_path, "w") as f:
            json.dump({"settings": settings, "medians": medians, "ratios": ratios, "runs": runs}, f, indent=1)
