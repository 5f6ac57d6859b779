"""The demo's first step with its programs compiled ahead and without, side by side, for one of two switches:
  - `--switch update` (default): `train.compile_ahead`, the trainer compiles its update in a thread of its own from
    start-up (`feynrl_jax/train/rl_trainer.py`, `RLTrainer._compile_update`) instead of at the first update;
  - `--switch rollout`: `rollout.warmup`, the rollout worker builds its engine on placeholder weights and compiles
    its programs at start-up, while the trainer starts (`rollout/native_engine.py`, `NativeEngine.warm_up`),
    instead of in the first generation.

Runs `feynrl-jax train --config=configs/grpo_demo.py` for `--steps` steps, each run in a fresh process with JAX's
persistent compilation cache off (every run compiles everything), the two sides alternating for `--rounds` rounds,
in two modes:
  - `eval`: the demo as it is: the trainer evaluates before training while the rollout worker generates the first
    batch;
  - `no_eval`: `eval.during_training=False`: the trainer waits for the first batch.
Reports medians per side and mode, and the ratios off/on:
  - `wall_seconds`: the whole command, start-up included;
  - `first_step_seconds`: step 1 as `benchmarks/learning_vs_trl.py` charges a step that follows an evaluation
    (`perf/step_seconds` less the evaluation and the checkpoint, plus the rollout worker's time for the batch that
    the trainer did not wait for, less the worker's first weight load where it built its engine). In mode
    `no_eval` the trainer waits for the whole batch, so the worker's part adds nothing;
  - `first_update_seconds`: step 1's `perf/train_update_seconds`;
  - `first_rollout_seconds`: step 1's `perf/rollout_seconds`, and `first_rollout_compile_seconds` the worker's
    compiles in it (`perf/rollout_compile_seconds`);
  - `eval_before_seconds` (mode `eval`): the evaluation before training.
The side that does not vary keeps the demo's default (on).

    python benchmarks/bench_compile_ahead.py                    # 2 rounds: 8 runs, about 12 minutes on 2 cores
    python benchmarks/bench_compile_ahead.py --switch rollout   # the same for the rollout worker's warm-up
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile

from bench_compile_cache import demo_metrics
from learning_vs_trl import charged_step_seconds

MODES = {"eval": [], "no_eval": ["--config.eval.during_training=False"]}
SWITCHES = {"update": "train.compile_ahead", "rollout": "rollout.warmup"}


def run_demo(key: str, ahead: bool, mode: str, steps: int, run_dir: str) -> dict[str, float]:
    overrides = ["--config.checkpoint.every_steps=0", f"--config.{key}={ahead}", *MODES[mode]]
    wall, records = demo_metrics("", run_dir, *overrides, steps=steps)
    first = records[1]
    result = {
        "wall_seconds": wall,
        "first_step_seconds": charged_step_seconds(first, paused=True),  # as after an evaluation
        "first_update_seconds": first["perf/train_update_seconds"],
        "first_rollout_seconds": first["perf/rollout_seconds"],
        "first_rollout_compile_seconds": first["perf/rollout_compile_seconds"],
    }
    if 0 in records:
        result["eval_before_seconds"] = records[0]["perf/eval_seconds"]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--modes", nargs="+", choices=sorted(MODES), default=list(MODES))
    parser.add_argument("--switch", choices=sorted(SWITCHES), default="update")
    args = parser.parse_args()
    key = SWITCHES[args.switch]
    results: dict[tuple[str, bool], list[dict[str, float]]] = {}
    with tempfile.TemporaryDirectory() as work:
        for r in range(args.rounds):
            for mode in args.modes:
                for ahead in (True, False) if r % 2 == 0 else (False, True):
                    run_dir = os.path.join(work, f"{mode}_{ahead}_{r}")
                    result = run_demo(key, ahead, mode, args.steps, run_dir)
                    results.setdefault((mode, ahead), []).append(result)
                    print(f"round {r}, {mode}, {key}={ahead}: {json.dumps(result)}", flush=True)
    summary = {}
    for mode in args.modes:
        medians = {
            ahead: {k: statistics.median(x[k] for x in results[(mode, ahead)]) for k in results[(mode, ahead)][0]}
            for ahead in (True, False)
        }
        for ahead in (True, False):
            print(f"{mode:8s} {key}={ahead!s:5s}: " + ", ".join(f"{k} {v:.1f}" for k, v in medians[ahead].items()))
        summary[mode] = {  # no ratio where the side "on" took no time (a compile it did not need)
            f"{k}_off_over_on": medians[False][k] / medians[True][k] if medians[True][k] else None
            for k in medians[True]
        }
        summary[mode] |= {"on": medians[True], "off": medians[False]}
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
