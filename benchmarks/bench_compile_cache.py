"""The demo's start with an empty JAX compilation cache against a filled one, side by side (`feynrl_jax/cache_dirs.py`).

Runs `feynrl-jax train --config=configs/grpo_demo.py` for 2 steps twice with one fresh cache folder: first empty,
then holding what the first run compiled. Reports each run's wall time (start-up included), the evaluation before
training, and the first step's rollout and update, and the ratios.

    python benchmarks/bench_compile_cache.py          # about 2.5 minutes on 2 cores
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def demo_metrics(cache: str, run_dir: str, *overrides: str, steps: int = 2) -> tuple[float, dict[int, dict]]:
    """Runs the demo for `steps` steps (and the `--config.` `overrides`) with the compilation cache folder `cache`
    ("" turns it off); returns the command's wall seconds and its `metrics.jsonl` records by step."""
    env = dict(os.environ, JAX_COMPILATION_CACHE_DIR=cache, JAX_PLATFORMS="cpu", RAY_AUTH_MODE="disabled")
    env.update(WANDB_MODE="offline", TOKENIZERS_PARALLELISM="false")
    command = [sys.executable, "-m", "feynrl_jax.cli.main", "train", "--config=configs/grpo_demo.py"]
    command += [f"--config.train.steps={steps}", "--config.train.eval_every=0", f"--config.run_dir={run_dir}"]
    command += overrides
    start = time.perf_counter()
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if done.returncode:
        sys.exit(f"the demo failed:\n{done.stderr[-3000:]}")
    records = {}
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        for line in f:
            record = json.loads(line)
            records[record["step"]] = record
    return wall, records


def run_demo(cache: str, run_dir: str) -> dict[str, float]:
    wall, records = demo_metrics(cache, run_dir)
    return {
        "wall_seconds": wall,
        "eval_before_seconds": records[0]["perf/eval_seconds"],
        "first_rollout_seconds": records[1]["perf/rollout_seconds"],
        "first_update_seconds": records[1]["perf/train_update_seconds"],
    }


def main() -> None:
    with tempfile.TemporaryDirectory() as work:
        cache = os.path.join(work, "jax_compile_cache")
        empty = run_demo(cache, os.path.join(work, "empty"))
        filled = run_demo(cache, os.path.join(work, "filled"))
    for name, result in (("empty cache", empty), ("filled cache", filled)):
        print(f"{name:12s}: " + ", ".join(f"{k} {v:.1f}" for k, v in result.items()))
    print(json.dumps({f"{k}_ratio_empty_over_filled": empty[k] / filled[k] for k in empty}))


if __name__ == "__main__":
    main()
