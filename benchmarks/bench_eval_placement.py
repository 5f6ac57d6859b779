"""The trainer's first evaluation with its engine's decode state placed on the params' mesh from the start, against
the state left where JAX put it (one device), side by side.

The RL trainer (and SFT, DPO) evaluates on a native engine that takes the params where the trainer holds them: on
the trainer's mesh (`param_shardings`). That engine used to build its decode state (KV cache, per-slot fields) on one
device; the first programs that ran on it returned it on the mesh, so the decode dispatch and the per-slot programs
compiled a second time, for the new placement. Now (`rollout/native_engine.py`, `_cache_sharding_like`) the state
lives on the mesh from the start. "unplaced" is the engine as it was (`_cache_sharding_like` made to return None).

Each side runs in a fresh process with JAX's persistent compilation cache off, alternating for `--rounds` rounds:
the demo's trainer (`configs/grpo_demo.py`: SmolLM2-135M, 64 held-out prompts, greedy, 16 new tokens), built
without Ray and without compiling its update ahead (so nothing runs beside the evaluations), evaluates twice.
Reports per side the medians of:
  - `first_eval_seconds`, `first_eval_compile_seconds` and `first_eval_programs`: the first evaluation's wall time,
    the backend compile time on its thread (`feynrl_jax.compile_clock`) and the programs compiled;
  - `first_eval_dispatch_programs`: how many of them were the decode dispatch;
  - `second_eval_seconds`: the second evaluation (compiles nothing on either side);
and the ratios unplaced/placed. Both sides must score the same accuracy (the script fails otherwise).

    python benchmarks/bench_eval_placement.py            # 2 rounds: 4 processes, about 4 minutes on 2 cores
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

from bench_report import report_sides

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SIDES = ("placed", "unplaced")


def measure(side: str, run_dir: str) -> dict[str, float]:
    """In this process: the demo trainer's two evaluations (see the docstring)."""
    sys.path.insert(0, os.path.join(ROOT, "configs"))
    import grpo_demo

    from feynrl_jax.compile_clock import compile_clock
    from feynrl_jax.rollout import native_engine
    from feynrl_jax.train.rl_trainer import RLTrainer

    if side == "unplaced":
        native_engine._cache_sharding_like = lambda param_shardings: None
    config = grpo_demo.get_config()
    config.run_dir = run_dir
    config.train.compile_ahead = False
    trainer = RLTrainer(config)
    clock = compile_clock()
    result: dict[str, float] = {}
    try:
        trainer.start()
        for name in ("first", "second"):
            t0, names, seconds = time.perf_counter(), len(clock.names()), clock.seconds()
            metrics = trainer.evaluate(0)
            result[f"{name}_eval_seconds"] = time.perf_counter() - t0
            compiled = clock.names()[names:]
            if name == "first":
                result["first_eval_compile_seconds"] = clock.seconds() - seconds
                result["first_eval_programs"] = float(len(compiled))
                result["first_eval_dispatch_programs"] = float(compiled.count("jit(dispatch)"))
            result["accuracy"] = metrics["eval/accuracy"]
    finally:
        trainer.close()
    return result


def run_side(side: str) -> dict[str, float]:
    env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_COMPILATION_CACHE_DIR="", JAX_ENABLE_COMPILATION_CACHE="false")
    env.update(TOKENIZERS_PARALLELISM="false", WANDB_MODE="offline", HF_HUB_OFFLINE="1")
    with tempfile.TemporaryDirectory() as run_dir:
        done = subprocess.run(
            [sys.executable, __file__, "--side", side, "--run-dir", run_dir],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
        )
    if done.returncode:
        sys.exit(f"the {side} side failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json", default="", help="also write the results here")
    parser.add_argument("--side", choices=SIDES, help=argparse.SUPPRESS)  # a child process: one side
    parser.add_argument("--run-dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.side:
        print(json.dumps(measure(args.side, args.run_dir)))
        return
    runs: dict[str, list[dict[str, float]]] = {side: [] for side in SIDES}
    for round_ in range(args.rounds):
        for side in SIDES if round_ % 2 == 0 else SIDES[::-1]:
            result = run_side(side)
            runs[side].append(result)
            print(f"round {round_ + 1}, {side}: {json.dumps({k: round(v, 3) for k, v in result.items()})}", flush=True)
    accuracies = {r["accuracy"] for rs in runs.values() for r in rs}
    if len(accuracies) != 1:
        sys.exit(f"the two sides scored differently: {sorted(accuracies)}")
    report_sides(runs, "placed", "unplaced", settings=vars(args), json_path=args.json)


if __name__ == "__main__":
    main()
