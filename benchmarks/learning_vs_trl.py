"""Learning at equal wall time: the demo job trained by feynrl-jax and by TRL's `GRPOTrainer`, over seeds.

What it measures: for each seed in `--seeds`, held-out greedy accuracy against the wall time of training for
  - ours: the demo job (`configs/grpo_demo.py`: GRPO on SmolLM2-135M-Instruct, reasoning-gym arithmetic, 4
    prompts x 8 samples x 16 new tokens a step, lr 1e-5, temperature 1, no KL, one update per batch) for
    `--steps` steps, evaluated every `--eval-every` steps; and
  - TRL 1.16 `GRPOTrainer` on the same model folder, training prompts, system prompt and chat template, group
    size, batch, completion length, learning rate (constant), temperature, clipping (0.2), advantage (group
    z-score), loss aggregation (`loss_type="grpo"`: token mean per sequence, then the mean: ours'
    `seq_mean_token_mean`), reward (the project's `gsm8k` reward with `fallback_last_number`), AdamW settings and
    gradient clipping (1.0), trained until it has used as much wall time as ours did with the same seed
    (it stops at the step end nearest that budget), evaluated every `--trl-eval-every` steps and when it stops.
The claim it checks (issue #18): at equal wall time ours gains at least TRL's held-out accuracy, and reaches a
given accuracy sooner: per seed, the lower of the two final accuracies (a level both sides reached); on the mean
over seeds, 50%, 80%, 90% and all of the lower of the two sides' mean gains, reached by each side's seed-mean curve
(`summarise`).

Prompt order: ours draws its training prompts in the order of `data.shuffle_seed` (0, the demo's), whatever the
seed; TRL shuffles them with its `seed`. The three seeds of ours differ in sampling only, TRL's in sampling and in
prompt order.

One yardstick: both sides are evaluated by `feynrl_jax.eval.evaluate.evaluate` on the same 64 held-out prompts
(`load_eval_set`, training questions dropped), greedy, 16 new tokens, scored by the same reward; ours generates
with the native engine inside the run, TRL's model with transformers `generate` (an adapter engine below). Greedy
decoding of the same weights agrees between the two (`tests/test_engine_hf_parity.py`), so the accuracy before
training must be the same on both sides up to one prompt decided by a near-tie: the summary reports both, and a larger
difference fails the script.

Wall time: the wall time of the training steps (generation, scoring, update, weight sync), evaluations left out,
start-up (Ray, model loading) left out on both sides, whatever JAX compilation is left in ours' first step included
(with the defaults `train.compile_ahead` and `rollout.warmup`, the train step and the rollout engine compile from
start-up on).
  - TRL: the time from each step's begin to its end (`TrainerCallback`); the evaluation runs after the step's
    clock stops.
  - Ours: each step's `perf/step_seconds` minus its `perf/eval_seconds` and `perf/checkpoint_seconds`. In a
    sync run the rollout worker starts the next batch as soon as the new weights are published, so it
    generates while the driver evaluates: the step after an evaluation would otherwise get that generation
    for free. Such a step is charged the worker's time for its batch (`perf/rollout_seconds`, which includes
    loading the weights, and `perf/reward_seconds`) that the trainer did not wait for; at step 1 less the
    first weight load where it built the rollout engine (start-up). With `rollout.warmup` (the default) the worker
    built its engine and compiled its programs at start-up, while the trainer started (start-up, left out, except
    for any part the first generation waits for, which its rollout time holds and the step is charged), and its
    first load is charged like any other. That generation ran beside the evaluation on the same cores, so the
    charge is at least what it saved.
  - Ours with `--colocate` (`rollout.colocate`: the engine in the trainer's process, no rollout worker): the
    next batch's generation is then a call on the trainer actor, which runs one call at a time, so it and the
    evaluation run one after the other, in either order; `perf/rollout_seconds` then holds the time the call
    queued behind the evaluation. Such a step is charged the engine's own time instead
    (`perf/rollout_engine_seconds`: waiting for the warm-up, loading, generating, freeing) plus the scoring, less
    what the trainer waited for. Evaluation first: the step after waited for the whole generation and scoring,
    which its wall time holds, and is charged nothing more: exact. Generation first: the evaluation's time held
    the generation, which the step after is charged (nothing was waited for): exact but for the call's round trip
    and the driver's work before it (milliseconds; in `docs/learning_vs_trl_colocated.json` every step ran
    evaluation first). The warm-up runs in a thread of the trainer from start-up on; the part of it that outlasted
    the start-up (`perf/rollout_warmup_past_start_seconds`), which the evaluation before training hid and a first
    generation would otherwise have waited for, is charged to step 1 too: twice, an overcharge, where the first
    generation itself still waited for the warm-up (it ran first, or the warm-up outlasted the evaluation).
  - Ours, either way: the update's compile-ahead (`train.compile_ahead`) ran during the evaluation before training
    too; a colocated trainer starts it only once its engine's warm-up ended (`TrainerActor._after_warm_up`). Step 1
    is charged the part of it that ended after its batch was ready (the batch's time above, counted from the
    start-up's end: `perf/update_compile_past_start_seconds` less it), less what the update still waited for it
    (`perf/update_compile_wait_seconds`, which the step's wall time holds). An overcharge where the evaluation
    slowed the compile down.

Compilation cache (`--compile-cache`, ours only: TRL compiles nothing). `cold` (the default): JAX's persistent
compilation cache is off in ours' runs, whatever the environment says, so every program compiles in the run, as on
a machine's first run. `warm`: every run of ours uses one cache folder in the workdir, which one run of ours with the
same settings and a seed the comparison does not use (`max(--seeds) + 1`) fills first, unless the folder holds
programs already: a user's later runs, since the CLI keeps its cache on by default (`feynrl_jax/cache_dirs.py`).
JAX stores only the programs that took a second or more to compile (its default, as in the CLI); the smaller ones
compile in every run. The summary's settings say how the cache was filled.

Usage:
    pip install "trl==1.16.0"   # not a dependency of the project
    python benchmarks/learning_vs_trl.py                                  # 3 seeds, the demo's 12 steps
    python benchmarks/learning_vs_trl.py --colocate --workdir runs/learning_vs_trl_colocated \\
        --json docs/learning_vs_trl_colocated.json --plot docs/learning_vs_trl_colocated.png  # ours colocated
    python benchmarks/learning_vs_trl.py --colocate --compile-cache warm --workdir runs/learning_vs_trl_warm \\
        --json docs/learning_vs_trl_warm_cache.json --plot docs/learning_vs_trl_warm_cache.png  # a later run
    python benchmarks/learning_vs_trl.py --seeds 0 --steps 2 --eval-every 1 --trl-eval-every 1 \\
        --workdir /tmp/learning_vs_trl_smoke --json /tmp/lvt.json --plot /tmp/lvt.png        # smoke run

Each run is a subprocess of its own (the TRL process imports the project's data, reward and evaluation code, and
with it JAX, which computes nothing there); finished runs whose settings match are reused from `--workdir`. Output:
a line per run, a markdown table (seed | ours before -> after, seconds, steps | TRL before -> after, seconds, steps)
with the means, the JSON summary `--json` and the plot `--plot` (accuracy against wall time, one line per run).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from async_learning import _mean, _std, child_env, demo_config, finished_run, plot_curves, seed_table
from bench_grpo_vs_trl import TRL_RUN_SETTINGS

from feynrl_jax.cache_dirs import COMPILE_CACHE_VARIABLE, DEFAULT_MAX_BYTES, MAX_SIZE_VARIABLE
from feynrl_jax.host_memory import reexec_with_allocator_tunables

reexec_with_allocator_tunables()  # before JAX or torch allocate: both sides run with it

COLOURS = {"ours": "tab:blue", "trl": "tab:orange"}
NAMES = {"ours": "feynrl-jax", "trl": "TRL 1.16"}


def run_config(args, seed: int):
    """Ours: the demo config with the seed, the benchmark's steps, evaluation cadence and precision."""
    config = demo_config()
    config.name = f"learning_vs_trl_seed{seed}"
    suffix = "_warm_cache" if args.compile_cache == "warm" else ""  # a cold run's folder is never read as a warm one
    config.run_dir = os.path.join(args.workdir, f"ours_seed{seed}{suffix}")
    config.seed = seed
    config.train.steps = args.steps
    config.train.eval_every = args.eval_every
    config.checkpoint.every_steps = 0  # only the final save (TRL saves nothing; its time is left out below)
    config.checkpoint.resume = False
    config.tracking.progress_bar = False
    config.rollout.colocate = args.colocate
    if args.precision == "bfloat16":  # bf16 weights and compute, float32 master weights and optimizer state
        config.model.param_dtype = config.model.compute_dtype = "bfloat16"
        config.model.master_dtype = "float32"
    return config


