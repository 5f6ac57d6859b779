"""Sync against async RL on this CPU: steady-state steps per second of the demo job, side by side.

What it measures: the RL loop on the demo job (`configs/grpo_demo.py`: GRPO on SmolLM2-135M-Instruct, 4 prompts
x 8 samples x 16 new tokens per step) with `train.max_staleness = 0` (sync: generate step t's batch, then train
on it) against `train.max_staleness = 1` (async: the rollout worker generates the next batch while the trainer
trains). The trainer actor is pinned to core 0 and the rollout worker to core 1 (`train.cpu_cores=(0,)`,
`rollout.cpu_cores=(1,)`), as they would each have their own GPU, in every leg; the legs differ in
`train.max_staleness` only. Two pairs of legs:

- plain: the demo's reward (GSM8K-style grading of the last number, milliseconds per batch);
- judge: the same plus a latency-bound reward (`rollout.rewards = {"gsm8k": 1.0, "latency": 0.0}`, the `latency`
  reward sleeping `delay_s` per completion with one reward process), so that scoring a batch waits
  `--judge-seconds` in total, like a remote judge or a code sandbox would.

How: each leg runs `feynrl_jax.orchestration.rl_loop.run` in its own subprocess (Ray and JAX state are per
process) with a fresh run folder, evaluation during training off, a checkpoint only at the end and no progress
bar, then this script reads the leg's `metrics.jsonl`. The first `--warmup` steps (JAX compiles there) and the
last step (it writes the final checkpoint) are left out; steady-state steps/s is the number of measured steps
over the sum of their `perf/step_seconds`. Each leg also reports the mean per-step `perf/rollout_seconds`,
`perf/reward_seconds`, `perf/train_seconds`, `perf/trainer_wait_seconds` (the trainer waiting for a batch) and
`perf/rollout_wait_params_seconds` (the rollout worker waiting for params), and the ideal speedup of perfect
overlap, `(rollout + reward + train) / max(rollout + reward, train)` from those means; the pair's summary takes
the sync leg's bound (its phases run alone, unhidden).

Usage:
    python benchmarks/bench_async.py                                    # both pairs, k = 0 and 1, 8 steps each
    python benchmarks/bench_async.py --which plain --out runs/bench_async.jsonl
    python benchmarks/bench_async.py --which judge --judge-seconds 3
    python benchmarks/bench_async.py --staleness 0 1 2                  # k = 0 is always run (the reference)
    python benchmarks/bench_async.py --steps 3 --warmup 1 --which plain  # smoke run

Output: one JSON line per leg, then one summary line per pair (and per k >= 1) with
`speedup = async_steps_per_second / sync_steps_per_second` and the ideal bound; `--out` appends the same lines
to a JSON-lines file. Each leg's log is `<workdir>/<pair>_k<k>.log`. Run it on an idle machine: the figures
belong in the README's speed table ("Speed on a CPU").
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import math
import os
import subprocess
import sys
import time
from pathlib import Path

from async_learning import child_env
from scratch import scratch_folder

from feynrl_jax.host_memory import reexec_with_allocator_tunables

reexec_with_allocator_tunables()  # before JAX allocates: every leg runs with it (the legs inherit the environment)

DEMO_CONFIG = Path(__file__).resolve().parents[1] / "configs" / "grpo_demo.py"
PAIRS = ("plain", "judge")
TRAINER_CORES, ROLLOUT_CORES = (0,), (1,)
PHASES = ("rollout", "reward", "train", "trainer_wait", "rollout_wait_params")
"""Per-step `perf/<phase>_seconds` metrics whose means each leg reports."""


def demo_config():
    """`get_config()` of `configs/grpo_demo.py`, loaded from its file (configs are not a package)."""
    spec = importlib.util.spec_from_file_location("grpo_demo_config", DEMO_CONFIG)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config()


def latency_delay(judge_seconds: float, batch_size: int, reward_workers: int) -> float:
    """`delay_s` per completion that makes a batch of `batch_size` completions wait `judge_seconds` in total."""
    return judge_seconds * reward_workers / batch_size


def leg_config(args, pair: str, max_staleness: int):
    """The demo config with this benchmark's settings; legs differ only in `pair` and `max_staleness`."""
    config = demo_config()
    config.name = f"bench_async_{pair}_k{max_staleness}"
    config.run_dir = os.path.join(args.workdir, f"{pair}_k{max_staleness}")
    config.train.steps = args.steps
    config.train.max_staleness = max_staleness
    if not args.no_pin:
        config.train.cpu_cores = TRAINER_CORES
        config.rollout.cpu_cores = ROLLOUT_CORES
    config.rollout.max_new_tokens = config.eval.max_new_tokens = args.max_new_tokens  # eval is off; it must fit
    config.data.max_seq_len = config.data.max_prompt_len + args.max_new_tokens
    config.eval.during_training = False
    config.checkpoint.every_steps = 0  # only the final step writes one (left out of the measurement)
    config.checkpoint.resume = False  # a leftover run folder fails instead of resuming
    config.tracking.progress_bar = False
    if pair == "judge":
        config.rollout.reward_workers = 1
        delay = latency_delay(args.judge_seconds, config.train.global_batch_size, config.rollout.reward_workers)
        config.rollout.rewards = {**config.rollout.rewards.to_dict(), "latency": 0.0}
        config.rollout.reward_kwargs = {**config.rollout.reward_kwargs.to_dict(), "latency": {"delay_s": delay}}
    return config


