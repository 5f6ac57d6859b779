"""GRPO on SmolLM2-135M-Instruct on this CPU: feynrl-jax's Ray sync loop against TRL's `GRPOTrainer`.

Both sides train the same model (the shipped GGUF, converted once to a Hugging Face folder that both load) on
the same prompts (reasoning-gym `chain_sum`, 2 one-digit terms, the same system prompt and chat template), with
the same group size, completion length, batch (prompts x group), learning rate, temperature 1, no KL term and
one optimizer update per step; both score with the project's reasoning-gym reward. Each side runs in its own
subprocess (JAX and PyTorch never share a process) and reports the wall time of every RL step (generation,
scoring, update) and the generated tokens per second. The first step is reported apart (JAX compiles there) and
the comparison uses the mean of the later steps.

Usage:
    pip install "trl==1.16.0"      # not a dependency of the project (the `bench` extra); torch/transformers unchanged
    python benchmarks/bench_grpo_vs_trl.py --steps 4 --prompts 4 --group 8 --max-new-tokens 32
    python benchmarks/bench_grpo_vs_trl.py --which ours      # one side only
    python benchmarks/bench_grpo_vs_trl.py --precision bfloat16   # ours: bf16 weights/compute, f32 masters;
                                                                  # TRL: bf16=True (autocast)
    python benchmarks/bench_grpo_vs_trl.py --remat full      # ours: model.remat="full"
    python benchmarks/bench_grpo_vs_trl.py --also-remat full # ours twice, the second with model.remat="full",
                                                             # then TRL (the remat policies side by side)
    python benchmarks/bench_grpo_vs_trl.py --colocate        # ours: rollout.colocate=True (the engine in the
                                                             # trainer's process, as TRL's generation is)
    python benchmarks/bench_grpo_vs_trl.py --which placement # ours twice: a rollout worker, then colocated

Output: one JSON line per side and a summary line with the ratio `trl_seconds_per_step / ours_seconds_per_step`
(with `--also-remat P` also `ours_P_seconds_per_step`, `ours_P_speedup_vs_trl`, and `remat_speedup` /
`remat_update_speedup`: ours under P over ours under `--remat`, per step and per update, above 1 where `--remat` is
faster) and each side's peak memory (`run_side`: summed over the side's process tree, Ray's processes included; as
resident memory, which counts a page shared between processes in each, and as PSS, which counts it once).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import threading
import time

from scratch import scratch_folder

from feynrl_jax.host_memory import reexec_with_allocator_tunables

reexec_with_allocator_tunables()  # before jax/torch allocate: both sides of every comparison run with it

SYSTEM_PROMPT = "Reply with only the final answer."
# TRL's settings shared by every comparison: one update per generated batch, a log record per step, on the CPU,
# nothing saved or reported elsewhere.
TRL_RUN_SETTINGS = dict(
    num_iterations=1,
    gradient_accumulation_steps=1,
    logging_steps=1,
    save_strategy="no",
    report_to="none",
    use_cpu=True,
    dataloader_num_workers=0,
)
TASK, TASK_OPTIONS = "chain_sum", {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}


def prompts_for(args) -> list[dict]:
    """The benchmark's prompts: `steps x prompts` reasoning-gym items, in order (no shuffling on either side)."""
    from feynrl_jax.data.reasoning_gym_source import reasoning_gym_source

    source = reasoning_gym_source(TASK, size=args.steps * args.prompts, seed=0, config=TASK_OPTIONS)
    return list(source.examples)