def charged_step_seconds(record: dict, paused: bool, colocated: bool = False) -> float:
    """The wall time a step of ours is charged (see the docstring); `paused`: the step before it (or the start)
    evaluated or checkpointed; `colocated`: the run's engine was in the trainer's process."""
    step_wall = record["perf/step_seconds"]
    step_wall -= record.get("perf/eval_seconds", 0.0) + record.get("perf/checkpoint_seconds", 0.0)
    if paused:  # the worker made this batch while the driver evaluated: charge what the trainer did not wait
        built = 0.0
        if colocated:  # the engine's own time: not the queue behind the evaluation on the trainer actor
            worker = record["perf/rollout_engine_seconds"]
            # Step 1: the part of the warm-up that the start-up did not hide (the evaluation before training did).
            worker += record.get("perf/rollout_warmup_past_start_seconds", 0.0)
        else:  # holds the worker's weight load; step 1's builds its engine unless a warm-up did
            worker = record["perf/rollout_seconds"]
            if record["step"] == 1 and "perf/rollout_warmup_seconds" not in record:  # else a warm-up built it
                built = record.get("perf/weight_sync_seconds", 0.0)
        worker += record.get("perf/reward_seconds", 0.0)
        step_wall += max(0.0, worker - built - record["perf/trainer_wait_seconds"])
        # Step 1: the part of the update's compile-ahead that the evaluation hid, past the batch (`worker`, counted
        # from the start-up's end, the engine's build included): a first update waits for it where nothing runs
        # before it. Less what this update waited for the compile, which its wall time holds already.
        compiled = record.get("perf/update_compile_past_start_seconds")
        if compiled is not None:
            waited = record.get("perf/update_compile_wait_seconds", 0.0)
            step_wall += max(0.0, compiled - worker - waited)
    return step_wall


