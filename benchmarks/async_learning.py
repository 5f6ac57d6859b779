"""Does async RL learn as well as sync, in less wall time? The demo job with k = 0 and k = 1, over seeds.

What it measures: for each seed in `--seeds` and each `train.max_staleness` k in (0, `--async-staleness`), the
demo job (`configs/grpo_demo.py`: GRPO on SmolLM2-135M-Instruct, 12 steps, held-out greedy accuracy on 64
reasoning-gym test prompts before training, every 6 steps and at the end) with the trainer actor pinned to core
0 and the rollout worker to core 1 (`train.cpu_cores=(0,)`, `rollout.cpu_cores=(1,)`, as they would each have
their own GPU; `--no-pin` leaves them unpinned). The claim it checks: the demo with k = 1 reaches the sync run's
held-out accuracy (within the spread of the seeds) in less wall time.

How: each run is `feynrl_jax.orchestration.rl_loop.run` in its own subprocess (Ray and JAX state are per
process) with its own run folder `<workdir>/seed<s>_k<k>`; the demo config is unchanged except for the seed,
the staleness, the pinning and the progress bar (and `--steps`, `--max-new-tokens`, `--eval-every` for smoke
runs). From each run's `metrics.jsonl` it takes `eval/accuracy` at step 0 (the evaluation before training,
wall time 0) and at every evaluated step, at the wall time of the end of that step: the cumulative
`perf/step_seconds` (a step's time includes its evaluation and checkpoint, so the curve's last point is the
wall time of the whole training; the rollout worker already generates during the evaluation before training,
step 1's batch with k = 0 and steps 1-2's with k = 1). A run folder whose metrics reach the last step and whose
`config.json` matches the run's config is reused, not rerun (so an interrupted series continues).

Usage:
    python benchmarks/async_learning.py                                # 3 seeds x 2 runs of the demo
    python benchmarks/async_learning.py --seeds 0 1 2 3 4 --plot docs/async_learning.png
    python benchmarks/async_learning.py --seeds 0 --steps 2 --eval-every 1 --max-new-tokens 8 \\
        --workdir /tmp/async_learning_smoke --plot /tmp/async_learning.png --json /tmp/async_learning.json  # smoke

Output: a line per run as it ends, a markdown table (seed | sync before -> after, seconds | async before ->
after, seconds) with the means, the JSON summary `--json` (per run: seed, k, accuracy before and after, wall
seconds of the training steps, and the curve) and the plot `--plot` (accuracy against wall time, one line per
run, sync and async in two colours).
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
import textwrap
import time
from pathlib import Path

from feynrl_jax.host_memory import reexec_with_allocator_tunables

reexec_with_allocator_tunables()  # before JAX allocates: every run inherits it

DEMO_CONFIG = Path(__file__).resolve().parents[1] / "configs" / "grpo_demo.py"
TRAINER_CORES, ROLLOUT_CORES = (0,), (1,)
COLOURS = {"sync": "tab:blue", "async": "tab:orange"}


def demo_config():
    """`get_config()` of `configs/grpo_demo.py`, loaded from its file (configs are not a package)."""
    spec = importlib.util.spec_from_file_location("grpo_demo_config", DEMO_CONFIG)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config()


def run_dir_of(args, seed: int, k: int) -> str:
    return os.path.join(args.workdir, f"seed{seed}_k{k}")


def run_config(args, seed: int, k: int):
    """The demo config of one run: its seed and staleness, the pinning, and the smoke-run overrides."""
    config = demo_config()
    config.name = f"async_learning_seed{seed}_k{k}"
    config.run_dir = run_dir_of(args, seed, k)
    config.seed = seed
    config.train.max_staleness = k
    if not args.no_pin:
        config.train.cpu_cores = TRAINER_CORES
        config.rollout.cpu_cores = ROLLOUT_CORES
    config.train.steps = args.steps
    config.train.eval_every = args.eval_every
    config.rollout.max_new_tokens = args.max_new_tokens
    config.eval.max_new_tokens = args.max_new_tokens
    config.data.max_seq_len = config.data.max_prompt_len + args.max_new_tokens
    config.checkpoint.resume = False  # an unfinished run folder fails instead of resuming (wall time would lie)
    config.tracking.progress_bar = False
    return config


def finished_run(run_dir: str, config) -> tuple[list[dict] | None, bool]:
    """`(metrics records, same settings)` of the run in `run_dir`: the records when they reach `config.train.steps`
    (else None), and whether its `config.json` is `config` (False where it has none)."""
    from feynrl_jax.tracking import read_metrics

    try:
        records = read_metrics(run_dir)
    except FileNotFoundError:
        records = []
    try:
        with open(os.path.join(run_dir, "config.json"), encoding="utf-8") as f:
            same = json.load(f) == json.loads(config.to_json_best_effort())
    except FileNotFoundError:
        same = False
    return (records if records and records[-1]["step"] == config.train.steps else None), same


def curve(args, seed: int, k: int) -> dict | None:
    """The run's held-out accuracy against wall time, or None when its metrics do not reach the last step."""
    run_dir = run_dir_of(args, seed, k)
    records, same = finished_run(run_dir, run_config(args, seed, k))
    if records is None or "eval/accuracy" not in records[-1]:
        return None
    if not same:
        raise SystemExit(f"{run_dir} was run with other settings (its config.json): choose another --workdir")
    steps, seconds, accuracy, wall = [], [], [], 0.0
    for record in records:
        wall += record.get("perf/step_seconds", 0.0)  # step 0 (the evaluation before training) has none
        if "eval/accuracy" in record:
            steps.append(int(record["step"]))
            seconds.append(wall)
            accuracy.append(record["eval/accuracy"])
    if steps[0] != 0:
        raise SystemExit(f"{run_dir}: no evaluation before training (step 0) in metrics.jsonl")
    return {
        "seed": seed,
        "max_staleness": k,
        "accuracy_before": accuracy[0],
        "accuracy_after": accuracy[-1],
        "wall_seconds": wall,
        "eval_steps": steps,
        "eval_seconds": seconds,
        "eval_accuracy": accuracy,
        "reward_mean": [r["rollout/reward/total/mean"] for r in records if "rollout/reward/total/mean" in r],
        "run_dir": run_dir,
    }


