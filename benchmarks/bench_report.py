"""Benchmarks that run two sides several times: each side in a fresh process, the sides alternating
(`alternate_sides`), and the summary: medians per side, their ratio, and a JSON file (`report_sides`)."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from collections.abc import Mapping, Sequence


def alternate_sides(
    script: str, sides: Sequence[str], rounds: int, args: Sequence[str] = (), env: Mapping[str, str] | None = None
) -> dict[str, list[dict]]:
    """Runs `python script --side <side> *args` in a fresh process for each side in turn, `rounds` times (so a change
    of the machine's speed weighs on every side), and returns each side's results: the JSON object its last line of
    output printed, one per round. A side that fails stops the benchmark with the end of its stderr."""
    results: dict[str, list[dict]] = {side: [] for side in sides}
    for _ in range(rounds):
        for side in sides:
            command = [sys.executable, script, "--side", side, *args]
            done = subprocess.run(command, capture_output=True, text=True, check=False, env=env)
            if done.returncode:
                sys.exit(f"side {side} failed:\n{done.stderr[-3000:]}")
            results[side].append(json.loads(done.stdout.strip().splitlines()[-1]))
            print(side, results[side][-1], file=sys.stderr, flush=True)
    return results


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