def ours_curve(records: list[dict], colocated: bool = False) -> dict:
    """Held-out accuracy against the wall time of training, from ours' `metrics.jsonl` (see the docstring)."""
    seconds, accuracy, steps, wall, paused = [], [], [], 0.0, False
    for record in records:
        if record["step"] > 0:
            wall += charged_step_seconds(record, paused, colocated)
        paused = "perf/eval_seconds" in record or "perf/checkpoint_seconds" in record or record["step"] == 0
        if "eval/accuracy" in record:
            steps.append(int(record["step"]))
            seconds.append(wall)
            accuracy.append(record["eval/accuracy"])
            prompts = int(record["eval/num_prompts"])
    if not steps or steps[0] != 0:
        raise SystemExit("ours: no evaluation before training (step 0) in metrics.jsonl")
    return {
        "eval_steps": steps,
        "eval_seconds": seconds,
        "eval_accuracy": accuracy,
        "eval_prompts": prompts,
        "wall_seconds": wall,
    }


class TorchGreedyEngine:
    """A `RolloutEngine` over a transformers causal LM, greedy only: the TRL side's evaluation engine."""

    def __init__(self, model, pad_id: int):
        self.model, self.pad_id = model, pad_id

    def load_params(self, params, version: int) -> None:  # the model is trained in place
        del params, version

    def generate(self, prompts, sampling):
        import numpy as np
        import torch

        from feynrl_jax.rollout.types import FINISH_LENGTH, FINISH_STOP, assemble_rollouts

        if not sampling.greedy or sampling.n != 1 or sampling.stop_strings:
            raise ValueError("TorchGreedyEngine evaluates greedily, one sample per prompt, without stop strings")
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, prompt in enumerate(prompts):  # left-padded: generation continues every row from its last token
            ids[i, width - len(prompt) :] = torch.tensor(prompt)
            mask[i, width - len(prompt) :] = 1
        was_training = self.model.training
        self.model.eval()
        with torch.no_grad():
            out = self.model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=sampling.max_new_tokens,
                do_sample=False,
                eos_token_id=list(sampling.stop_token_ids),
                pad_token_id=self.pad_id,
            )
        self.model.train(was_training)
        stops = set(sampling.stop_token_ids)
        completions, finish = [], []
        for row in out[:, width:].tolist():
            end = next((j + 1 for j, token in enumerate(row) if token in stops), None)
            completions.append(row[:end] if end else row)
            finish.append(FINISH_STOP if end else FINISH_LENGTH)
        return assemble_rollouts(
            prompts,
            [(i, 0) for i in range(len(prompts))],
            completions,
            [[0.0] * len(c) for c in completions],
            np.asarray(finish),
            width=sampling.max_new_tokens,
            pad_id=self.pad_id,
            policy_version=0,
        )