def run_ours(args) -> dict:
    """The feynrl-jax side: `rl_loop.run` on a config with the benchmark's settings."""
    from feynrl_jax.config.base import add_data_source, base_config, data_source
    from feynrl_jax.models.config import ModelConfig
    from feynrl_jax.orchestration import rl_loop
    from feynrl_jax.tracking import read_metrics
    from feynrl_jax.train.run_setup import lora_fields

    config = base_config()
    config.paradigm, config.name = "rl", "bench_grpo"
    # One folder per placement and policy: with --also-remat two runs of ours share the workdir.
    config.run_dir = os.path.join(args.workdir, ("ours_colocated" if args.colocate else "ours") + f"_{args.remat}")
    config.model.gguf = "smollm2"
    size = args.steps * args.prompts
    add_data_source(config, "arith", data_source("reasoning_gym", task=TASK, size=size, seed=0, options=TASK_OPTIONS))
    add_data_source(
        config,
        "arith_test",
        data_source("reasoning_gym", task=TASK, split="test", size=8, seed=0, options=TASK_OPTIONS),
    )
    config.data.system_prompt = SYSTEM_PROMPT
    config.data.max_prompt_len = 64
    config.data.max_seq_len = 64 + args.max_new_tokens
    config.algo.name, config.algo.kl_coef, config.algo.reference = "grpo", 0.0, "none"
    config.rollout.n_samples = args.group
    config.rollout.max_new_tokens = args.max_new_tokens
    config.eval.max_new_tokens = args.max_new_tokens
    config.rollout.max_slots = args.prompts * args.group
    config.optim.lr = args.lr
    config.model.remat = args.remat
    config.rollout.colocate = args.colocate
    if args.precision == "bfloat16":  # bfloat16 weights and compute, float32 master weights and optimizer state
        config.model.param_dtype = config.model.compute_dtype = "bfloat16"
        config.model.master_dtype = "float32"
    config.train.steps = args.steps
    config.train.global_batch_size = args.prompts * args.group
    config.eval.during_training = False
    config.checkpoint.every_steps = 0
    config.checkpoint.async_save = True
    config.tracking.progress_bar = False
    config.ray.num_cpus = os.cpu_count()
    rl_loop.run(config)
    records = read_metrics(config.run_dir)
    later = records[1:] or records
    split = ("rollout", "reward", "train_prep", "train_update", "publish")
    return {
        "step_seconds": [r["perf/step_seconds"] for r in records],
        "generated_tokens": [r["rollout/generated_tokens"] for r in records],
        "reward_mean": [r["rollout/reward/total/mean"] for r in records],
        # Where a step's time goes (mean of the steps after the first).
        "time_split_seconds": {k: sum(r.get(f"perf/{k}_seconds", 0.0) for r in later) / len(later) for k in split},
        "shared_prefix": records[-1].get("train/shared_prefix", 0.0),
        "micro_batch_size": records[-1].get("train/micro_batch_size"),
        "micro_batches": records[-1].get("train/micro_batches"),
        "micro_batches_run": records[-1].get("train/micro_batches_run"),
        "pack_fill": records[-1].get("train/pack_fill"),
        # The policy "auto" resolved to on this backend, compute dtype and LoRA keys (ModelConfig.resolved_remat).
        "remat": ModelConfig(
            remat=args.remat, compute_dtype=config.model.compute_dtype, **lora_fields(config.model.lora)
        ).resolved_remat(),
    }


