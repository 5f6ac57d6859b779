"""The trainer's evaluation engine freed between evaluations (`eval.release_memory`) against kept, side by side.

The RL trainer evaluates the policy on a native engine of its own between updates. Kept, that engine holds its
copy of the params and its KV cache from one evaluation to the next, allocated while the update's buffers were
free: the next update cannot take its large buffers from the pages the evaluation touched, and takes fresh pages,
which a virtual machine backs slowly (`feynrl_jax/host_memory.py`). Freed (`NativeEngine.release_memory`, the
default), the evaluation leaves nothing behind.

Runs `feynrl-jax train --config=configs/grpo_demo.py` for `--steps` steps with an evaluation after every step
(`train.eval_every=1`, as `benchmarks/learning_vs_trl.py` runs it), each run in a fresh process with JAX's
persistent compilation cache off, the two sides alternating for `--rounds` rounds. Reports per side the medians of:
  - `update_seconds_step<k>`: step k's `perf/train_update_seconds`, and `update_system_seconds_step<k>`: the
    trainer process's CPU time in the kernel during it (`perf/train_update_system_seconds`: faulting fresh pages);
  - `later_update_seconds`: the mean update time of steps 2 and on;
  - `trainer_peak_rss_gib`: the trainer process's peak resident memory (`perf/train_peak_rss_gib` at the last step);
  - `eval_seconds`: the mean evaluation time after steps 1 and on (the freed engine builds its cache again);
  - `wall_seconds`: the whole command, start-up included;
and the ratios kept/freed.

    python benchmarks/bench_eval_release.py        # 2 rounds of 4 steps: 4 runs, about 8 minutes on 2 cores
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile

from bench_compile_cache import demo_metrics
from bench_report import report_sides

SIDES = {"freed": True, "kept": False}


def run_demo(release: bool, steps: int, run_dir: str) -> dict[str, float]:
    overrides = ["--config.checkpoint.every_steps=0", "--config.train.eval_every=1"]
    overrides.append(f"--config.eval.release_memory={release}")
    wall, records = demo_metrics("", run_dir, *overrides, steps=steps)
    result = {"wall_seconds": wall}
    for step in range(1, steps + 1):
        result[f"update_seconds_step{step}"] = records[step]["perf/train_update_seconds"]
        result[f"update_system_seconds_step{step}"] = records[step]["perf/train_update_system_seconds"]
    result["later_update_seconds"] = statistics.mean(
        records[step]["perf/train_update_seconds"] for step in range(2, steps + 1)
    )
    result["trainer_peak_rss_gib"] = records[steps]["perf/train_peak_rss_gib"]
    result["eval_seconds"] = statistics.mean(records[step]["perf/eval_seconds"] for step in range(1, steps + 1))
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4, help="at least 2: the second update is the one that changes")
    parser.add_argument("--json", default="", help="also write the results here")
    args = parser.parse_args()
    if args.steps < 2:
        parser.error("--steps must be at least 2")
    runs: dict[str, list[dict[str, float]]] = {side: [] for side in SIDES}
    for round_ in range(args.rounds):
        for side, release in SIDES.items():
            with tempfile.TemporaryDirectory() as run_dir:
                result = run_demo(release, args.steps, run_dir)
            runs[side].append(result)
            print(f"round {round_ + 1}, {side}: {json.dumps({k: round(v, 2) for k, v in result.items()})}", flush=True)
    report_sides(runs, "freed", "kept", settings=vars(args), json_path=args.json)


if __name__ == "__main__":
    main()