def run_ours(args, seed: int) -> None:
    from feynrl_jax.orchestration import rl_loop

    rl_loop.run(run_config(args, seed))


def run_trl(args, seed: int, budget: float) -> dict:
    """TRL on the demo's data and settings until `budget` seconds of training; returns its curve."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from feynrl_jax.checkpoints import load_tokenizer, smollm2_checkpoint_dir
    from feynrl_jax.data.from_config import build_sources_from_config
    from feynrl_jax.eval.evaluate import evaluator_from_config
    from feynrl_jax.rollout.rewards.scorer import RewardScorer
    from feynrl_jax.train.rl_trainer import loss_hyperparameters
    from feynrl_jax.train.sft_loop import train_prompts

    torch.set_num_threads(os.cpu_count() or 1)
    config = run_config(args, seed)
    if (config.algo.name, config.algo.kl_coef, config.optim.schedule, config.optim.weight_decay) != (
        "grpo",
        0.0,
        "constant",
        0.0,
    ):
        raise SystemExit("the TRL side mirrors GRPO without KL at a constant lr and no weight decay: the demo changed")
    folder = smollm2_checkpoint_dir()
    tokenizer = load_tokenizer(folder)
    sources = build_sources_from_config(config.data, paradigm="rl", split="train")
    examples = [e for source in sources.values() for e in source.examples]
    rows = [
        {
            "prompt": [
                {"role": "system", "content": config.data.system_prompt},
                {"role": "user", "content": e["prompt"]},
            ],
            "example": json.dumps(e, default=str),
        }
        for e in examples
    ]
    scorer = RewardScorer(
        dict(config.rollout.rewards),
        reward_kwargs={k: dict(v) for k, v in config.rollout.reward_kwargs.items()},
        num_workers=1,
    )

    def reward(prompts, completions, example, completion_ids=None, **kwargs):
        texts = [c[0]["content"] for c in completions]
        lengths = [len(ids) for ids in completion_ids] if completion_ids is not None else None
        total, _, _ = scorer.score(
            [""] * len(texts), texts, [json.loads(x) for x in example], completion_lengths=lengths
        )
        return [float(t) for t in total]

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    engine = TorchGreedyEngine(model, pad_id)
    evaluator = evaluator_from_config(
        config, None, None, tokenizer, exclude_prompts=train_prompts(config), engine=engine
    )
    curve = {"eval_steps": [], "eval_seconds": [], "eval_accuracy": [], "step_seconds": [], "reward_mean": []}

    def evaluate(step: int, wall: float) -> None:
        metrics = evaluator(None, step)
        curve["eval_steps"].append(step)
        curve["eval_seconds"].append(wall)
        curve["eval_accuracy"].append(metrics["eval/accuracy"])
        curve["eval_prompts"] = int(metrics["eval/num_prompts"])
        print(f"trl seed {seed}: step {step}, {wall:.1f} s, accuracy {metrics['eval/accuracy']:.3f}", flush=True)

    class Clock(TrainerCallback):
        """Times each step, evaluates between steps (off the clock), stops at the step end nearest `budget`."""

        def __init__(self):
            self.begin, self.wall = 0.0, 0.0

        def on_step_begin(self, _args, state, control, **kwargs):
            self.begin = time.perf_counter()

        def on_step_end(self, _args, state, control, **kwargs):
            seconds = time.perf_counter() - self.begin
            self.wall += seconds
            curve["step_seconds"].append(seconds)
            # Stop when one more step would end further past the budget than this one is short of it.
            if budget - self.wall < seconds / 2:
                control.should_training_stop = True
            if control.should_training_stop or state.global_step % args.trl_eval_every == 0:
                evaluate(state.global_step, self.wall)

        def on_log(self, _args, _state, _control, logs=None, **kwargs):
            if logs and "reward" in logs:
                curve["reward_mean"].append(logs["reward"])

    group = config.rollout.n_samples
    # The loss ours trains with (the config's values over the algorithm's defaults): TRL's "grpo" loss type is
    # the per-sequence token mean, then the mean over sequences.
    hyperparameters = loss_hyperparameters(config)
    if hyperparameters["loss_agg"] != "seq_mean_token_mean":
        raise SystemExit(f"TRL's loss_type='grpo' is seq_mean_token_mean, ours is {hyperparameters['loss_agg']!r}")
    clip = {k: hyperparameters[k] for k in ("clip_low", "clip_high")}
    trl_config = GRPOConfig(
        output_dir=os.path.join(args.workdir, f"trl_seed{seed}"),
        per_device_train_batch_size=config.train.global_batch_size,
        num_generations=group,
        max_completion_length=config.rollout.max_new_tokens,
        learning_rate=config.optim.lr,
        lr_scheduler_type="constant",
        warmup_steps=config.optim.warmup_steps,
        adam_beta1=config.optim.b1,
        adam_beta2=config.optim.b2,
        adam_epsilon=config.optim.eps,
        weight_decay=config.optim.weight_decay,
        max_grad_norm=config.optim.max_grad_norm,
        max_steps=100_000,  # the clock stops it
        beta=0.0,
        epsilon=clip["clip_low"],
        epsilon_high=clip["clip_high"],
        loss_type="grpo",
        scale_rewards="group",
        temperature=config.rollout.temperature,
        bf16=args.precision == "bfloat16",
        seed=seed,
        **TRL_RUN_SETTINGS,
    )
    evaluate(0, 0.0)
    clock = Clock()
    trainer = GRPOTrainer(
        model=model, reward_funcs=reward, args=trl_config, train_dataset=Dataset.from_list(rows), callbacks=[clock]
    )
    try:
        trainer.train()
    finally:
        evaluator.close()
        scorer.close()
    return curve | {"wall_seconds": clock.wall}


def settings_of(args) -> dict:
    keys = ("steps", "eval_every", "trl_eval_every", "precision")
    settings = {k: getattr(args, k) for k in keys}
    settings |= {"colocate": True} if args.colocate else {}  # runs saved before these flags still match
    return settings | ({"compile_cache": "warm"} if args.compile_cache == "warm" else {})


def compile_cache_folder(args) -> str:
    """The JAX compilation cache of `--compile-cache warm`: one folder in the workdir, shared by ours' runs."""
    return os.path.join(args.workdir, "jax_compile_cache")