def run_all(args) -> list[dict]:
    """Runs (or reuses) every seed x k in a subprocess each; returns their curves in seed, k order."""
    env = child_env()
    runs = []
    for seed in args.seeds:
        for k in (0, args.async_staleness):
            result = curve(args, seed, k)
            run_dir = run_dir_of(args, seed, k)
            if result is None:
                if os.path.exists(run_dir):
                    raise SystemExit(f"{run_dir} holds an unfinished run: remove it or choose another --workdir")
                log_path = run_dir + ".log"
                command = [sys.executable, __file__, "--run-seed", str(seed), "--run-k", str(k)]
                command += ["--workdir", args.workdir, "--steps", str(args.steps)]
                command += ["--eval-every", str(args.eval_every), "--max-new-tokens", str(args.max_new_tokens)]
                command += ["--no-pin"] if args.no_pin else []
                print(f"seed {seed}, train.max_staleness={k}: running (log: {log_path})", file=sys.stderr, flush=True)
                t0 = time.perf_counter()
                with open(log_path, "w", encoding="utf-8") as log:
                    code = subprocess.run(
                        command, env=env, stdout=log, stderr=subprocess.STDOUT, check=False
                    ).returncode
                if code != 0:
                    tail = Path(log_path).read_text(encoding="utf-8")[-4000:]
                    raise SystemExit(f"seed {seed}, k={k} failed (exit {code}), log {log_path}:\n{tail}")
                result = curve(args, seed, k)
                if result is None:
                    raise SystemExit(f"{run_dir}: the run ended without metrics up to step {args.steps}")
                result["process_seconds"] = time.perf_counter() - t0
            else:
                print(f"seed {seed}, train.max_staleness={k}: reusing {run_dir}", file=sys.stderr, flush=True)
            print(json.dumps(result), flush=True)
            runs.append(result)
    return runs


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def _std(values: list[float]) -> float:
    m = _mean(values)
    return math.sqrt(sum((v - m) ** 2 for v in values) / (len(values) - 1)) if len(values) > 1 else 0.0


def seed_table(runs: list[dict], columns: dict, cell) -> str:
    """Markdown: one row per seed and a column per entry of `columns` (header -> which runs it holds), each run
    written by `cell(run)`, then the means of each column (before -> after +- the seeds' spread, wall seconds)."""
    seeds = sorted({r["seed"] for r in runs})
    held = {header: {r["seed"]: r for r in runs if holds(r)} for header, holds in columns.items()}
    lines = ["| seed | " + " | ".join(columns) + " |", "| --- |" + " --- |" * len(columns)]
    lines += [f"| {s} | " + " | ".join(cell(held[h][s]) for h in columns) + " |" for s in seeds]
    means = []
    for header in columns:
        group = [held[header][s] for s in seeds]
        after = [r["accuracy_after"] for r in group]
        means.append(
            f"{_mean([r['accuracy_before'] for r in group]):.3f} -> {_mean(after):.3f} +- {_std(after):.3f}, "
            f"{_mean([r['wall_seconds'] for r in group]):.0f} s"
        )
    lines.append("| mean (+- std over seeds) | " + " | ".join(means) + " |")
    return "\n".join(lines)


def table(runs: list[dict], async_k: int) -> str:
    """Markdown: one row per seed, sync and async side by side, then the means (and the seeds' spread)."""
    columns = {
        "sync (k=0) before -> after, seconds": lambda r: r["max_staleness"] == 0,
        f"async (k={async_k}) before -> after, seconds": lambda r: r["max_staleness"] == async_k,
    }
    return seed_table(
        runs, columns, lambda r: f"{r['accuracy_before']:.3f} -> {r['accuracy_after']:.3f}, {r['wall_seconds']:.0f} s"
    )


