"""The host allocator's retention (`feynrl_jax/host_memory.py`, `FEYNRL_RETAIN_MEMORY`) off against on, side by side.

Three measurements, each run once with the retention tunables and once without (glibc huge pages in both):

1. **Pages touched again after a pause.** A process allocates and fills a 2 GB array, frees it, waits 3 s (as an
   RL update waits for the rollout or an evaluation) and does it again, 4 times. Reports the fill rate of the first
   round and of the later ones. Where the virtual machine's host takes freed guest memory back, the later rounds
   are as slow as the first without retention.
2. **Our GRPO step** (`bench_grpo_vs_trl.py --which ours`, 64 new tokens unless `--max-new-tokens` says otherwise):
   seconds per step, the update's seconds and the peak PSS of the run's processes, each setting in its own
   subprocess, one after the other.
3. **bfloat16 forward+backward** against PyTorch bf16 autocast (`bench_model_fwd_bwd.py --precision bfloat16`), with
   `--fwd-bwd` only: where one arena costs (many cores), both sides slow down under retention.

    python benchmarks/bench_allocator.py                  # 1 and 2 (about 8 minutes on 2 cores)
    python benchmarks/bench_allocator.py --skip-grpo      # the page measurement only (seconds)
    python benchmarks/bench_allocator.py --skip-grpo --fwd-bwd   # 1 and 3 (the 16-core AMX host's figures)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from feynrl_jax import host_memory  # noqa: E402

TOUCH = textwrap.dedent(
    """
    import json, time
    import numpy as np
    rates = []
    for round in range(4):
        start = time.perf_counter()
        block = np.ones(2 * 10**9 // 8)
        rates.append(2.0 / (time.perf_counter() - start))
        del block
        time.sleep(3)
    print(json.dumps(rates))
    """
)


def env_for(retain: bool) -> dict[str, str]:
    """This environment with huge pages, and the retention tunables or none of them."""
    env = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", "_FEYNRL_REEXECED")}
    env["GLIBC_TUNABLES"] = ":".join(host_memory.HUGE_PAGES + (host_memory.RETAIN if retain else ()))
    env["FEYNRL_RETAIN_MEMORY"] = "1" if retain else "0"
    env["_FEYNRL_REEXECED"] = "1"  # the tunables are set here; no child re-executes itself with others
    return env


def last_json(stdout: str) -> dict:
    return json.loads([line for line in stdout.splitlines() if line.startswith("{")][-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--skip-grpo", action="store_true", help="only the pages measurement")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--fwd-bwd", action="store_true", help="also bf16 forward+backward against PyTorch")
    args = parser.parse_args()
    print(f"usable cpus: {host_memory.usable_cpus()}; huge pages in both; retention: {':'.join(host_memory.RETAIN)}")

    for retain in (False, True):
        done = subprocess.run([sys.executable, "-c", TOUCH], env=env_for(retain), capture_output=True, text=True)
        done.check_returncode()
        rates = json.loads(done.stdout.strip().splitlines()[-1])
        later = sum(rates[1:]) / len(rates[1:])
        print(
            f"pages, retention {'on ' if retain else 'off'}: first fill {rates[0]:.2f} GB/s, "
            f"after a pause {later:.2f} GB/s"
        )
    if args.fwd_bwd:
        for retain in (False, True):
            command = [sys.executable, str(ROOT / "benchmarks" / "bench_model_fwd_bwd.py"), "--precision", "bfloat16"]
            done = subprocess.run(command + ["--steps", "6"], env=env_for(retain), capture_output=True, text=True)
            if done.returncode:
                sys.exit(f"bench_model_fwd_bwd failed (retention {retain}):\n{done.stderr[-3000:]}")
            lines = [line for line in done.stdout.splitlines() if "s/step" in line or line.startswith("ratio")]
            print(f"forward+backward, retention {'on ' if retain else 'off'}: " + "; ".join(lines))
    if args.skip_grpo:
        return

    results = {}
    for retain in (False, True):
        command = [
            sys.executable,
            str(ROOT / "benchmarks" / "bench_grpo_vs_trl.py"),
            "--which",
            "ours",
            "--steps",
            str(args.steps),
            "--prompts",
            "4",
            "--group",
            "8",
            "--max-new-tokens",
            str(args.max_new_tokens),
        ]
        done = subprocess.run(command, env=env_for(retain), capture_output=True, text=True)
        if done.returncode:
            sys.exit(f"bench_grpo_vs_trl failed (retention {retain}):\n{done.stderr[-3000:]}")
        result = last_json(done.stdout)
        results[retain] = result
        print(
            f"GRPO step, retention {'on ' if retain else 'off'}: {result['seconds_per_step']:.2f} s/step "
            f"(first {result['first_step_seconds']:.1f} s), "
            f"update {result['time_split_seconds']['train_update']:.2f} s, "
            f"peak PSS {result['peak_pss_gib']:.2f} GiB"
        )
    off, on = results[False], results[True]
    summary = {
        "max_new_tokens": args.max_new_tokens,
        "step_speedup": off["seconds_per_step"] / on["seconds_per_step"],
        "update_speedup": off["time_split_seconds"]["train_update"] / on["time_split_seconds"]["train_update"],
        "first_step_ratio_on_over_off": on["first_step_seconds"] / off["first_step_seconds"],
        "peak_pss_ratio_on_over_off": on["peak_pss_gib"] / off["peak_pss_gib"],
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