def compile_cache_env(args) -> dict[str, str]:
    """Ours' JAX compilation cache (`feynrl_jax.cache_dirs`; a local Ray cluster's workers inherit it): off for
    `cold`, whatever the caller's environment holds; for `warm`, `compile_cache_folder` with the CLI's size bound."""
    if args.compile_cache == "cold":
        return {COMPILE_CACHE_VARIABLE: "", "JAX_ENABLE_COMPILATION_CACHE": "false"}
    return {
        COMPILE_CACHE_VARIABLE: compile_cache_folder(args),
        "JAX_ENABLE_COMPILATION_CACHE": "true",
        MAX_SIZE_VARIABLE: os.environ.get(MAX_SIZE_VARIABLE, str(DEFAULT_MAX_BYTES)),
    }


def cached_programs(folder: str) -> int:
    """How many entries the JAX compilation cache `folder` holds (0 where it does not exist)."""
    return len(os.listdir(folder)) if os.path.isdir(folder) else 0


def fill_compile_cache(args) -> dict:
    """`--compile-cache warm`: where `compile_cache_folder` holds no program yet, one run of ours with the same
    settings and a seed the comparison does not use fills it (its run folder is removed after, its log kept); a
    folder that holds programs already is used as it is. Returns what was done, for the summary's settings: how
    this script filled the folder (`<folder>.fill.json`, kept for later invocations), else `filled_by` None."""
    folder = compile_cache_folder(args)
    record = folder + ".fill.json"  # how this script filled it, kept for the summaries of later invocations
    entries = cached_programs(folder)
    if entries:
        print(f"compile cache {folder}: {entries} entries already, used as it is", file=sys.stderr, flush=True)
        filled = {"filled_by": None}
        if os.path.exists(record):
            with open(record, encoding="utf-8") as f:
                filled = json.load(f)
        return {"folder": folder, **filled, "entries_before": entries}
    seed = max(args.seeds) + 1
    run_dir = run_config(args, seed).run_dir
    shutil.rmtree(run_dir, ignore_errors=True)
    t0 = time.perf_counter()
    run_child(args, "ours", seed, None, run_dir + ".log")
    seconds = time.perf_counter() - t0
    shutil.rmtree(run_dir, ignore_errors=True)  # its final checkpoint: a GB the comparison never reads
    entries = cached_programs(folder)
    if not entries:
        raise SystemExit(f"the filling run left no program in {folder}: JAX's compilation cache is not in use")
    print(f"compile cache {folder}: filled by ours, seed {seed}, in {seconds:.0f} s", file=sys.stderr, flush=True)
    filled = {"filled_by": f"ours, seed {seed}", "fill_seconds": seconds, "entries_after": entries}
    with open(record, "w", encoding="utf-8") as f:
        json.dump(filled, f)
    return {"folder": folder, **filled}