def run_leg(args) -> None:
    """The subprocess's role: one leg's RL run (its metrics land in the run folder's `metrics.jsonl`)."""
    from feynrl_jax.orchestration import rl_loop

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    rl_loop.run(leg_config(args, args.pair, args.k))


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else math.nan


def summarise_leg(args, pair: str, max_staleness: int, run_dir: str, wall_seconds: float) -> dict:
    """Steady-state steps/s and mean phase times of one leg, from its `metrics.jsonl`."""
    from feynrl_jax.tracking import read_metrics

    records = [r for r in read_metrics(run_dir) if r["step"] >= 1]
    steps = [int(r["step"]) for r in records]
    if steps != list(range(1, args.steps + 1)):
        raise SystemExit(f"{run_dir}: metrics.jsonl has steps {steps}, expected 1..{args.steps}")
    measured = [r for r in records if args.warmup < r["step"] < args.steps]
    seconds = sum(r["perf/step_seconds"] for r in measured)
    means = {phase: _mean([r.get(f"perf/{phase}_seconds", 0.0) for r in measured]) for phase in PHASES}
    generate = means["rollout"] + means["reward"]
    return {
        "pair": pair,
        "max_staleness": max_staleness,
        "measured_steps": [int(r["step"]) for r in measured],
        "steps_per_second": len(measured) / seconds,
        "seconds_per_step": seconds / len(measured),
        "warmup_step_seconds": [r["perf/step_seconds"] for r in records if r["step"] <= args.warmup],
        "last_step_seconds": records[-1]["perf/step_seconds"],
        "mean_seconds": means,
        "ideal_speedup": (generate + means["train"]) / max(generate, means["train"]),
        "version_lag_mean": _mean([r.get("rollout/version_lag_mean", math.nan) for r in measured]),
        "reward_mean": [r.get("rollout/reward/total/mean", math.nan) for r in records],
        "leg_wall_seconds": wall_seconds,
        "run_dir": run_dir,
    }


def emit(line: dict, out: str | None) -> None:
    text = json.dumps(line)
    print(text, flush=True)
    if out:
        with open(out, "a", encoding="utf-8") as f:
            f.write(text + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=8, help="RL steps per leg")
    parser.add_argument("--warmup", type=int, default=2, help="first steps left out (compilation)")
    parser.add_argument("--max-new-tokens", type=int, default=demo_config().rollout.max_new_tokens)
    parser.add_argument("--judge-seconds", type=float, default=1.5, help="judge pair: reward wait per batch")
    parser.add_argument("--staleness", type=int, nargs="+", default=[0, 1], help="train.max_staleness values")
    parser.add_argument("--which", choices=("all", *PAIRS), default="all")
    parser.add_argument("--no-pin", action="store_true", help="do not pin the trainer and rollout actors")
    parser.add_argument(
        "--workdir", default=None, help="run folders and logs (default: a temporary folder, removed on success)"
    )
    parser.add_argument("--out", default=None, help="also append the JSON lines to this file")
    parser.add_argument("--pair", choices=PAIRS, help=argparse.SUPPRESS)  # the subprocess's role
    parser.add_argument("--k", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.steps < args.warmup + 2:
        parser.error(f"--steps {args.steps} leaves no measured step after {args.warmup} warm-up steps and the last")
    if args.pair is not None:
        run_leg(args)
        return

    with scratch_folder(args.workdir, prefix="bench_async_") as workdir:
        args.workdir = os.path.abspath(workdir)
        os.makedirs(args.workdir, exist_ok=True)
        compare(args)


def compare(args) -> None:
    """Each pair's legs (`train.max_staleness` 0 and each of `--staleness`), each in its own subprocess."""
    env = child_env()
    ks = sorted({0, *args.staleness})
    pairs = PAIRS if args.which == "all" else (args.which,)
    settings = {k: v for k, v in vars(args).items() if k not in ("pair", "k")}
    for pair in pairs:
        legs = {}
        for k in ks:
            run_dir = os.path.join(args.workdir, f"{pair}_k{k}")
            log_path = run_dir + ".log"
            command = [sys.executable, __file__, "--pair", pair, "--k", str(k), "--workdir", args.workdir]
            command += ["--steps", str(args.steps), "--warmup", str(args.warmup)]
            command += ["--max-new-tokens", str(args.max_new_tokens), "--judge-seconds", str(args.judge_seconds)]
            command += ["--no-pin"] if args.no_pin else []
            print(f"{pair}, train.max_staleness={k}: running (log: {log_path})", file=sys.stderr, flush=True)
            t0 = time.perf_counter()
            with open(log_path, "w", encoding="utf-8") as log:
                code = subprocess.run(command, env=env, stdout=log, stderr=subprocess.STDOUT, check=False).returncode
            wall = time.perf_counter() - t0
            if code != 0:
                tail = Path(log_path).read_text(encoding="utf-8")[-4000:]
                raise SystemExit(f"{pair}, train.max_staleness={k} failed (exit {code}), log {log_path}:\n{tail}")
            legs[k] = summarise_leg(args, pair, k, run_dir, wall)
            emit(legs[k], args.out)
        sync = legs[0]
        for k in ks[1:]:
            emit(
                {
                    "summary": pair,
                    "max_staleness": k,
                    "sync_steps_per_second": sync["steps_per_second"],
                    "async_steps_per_second": legs[k]["steps_per_second"],
                    "speedup": legs[k]["steps_per_second"] / sync["steps_per_second"],
                    "ideal_speedup": sync["ideal_speedup"],
                    "settings": settings,
                },
                args.out,
            )


if __name__ == "__main__":
    main()