def run_trl(args) -> dict:
    """The TRL side: `GRPOTrainer` on the same model folder, prompts and settings, on CPU."""
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from feynrl_jax.checkpoints import smollm2_checkpoint_dir
    from feynrl_jax.rollout.rewards.reasoning_gym_reward import reasoning_gym_reward

    torch.set_num_threads(os.cpu_count() or 1)
    examples = prompts_for(args)
    rows = [
        {
            "prompt": [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": e["prompt"]}],
            "example": json.dumps({"answer": e["answer"], "metadata": e["metadata"], "question": e["prompt"]}),
        }
        for e in examples
    ]

    def reward(prompts, completions, example, **kwargs):
        return [
            reasoning_gym_reward("", c[0]["content"], json.loads(x)) for c, x in zip(completions, example, strict=True)
        ]

    class StepTimer(TrainerCallback):
        def __init__(self):
            self.begin, self.seconds, self.tokens, self.rewards = 0.0, [], [], []

        def on_step_begin(self, *a, **k):
            self.begin = time.perf_counter()

        def on_step_end(self, *a, **k):
            self.seconds.append(time.perf_counter() - self.begin)

        def on_log(self, _args, _state, _control, logs=None, **k):
            if logs and "completions/mean_length" in logs:
                self.tokens.append(logs["completions/mean_length"] * args.prompts * args.group)
                self.rewards.append(logs.get("reward", float("nan")))

    config = GRPOConfig(
        output_dir=os.path.join(args.workdir, "trl"),
        per_device_train_batch_size=args.prompts * args.group,
        num_generations=args.group,
        max_completion_length=args.max_new_tokens,
        learning_rate=args.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        max_steps=args.steps,
        beta=0.0,
        temperature=1.0,
        bf16=args.precision == "bfloat16",
        seed=0,
        shuffle_dataset=False,
        **TRL_RUN_SETTINGS,
    )
    timer = StepTimer()
    trainer = GRPOTrainer(
        model=smollm2_checkpoint_dir(),
        reward_funcs=reward,
        args=config,
        train_dataset=Dataset.from_list(rows),
        callbacks=[timer],
    )
    trainer.train()
    return {"step_seconds": timer.seconds, "generated_tokens": timer.tokens, "reward_mean": timer.rewards}


def summarise(name: str, result: dict) -> dict:
    later = result["step_seconds"][1:] or result["step_seconds"]
    tokens = result["generated_tokens"][1:] or result["generated_tokens"]
    seconds = sum(later) / len(later)
    return {
        "side": name,
        "first_step_seconds": result["step_seconds"][0],
        "seconds_per_step": seconds,
        "generated_tokens_per_second": (sum(tokens) / len(tokens)) / seconds,
        **result,
    }


def run_side(command: list[str], env: dict[str, str]) -> tuple[subprocess.CompletedProcess, float, float]:
    """Runs one side's subprocess; returns it and two peaks of the memory of its process tree (the side's own
    process and everything it starts: Ray's raylet, GCS, the trainer and rollout actors, reward workers), in GiB,
    sampled every 0.2 s:

    * the summed resident memory (RSS): a page shared between processes counts once in each (Ray's object
      store maps one copy of the published weights into the trainer, the store and the rollout worker);
    * the summed proportional set size (PSS, Linux `smaps_rollup`): a page shared by `n` processes counts
      `1 / n` in each, so the tree's memory counts every page once: what the machine holds for the side.
      Reading it walks each process's page tables, so it is sampled every 1 s only (every fifth sample).
    """
    import psutil

    proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    peak = {"rss": 0, "pss": 0}
    at_peak: dict[str, dict[str, float]] = {"rss": {}, "pss": {}}
    done = threading.Event()

    def sample() -> None:
        root = psutil.Process(proc.pid)
        count = 0
        while not done.is_set():
            kinds = ("rss", "pss") if count % 5 == 0 else ("rss",)
            count += 1
            try:
                tree = [root, *root.children(recursive=True)]
                totals, parts = {kind: 0 for kind in kinds}, {kind: {} for kind in kinds}
                for p in tree:
                    try:
                        name = (p.cmdline() or [p.name()])[0].split("/")[-1][:40]
                        values = {"rss": p.memory_info().rss}
                    except psutil.Error:
                        continue
                    if "pss" in kinds:
                        with contextlib.suppress(psutil.Error):
                            values["pss"] = p.memory_full_info().pss
                    for kind, value in values.items():
                        totals[kind] += value
                        parts[kind][name] = parts[kind].get(name, 0) + value
                for kind, total in totals.items():
                    if total > peak[kind]:
                        peak[kind] = total
                        at_peak[kind] = {k: round(v / 2**30, 2) for k, v in parts[kind].items() if v > 2**27}
            except psutil.Error:
                pass
            done.wait(0.2)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    stdout, stderr = proc.communicate()
    done.set()
    thread.join()
    for kind in peak:
        print(f"peak {kind} by process (GiB): {json.dumps(at_peak[kind])}", file=sys.stderr, flush=True)
    completed = subprocess.CompletedProcess(command, proc.returncode, stdout, stderr)
    return completed, peak["rss"] / 2**30, peak["pss"] / 2**30


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--prompts", type=int, default=4, help="prompts per step")
    parser.add_argument("--group", type=int, default=8, help="completions per prompt")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--lr", type=float, default=1e-6)
    parser.add_argument("--precision", choices=("float32", "bfloat16"), default="float32", help="both sides")
    parser.add_argument("--remat", choices=("auto", "none", "dots", "full"), default="auto", help="ours: model.remat")
    parser.add_argument("--colocate", action="store_true", help="ours: rollout.colocate=True")
    parser.add_argument(
        "--also-remat",
        choices=("auto", "none", "dots", "full"),
        default=None,
        help="with --which both: ours again with this model.remat, between ours and TRL",
    )
    parser.add_argument(
        "--which",
        choices=("both", "ours", "trl", "placement"),
        default="both",
        help="placement: ours with a rollout worker, then ours colocated (--colocate is then ignored)",
    )
    parser.add_argument("--side", choices=("ours", "trl"), help=argparse.SUPPRESS)  # the subprocess's role
    parser.add_argument(
        "--workdir", default=None, help="both sides' run folders (default: a temporary folder, removed on success)"
    )
    args = parser.parse_args()
    if args.side is not None:
        result = run_ours(args) if args.side == "ours" else run_trl(args)
        print("RESULT " + json.dumps(summarise(args.side, result)), flush=True)
        return
    if args.also_remat is not None:
        if args.which != "both":
            raise SystemExit("--also-remat compares ours under two remat policies beside TRL: use it with --which both")
        if args.also_remat == args.remat:
            raise SystemExit(f"--also-remat {args.also_remat} is --remat already: name another policy")
    with scratch_folder(args.workdir, prefix="bench_grpo_") as workdir:
        compare(args, workdir)


def compare(args, workdir: str) -> None:
    """Runs the sides `--which` names, each in its own subprocess, and prints each one's line and the summary."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", JAX_PLATFORMS="cpu", RAY_AUTH_MODE="disabled")
    # (label, subprocess role, ours colocated, ours' remat)
    sides = {
        "both": [("ours", "ours", args.colocate, args.remat), ("trl", "trl", False, args.remat)],
        "ours": [("ours", "ours", args.colocate, args.remat)],
        "trl": [("trl", "trl", False, args.remat)],
        "placement": [("ours_workers", "ours", False, args.remat), ("ours_colocated", "ours", True, args.remat)],
    }[args.which]
    if args.also_remat is not None:  # (checked in main)
        sides.insert(1, (f"ours_{args.also_remat}", "ours", args.colocate, args.also_remat))
    results = {}
    for side, role, colocate, remat in sides:
        command = [sys.executable, __file__, "--side", role, "--workdir", workdir]
        command += ["--steps", str(args.steps), "--prompts", str(args.prompts), "--group", str(args.group)]
        command += ["--max-new-tokens", str(args.max_new_tokens), "--lr", str(args.lr), "--remat", remat]
        command += ["--precision", args.precision] + (["--colocate"] if colocate else [])
        out, peak_gib, peak_pss_gib = run_side(command, env)
        lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
        if out.returncode != 0 or not lines:
            raise SystemExit(f"{side} failed (exit {out.returncode}, peak {peak_gib:.1f} GiB):\n{out.stderr[-4000:]}")
        results[side] = json.loads(lines[-1].removeprefix("RESULT ")) | {
            "peak_rss_gib": peak_gib,
            "peak_pss_gib": peak_pss_gib,
        }
        print(json.dumps(results[side]), flush=True)
    if args.which == "placement":
        workers, colocated = results["ours_workers"], results["ours_colocated"]
        print(
            json.dumps(
                {
                    "settings": vars(args),
                    "workers_seconds_per_step": workers["seconds_per_step"],
                    "colocated_seconds_per_step": colocated["seconds_per_step"],
                    "colocated_speedup": workers["seconds_per_step"] / colocated["seconds_per_step"],
                    "colocated_first_step_ratio": colocated["first_step_seconds"] / workers["first_step_seconds"],
                    "colocated_peak_rss_ratio": colocated["peak_rss_gib"] / workers["peak_rss_gib"],
                    "colocated_peak_pss_ratio": colocated["peak_pss_gib"] / workers["peak_pss_gib"],
                }
            ),
            flush=True,
        )
    elif args.which == "both":
        ours, trl = results["ours"], results["trl"]
        summary = {
            "settings": vars(args),
            "ours_seconds_per_step": ours["seconds_per_step"],
            "trl_seconds_per_step": trl["seconds_per_step"],
            "speedup_vs_trl": trl["seconds_per_step"] / ours["seconds_per_step"],
            "ours_peak_rss_gib": ours["peak_rss_gib"],
            "trl_peak_rss_gib": trl["peak_rss_gib"],
            "ours_peak_pss_gib": ours["peak_pss_gib"],
            "trl_peak_pss_gib": trl["peak_pss_gib"],
        }
        if args.also_remat is not None:
            other = results[f"ours_{args.also_remat}"]
            summary |= {
                f"ours_{args.also_remat}_seconds_per_step": other["seconds_per_step"],
                f"ours_{args.also_remat}_speedup_vs_trl": trl["seconds_per_step"] / other["seconds_per_step"],
                # > 1: ours with --remat (the default "auto") is faster than ours with --also-remat
                "remat_speedup": other["seconds_per_step"] / ours["seconds_per_step"],
                "remat_update_speedup": other["time_split_seconds"]["train_update"]
                / ours["time_split_seconds"]["train_update"],
                f"ours_{args.also_remat}_peak_rss_gib": other["peak_rss_gib"],
                f"ours_{args.also_remat}_peak_pss_gib": other["peak_pss_gib"],
            }
        print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