def run_child(args, role: str, seed: int, budget: float | None, log_path: str) -> None:
    command = [sys.executable, __file__, "--run", role, "--seed-of-run", str(seed), "--workdir", args.workdir]
    command += ["--steps", str(args.steps), "--eval-every", str(args.eval_every)]
    command += ["--trl-eval-every", str(args.trl_eval_every), "--precision", args.precision]
    command += ["--colocate"] if args.colocate else []
    command += ["--compile-cache", args.compile_cache]
    command += ["--budget", str(budget)] if budget is not None else []
    env = child_env() | (compile_cache_env(args) if role == "ours" else {})
    print(f"seed {seed}, {role}: running (log: {log_path})", file=sys.stderr, flush=True)
    with open(log_path, "w", encoding="utf-8") as log:
        code = subprocess.run(command, env=env, stdout=log, stderr=subprocess.STDOUT, check=False).returncode
    if code != 0:
        tail = Path(log_path).read_text(encoding="utf-8")[-4000:]
        raise SystemExit(f"seed {seed}, {role} failed (exit {code}), log {log_path}:\n{tail}")


def result_of(args, role: str, seed: int, budget: float | None = None) -> dict:
    """The run's curve: reused from `<workdir>/<role>_seed<s>.json` when its settings match; else ours' curve is
    read from its run folder when that holds the finished run, and otherwise the side is run."""
    path = os.path.join(args.workdir, f"{role}_seed{seed}.json")
    if os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            saved = json.load(f)
        if saved["settings"] == settings_of(args) and saved.get("budget") == budget:
            print(f"seed {seed}, {role}: reusing {path}", file=sys.stderr, flush=True)
            return saved
    t0 = time.perf_counter()
    if role == "ours":
        from feynrl_jax.tracking import read_metrics

        config = run_config(args, seed)
        run_dir = config.run_dir
        records, same = finished_run(run_dir, config)
        if records is None or not same:  # a finished run folder of these settings is read again, not rerun
            shutil.rmtree(run_dir, ignore_errors=True)  # ours alone: an unfinished run is started again
            run_child(args, role, seed, None, run_dir + ".log")
        result = ours_curve(read_metrics(run_dir), colocated=args.colocate)
        if result["eval_steps"][-1] != args.steps:
            raise SystemExit(f"{run_dir}: metrics end before step {args.steps}")
    else:
        out = os.path.join(args.workdir, f"trl_seed{seed}.curve.json")
        run_child(args, role, seed, budget, out.removesuffix(".curve.json") + ".log")
        with open(out, encoding="utf-8") as f:
            result = json.load(f)
    result |= {"seed": seed, "side": role, "settings": settings_of(args), "budget": budget}
    result |= {"accuracy_before": result["eval_accuracy"][0], "accuracy_after": result["eval_accuracy"][-1]}
    result["process_seconds"] = time.perf_counter() - t0
    with open(path, "w", encoding="utf-8") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(result), flush=True)
    return result


def time_to_reach(result: dict, target: float) -> float | None:
    """The wall time of the first evaluation at or above `target`, None when none is."""
    return next((s for s, a in zip(result["eval_seconds"], result["eval_accuracy"]) if a >= target), None)


MEAN_CURVE_FRACTIONS = (0.5, 0.8, 0.9, 1.0)
"""The fractions of the common gain at which `summarise` times each side's mean curve."""