def verdict(runs: list[dict], async_k: int) -> dict:
    """The claim's two numbers: async's mean final accuracy against sync's range, and the wall-time ratio."""
    sync = [r for r in runs if r["max_staleness"] == 0]
    fast = [r for r in runs if r["max_staleness"] == async_k]
    sync_after = [r["accuracy_after"] for r in sync]
    async_after = _mean([r["accuracy_after"] for r in fast])
    return {
        "sync_accuracy_after_mean": _mean(sync_after),
        "sync_accuracy_after_range": [min(sync_after), max(sync_after)],
        "async_accuracy_after_mean": async_after,
        "async_within_sync_range_or_above": async_after >= min(sync_after),
        "sync_wall_seconds_mean": _mean([r["wall_seconds"] for r in sync]),
        "async_wall_seconds_mean": _mean([r["wall_seconds"] for r in fast]),
        "wall_time_ratio_async_over_sync": _mean([r["wall_seconds"] for r in fast])
        / _mean([r["wall_seconds"] for r in sync]),
    }


def plot_curves(
    runs: list[dict], path: str, *, colour, label, xlabel: str, ylabel: str, title: str, means: dict | None = None
) -> None:
    """Held-out accuracy against wall time, one line per run (`eval_seconds`, `eval_accuracy`), a marker per seed;
    `colour(run)` and `label(run)` name each line. `means`: label -> `(seconds, accuracy, colour)`, curves drawn
    thick as steps (each value held until the next). Drawn on a `Figure`: the pyplot backend is left alone."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4.5))
    ax = fig.subplots()
    seeds = sorted({r["seed"] for r in runs})
    markers = "os^Dv<>p*h"
    for r in runs:
        ax.plot(
            r["eval_seconds"],
            r["eval_accuracy"],
            color=colour(r),
            marker=markers[seeds.index(r["seed"]) % len(markers)],
            label=label(r),
        )
    for name, (seconds, accuracy, line_colour) in (means or {}).items():
        ax.plot(seconds, accuracy, color=line_colour, drawstyle="steps-post", linewidth=3, alpha=0.45, label=name)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    # A long title on two lines, not cut off at the figure's edges (names such as feynrl-jax kept whole).
    ax.set_title(textwrap.fill(title, 60, break_on_hyphens=False))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=120)


def child_env() -> dict[str, str]:
    """The environment of a benchmark's run subprocess: JAX on the CPU, Ray without a token, wandb and the Hugging
    Face hub offline."""
    return dict(
        os.environ,
        JAX_PLATFORMS="cpu",
        RAY_AUTH_MODE="disabled",
        WANDB_MODE="offline",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
    )


def plot(runs: list[dict], async_k: int, path: str) -> None:
    """Held-out accuracy against wall time, one line per run: sync in blue, async in orange."""
    seeds = ", ".join(map(str, sorted({r["seed"] for r in runs})))
    mode = lambda r: "sync" if r["max_staleness"] == 0 else "async"  # noqa: E731
    plot_curves(
        runs,
        path,
        colour=lambda r: COLOURS[mode(r)],
        label=lambda r: f"{mode(r)} (k={r['max_staleness']}), seed {r['seed']}",
        xlabel="wall time of training (s, cumulative perf/step_seconds)",
        ylabel="held-out accuracy (greedy)",
        title=f"grpo_demo, SmolLM2-135M: sync vs async (k={async_k}), seeds {seeds}",
    )


def main() -> None:
    demo = demo_config()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--async-staleness", type=int, default=1, help="train.max_staleness of the async runs")
    parser.add_argument("--steps", type=int, default=demo.train.steps)
    parser.add_argument("--eval-every", type=int, default=demo.train.eval_every)
    parser.add_argument("--max-new-tokens", type=int, default=demo.rollout.max_new_tokens, help="rollout and eval")
    parser.add_argument("--no-pin", action="store_true", help="do not pin the trainer and rollout actors")
    parser.add_argument("--workdir", default="runs/async_learning", help="run folders (finished ones are reused)")
    parser.add_argument("--json", default="docs/async_learning.json", help="the JSON summary")
    parser.add_argument("--plot", default="docs/async_learning.png")
    parser.add_argument("--run-seed", type=int, help=argparse.SUPPRESS)  # the subprocess's role
    parser.add_argument("--run-k", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.workdir = os.path.abspath(args.workdir)
    if args.async_staleness < 1:
        parser.error("--async-staleness must be >= 1")
    if args.run_seed is not None:
        from feynrl_jax.orchestration import rl_loop

        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
        rl_loop.run(run_config(args, args.run_seed, args.run_k))
        return

    os.makedirs(args.workdir, exist_ok=True)
    runs = run_all(args)
    summary = {
        "settings": {k: v for k, v in vars(args).items() if not k.startswith("run_")},
        "verdict": verdict(runs, args.async_staleness),
        "runs": runs,
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w", encoding="utf-8") as f:
        json.dump(summary, f, indent=1)
        f.write("\n")
    plot(runs, args.async_staleness, args.plot)
    print(table(runs, args.async_staleness))
    print(json.dumps(summary["verdict"]))
    print(f"summary: {args.json}; plot: {args.plot}", flush=True)


if __name__ == "__main__":
    main()