def accuracy_at(result: dict, seconds: float) -> float:
    """The run's held-out accuracy at `seconds` of training: its last evaluation at or before then (the first,
    before training, at 0 s), held after the run's end."""
    accuracy = result["eval_accuracy"][0]
    for s, a in zip(result["eval_seconds"], result["eval_accuracy"]):
        if s <= seconds:
            accuracy = a
    return accuracy


def mean_curve(group: list[dict]) -> tuple[list[float], list[float]]:
    """The seeds' mean accuracy against wall time: at every evaluation time of any run of `group`, the mean over
    the runs of `accuracy_at` that time (a step function: each run holds its last evaluation until the next)."""
    times = sorted({s for r in group for s in r["eval_seconds"]})
    return times, [_mean([accuracy_at(r, t) for r in group]) for t in times]


def time_on_curve(curve: tuple[list[float], list[float]], target: float) -> float | None:
    """The first time at which `curve` (`mean_curve`) is at or above `target`, None when it never is (a tolerance
    of 1e-9 for the float sums of the mean)."""
    return next((t for t, a in zip(*curve) if a >= target - 1e-9), None)


def summarise(runs: list[dict]) -> dict:
    """The claim's numbers: each side's gain at equal wall time, and when each side first reached a level both
    reached, per seed and on the mean over seeds (below). Ours is evaluated every
    `--eval-every` steps, TRL every `--trl-eval-every`, so a coarser cadence can only make a side look later.

    Per seed, one run of each side is compared, and the target is the lower of their two final accuracies. On the
    mean over seeds (`mean_curve`: what a user, not knowing the seed's luck, can expect of each side), the targets
    are fractions `MEAN_CURVE_FRACTIONS` of the common gain: the lower of the two sides' mean gains, above the mean
    accuracy before training. At the whole of it the side with the lower mean gain usually gets there only at its
    end (that is the literal claim, "TRL's gain, reached sooner"); the smaller fractions show which side learns
    faster on the way."""
    ours = [r for r in runs if r["side"] == "ours"]
    trl = [r for r in runs if r["side"] == "trl"]
    if not ours or [r["seed"] for r in ours] != [r["seed"] for r in trl]:
        sides = [(r["side"], r["seed"]) for r in runs]
        raise ValueError(f"summarise: one run of each side per seed, in the same order; got {sides}")
    gain = {
        side: [r["accuracy_after"] - r["accuracy_before"] for r in group]
        for side, group in (("ours", ours), ("trl", trl))
    }
    targets = [min(o["accuracy_after"], t["accuracy_after"]) for o, t in zip(ours, trl)]
    before = _mean([r["accuracy_before"] for r in runs])
    common_gain = min(_mean(gain["ours"]), _mean(gain["trl"]))
    curves = {"ours": mean_curve(ours), "trl": mean_curve(trl)}
    mean_targets = []
    for fraction in MEAN_CURVE_FRACTIONS:
        level = before + fraction * common_gain
        seconds = {f"{side}_seconds": time_on_curve(curve, level) for side, curve in curves.items()}
        mean_targets.append({"fraction": fraction, "accuracy": level} | seconds)
    return {
        "ours_gain_mean": _mean(gain["ours"]),
        "ours_gain_std": _std(gain["ours"]),
        "trl_gain_mean": _mean(gain["trl"]),
        "trl_gain_std": _std(gain["trl"]),
        "ours_gain_at_least_trls": _mean(gain["ours"]) >= _mean(gain["trl"]),
        "ours_wall_seconds_mean": _mean([r["wall_seconds"] for r in ours]),
        "trl_wall_seconds_mean": _mean([r["wall_seconds"] for r in trl]),
        "ours_steps_mean": _mean([r["eval_steps"][-1] for r in ours]),
        "trl_steps_mean": _mean([r["eval_steps"][-1] for r in trl]),
        "common_target_accuracy": targets,
        "ours_seconds_to_target": [time_to_reach(o, x) for o, x in zip(ours, targets)],
        "trl_seconds_to_target": [time_to_reach(t, x) for t, x in zip(trl, targets)],
        "mean_curve_common_gain": common_gain,
        "mean_curve_targets": mean_targets,
    }


def table(runs: list[dict]) -> str:
    def cell(r: dict) -> str:
        accuracy = f"{r['accuracy_before']:.3f} -> {r['accuracy_after']:.3f}"
        return f"{accuracy}, {r['wall_seconds']:.0f} s, {r['eval_steps'][-1]} steps"

    columns = {
        "ours: before -> after, wall, steps": lambda r: r["side"] == "ours",
        "TRL: before -> after, wall, steps": lambda r: r["side"] == "trl",
    }
    return seed_table(runs, columns, cell)


def plot(runs: list[dict], path: str, args) -> None:
    placement = ", engine colocated" if args.colocate else ""
    cache = ", warm compilation cache" if args.compile_cache == "warm" else ""
    plot_curves(
        runs,
        path,
        colour=lambda r: COLOURS[r["side"]],
        label=lambda r: f"{NAMES[r['side']]}, seed {r['seed']}",
        xlabel="wall time of training (s, evaluations left out)",
        ylabel="held-out accuracy (greedy, 64 prompts)",
        title=f"grpo_demo, SmolLM2-135M, {args.precision}{placement}{cache}: feynrl-jax vs TRL at equal wall time",
        means={
            f"{NAMES[side]}, mean of the seeds": (*mean_curve([r for r in runs if r["side"] == side]), COLOURS[side])
            for side in NAMES
        },
    )


def main() -> None:
    demo = demo_config()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=demo.train.steps, help="ours: training steps")
    parser.add_argument("--eval-every", type=int, default=1, help="ours: evaluate every this many steps")
    parser.add_argument("--trl-eval-every", type=int, default=1, help="TRL: evaluate every this many steps")
    parser.add_argument("--precision", choices=("float32", "bfloat16"), default="float32", help="both sides")
    parser.add_argument(
        "--colocate", action="store_true", help="ours: the rollout engine in the trainer's process (rollout.colocate)"
    )
    parser.add_argument(
        "--compile-cache",
        choices=("cold", "warm"),
        default="cold",
        help="ours: JAX's compilation cache off (cold: a first run on the machine), or filled by one run of ours "
        "first (warm: a user's later runs, whose CLI keeps the cache on by default)",
    )
    parser.add_argument("--workdir", default="runs/learning_vs_trl", help="run folders and results (reused)")
    parser.add_argument("--json", default="docs/learning_vs_trl.json")
    parser.add_argument("--plot", default="docs/learning_vs_trl.png")
    parser.add_argument("--run", choices=("ours", "trl"), help=argparse.SUPPRESS)  # a child's role
    parser.add_argument("--seed-of-run", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--budget", type=float, help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.workdir = os.path.abspath(args.workdir)
    if args.run == "ours":
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
        run_ours(args, args.seed_of_run)
        return
    if args.run == "trl":
        curve = run_trl(args, args.seed_of_run, args.budget)
        with open(os.path.join(args.workdir, f"trl_seed{args.seed_of_run}.curve.json"), "w", encoding="utf-8") as f:
            json.dump(curve, f)
        return

    os.makedirs(args.workdir, exist_ok=True)
    cache = fill_compile_cache(args) if args.compile_cache == "warm" else None
    runs = []
    for seed in args.seeds:
        ours = result_of(args, "ours", seed)
        trl = result_of(args, "trl", seed, budget=round(ours["wall_seconds"], 3))
        # The same weights decoded greedily by two engines: one prompt may flip on a near-tie of its two most
        # likely tokens (float32 sums in another order, left padding in transformers' batch), no more.
        if ours["eval_prompts"] != trl["eval_prompts"]:
            raise SystemExit(f"seed {seed}: ours evaluated {ours['eval_prompts']} prompts, TRL {trl['eval_prompts']}")
        if abs(ours["accuracy_before"] - trl["accuracy_before"]) * ours["eval_prompts"] > 1:
            raise SystemExit(
                f"seed {seed}: accuracy before training differs (ours {ours['accuracy_before']}, TRL "
                f"{trl['accuracy_before']}): the two evaluations are not the same yardstick"
            )
        runs += [ours, trl]
    settings = settings_of(args) | {"seeds": args.seeds} | ({"compile_cache_fill": cache} if cache else {})
    summary = {"settings": settings, "verdict": summarise(runs), "runs": runs}
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w", encoding="utf-8") as f:
        json.dump(summary, f, indent=1)
        f.write("\n")
    plot(runs, args.plot, args)
    print(table(runs))
    print(json.dumps(summary["verdict"]))
    print(f"summary: {args.json}; plot: {args.plot}", flush=True)


if __name__ == "__main__":
    main()
