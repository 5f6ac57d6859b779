"""The RL update against the model's plain forward+backward pass on the same tokens, in one process.

GRPO rollouts of `--prompts` prompts x `--group` samples are drawn with the lengths of a real run: prompts of 40-50
tokens, completions stopping anywhere from 1 token to `--max-new-tokens` (uniform), a quarter of them cut at the
limit. Three sides train SmolLM2-135M's architecture (random weights, float32, one CPU device) on them:

* `rl_packed`: `RLTrainer.train` as an RL run calls it (layout, pi_old from the update's own pass, one update),
  with the config's defaults: micro-batches sized by memory (`train.micro_batch_tokens`, here fixed to
  `--micro-tokens` so both RL sides hold the same micro-batches) and `train.pack_sequences=True`;
* `rl_unpacked`: the same with `train.pack_sequences=False` (every row padded to the widest the config allows);
* `rl_dense`: `rl_packed` with attention over the whole of each row (`models.SegmentBounds.pays` patched to
  False), where the trainer runs it in blocks (`models.block_attention`): what the blocks save;
* `plain`: an SFT train step (next-token cross-entropy on the completion tokens) on the same samples packed
  densely, micro-batches of the same token slots: what a forward+backward pass over these tokens costs.

Each reports real tokens (prompt + completion of every sample) per second of its update; the goal (#18) is
`rl_packed >= 0.9 x plain`. The first step of each side compiles and is left out; the median of the others counts.

`--also-remat dots,none` runs `rl_packed` again under each of those `model.remat` policies (`rl_packed_dots`, ...),
after the other sides, and reports each one's speed against `rl_packed`'s (`speedup_<policy>_vs_remat`). With
`--remat full` (in float32 "auto" is "dots" on a CPU since 2026-12-08) `rl_packed`'s update adds each layer's gradient
into its accumulator in place (`models.forward`'s `grad_sink`); the others keep more of the forward pass and take
the layers' gradient as a stack of its own.
`--kl-coef 0` drops the KL term and its reference model's pass, as `bench_grpo_vs_trl.py` runs GRPO.

Usage:
    python benchmarks/bench_rl_update.py --max-new-tokens 64 --steps 4
    python benchmarks/bench_rl_update.py --max-new-tokens 128 --steps 4
    python benchmarks/bench_rl_update.py --max-new-tokens 128 --sides rl_packed,rl_dense   # what the blocks save
    python benchmarks/bench_rl_update.py --max-new-tokens 128 --sides rl_packed --kl-coef 0 --also-remat dots,none
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from unittest import mock

from feynrl_jax.host_memory import reexec_with_allocator_tunables

reexec_with_allocator_tunables()

import jax  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "configs"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_lora import SMOLLM2_135M  # noqa: E402
from scratch import scratch_folder  # noqa: E402

from feynrl_jax.models.config import REMAT_POLICIES  # noqa: E402
from feynrl_jax.rollout.types import FINISH_LENGTH, FINISH_STOP, Rollouts  # noqa: E402

PROMPT_WIDTH = 64
SIDES = ("rl_packed", "rl_dense", "rl_unpacked", "plain")
RATIOS = {
    "ratio_packed_vs_plain": ("rl_packed", "plain"),
    "ratio_unpacked_vs_plain": ("rl_unpacked", "plain"),
    "speedup_packed_vs_unpacked": ("rl_packed", "rl_unpacked"),
    "speedup_blocks_vs_dense": ("rl_packed", "rl_dense"),
}


def make_rollouts(args, seed: int) -> Rollouts:
    rng = np.random.default_rng(seed)
    n, c = args.prompts * args.group, args.max_new_tokens
    prompt_lengths = np.repeat(rng.integers(40, 51, args.prompts), args.group).astype(np.int32)
    completion = rng.integers(1, c + 1, n)
    completion[rng.random(n) < 0.25] = c
    prompt_ids = np.zeros((n, PROMPT_WIDTH), np.int32)
    for g in range(args.prompts):
        rows = slice(g * args.group, (g + 1) * args.group)
        prompt_ids[rows, : prompt_lengths[g * args.group]] = rng.integers(1, 49152, prompt_lengths[g * args.group])
    mask = (np.arange(c)[None, :] < completion[:, None]).astype(np.float32)
    return Rollouts(
        prompt_ids=prompt_ids,
        prompt_lengths=prompt_lengths,
        completion_ids=(rng.integers(1, 49152, (n, c)) * mask).astype(np.int32),
        completion_mask=mask,
        behavior_logprobs=(-rng.random((n, c)) * mask).astype(np.float32),
        finish_reason=np.where(completion == c, FINISH_LENGTH, FINISH_STOP).astype(np.int32),
        group_id=np.repeat(np.arange(args.prompts), args.group).astype(np.int32),
        policy_version=np.zeros(n, np.int32),
    )


def real_tokens(rollouts: Rollouts) -> int:
    return int(rollouts.prompt_lengths.sum() + rollouts.completion_mask.sum())


def rl_config(args, workdir: str, pack: bool, name: str, remat: str | None = None):
    """The RL side's config; `remat`: its `model.remat` (None: `--remat`)."""
    import tiny_rl

    config = tiny_rl.get_config("grpo")
    if args.kl_coef is not None:
        config.algo.kl_coef = args.kl_coef
        config.algo.reference = "initial" if args.kl_coef else "none"
    config.run_dir = os.path.join(workdir, name)
    for key, value in SMOLLM2_135M.items():
        if key != "rope_theta":
            config.model.arch[key] = value
    config.data.max_prompt_len = PROMPT_WIDTH
    config.data.max_seq_len = PROMPT_WIDTH + args.max_new_tokens
    config.rollout.n_samples = args.group
    config.rollout.max_new_tokens = args.max_new_tokens
    config.train.global_batch_size = args.prompts * args.group
    config.train.mini_batches = 1
    config.train.micro_batch_size = 0
    config.train.micro_batch_tokens = args.micro_tokens
    config.train.pack_sequences = pack
    config.train.steps = args.steps
    config.checkpoint.every_steps = 0
    config.optim.lr = 1e-6
    config.model.compute_dtype = args.precision  # float32 weights (and masters) either way
    config.model.remat = args.remat if remat is None else remat
    return config


def run_rl(args, workdir: str, pack: bool, blocks: bool = True, remat: str | None = None) -> dict:
    """One RL side; `blocks=False` forces dense attention on every row; `remat`: `model.remat` (None: `--remat`)."""
    from feynrl_jax.models import SegmentBounds
    from feynrl_jax.train.rl_trainer import RLTrainer

    name = ("packed" if pack else "unpacked") + ("" if blocks else "_dense") + (f"_{remat}" if remat else "")
    with contextlib.ExitStack() as stack:
        if not blocks:
            stack.enter_context(mock.patch.object(SegmentBounds, "pays", lambda *_: False))
        trainer = RLTrainer(rl_config(args, workdir, pack, name, remat))
        result = _train_rl(args, trainer)
        result["remat"] = trainer.model_config.resolved_remat()
        result["sinks_layer_grads"] = trainer.train_step.sinks_layer_grads
        return result


def _train_rl(args, trainer) -> dict:
    trainer.start()
    seconds, tokens, records = [], [], []
    for step in range(args.steps):
        rollouts = make_rollouts(args, seed=step)
        rewards = np.random.default_rng(step).integers(0, 2, rollouts.group_id.shape[0]).astype(np.float32)
        metrics = trainer.train(rollouts, rewards, step=step + 1, shuffle_seed=step)
        seconds.append(metrics["perf/train_update_seconds"])
        tokens.append(real_tokens(rollouts))
        records.append(metrics)
    trainer.close()
    later = slice(1, None) if args.steps > 1 else slice(None)
    rate = statistics.median(t / s for t, s in zip(tokens[later], seconds[later]))
    last = records[-1]
    return {
        "tokens_per_second": rate,
        "update_seconds": seconds,
        "micro_batch_size": last["train/micro_batch_size"],
        "micro_batches": last["train/micro_batches"],
        "micro_batches_run": last["train/micro_batches_run"],
        "pack_fill": last.get("train/pack_fill"),
        "shared_prefix": last["train/shared_prefix"],
    }


def run_plain(args) -> dict:
    """An SFT step over the same samples packed densely, micro-batches of the RL side's token slots."""
    from feynrl_jax.losses import ALGORITHMS
    from feynrl_jax.models import ModelConfig, init_params
    from feynrl_jax.sharding import RULES, make_mesh
    from feynrl_jax.train.optimizer import make_optimizer
    from feynrl_jax.train.packed_units import pack_units
    from feynrl_jax.train.rl_batch import rollouts_to_batch
    from feynrl_jax.train.step import make_algorithm_train_step

    # As a run's config makes it (model.cpu_matmul defaults to "auto"), in the chosen precision and remat.
    config = ModelConfig(**SMOLLM2_135M, compute_dtype=args.precision, remat=args.remat, cpu_matmul="auto")
    seq_len = PROMPT_WIDTH + args.max_new_tokens
    rows_per_micro = max(1, args.micro_tokens // seq_len)
    mesh = make_mesh(1, 1, 1, devices=jax.devices()[:1])
    optimizer, _ = make_optimizer(1e-6, warmup_steps=0, total_steps=100, schedule="constant")
    params = init_params(config, jax.random.key(0))
    steps, seconds, tokens = {}, [], []
    state = None
    for step in range(args.steps):
        rollouts = make_rollouts(args, seed=step)
        zeros = np.zeros(rollouts.completion_mask.shape, np.float32)
        batch = rollouts_to_batch(rollouts, zeros, seq_len=seq_len, pad_id=0)
        n = batch.tokens.shape[0]
        packed, stats = pack_units(batch, num_micro=n // rows_per_micro, pad_id=0)
        micro = stats.micro_batches
        # The filled rows (the dense batch), with empty ones up to whole micro-batches.
        filled = (np.asarray(packed.segment_ids) != 0).any(axis=1)
        take = np.r_[np.flatnonzero(filled), np.flatnonzero(~filled)][: micro * rows_per_micro]
        dense = jax.tree.map(lambda x, take=take: np.asarray(x)[take], packed)
        if micro not in steps:
            steps[micro] = make_algorithm_train_step(
                ALGORITHMS["sft"], optimizer, mesh, RULES["dp"], config=config, grad_accum=micro, check_updated=False
            )
        train_step = steps[micro]
        if state is None:
            state = train_step.init_state(params)
        placed = train_step.place_batch(dense)
        t0 = time.perf_counter()
        state, metrics = train_step(state, placed)
        jax.block_until_ready(metrics)
        seconds.append(time.perf_counter() - t0)
        tokens.append(real_tokens(rollouts))
    later = [i for i in range(1, args.steps) if seconds[i] < 3 * min(seconds)] or list(range(args.steps))
    rate = statistics.median(tokens[i] / seconds[i] for i in later)
    return {"tokens_per_second": rate, "update_seconds": seconds, "rows_per_micro": rows_per_micro}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--micro-tokens", type=int, default=1024, help="token slots per micro-batch (all sides)")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--precision", choices=("float32", "bfloat16"), default="float32", help="compute dtype")
    parser.add_argument("--remat", choices=REMAT_POLICIES, default="auto", help="model.remat")
    parser.add_argument(
        "--also-remat",
        default="",
        help=f"comma-separated, of {REMAT_POLICIES}: rl_packed again under each model.remat (rl_packed_<policy>)",
    )
    parser.add_argument(
        "--kl-coef",
        type=float,
        default=None,
        help="algo.kl_coef of the RL sides (0: no reference model's pass); default: the tiny GRPO config's",
    )
    parser.add_argument("--sides", default=",".join(SIDES), help=f"comma-separated, of {SIDES} (rl_packed always)")
    parser.add_argument("--json", default="")
    args = parser.parse_args()
    sides = set(args.sides.split(",")) | {"rl_packed"}
    if sides - set(SIDES):
        parser.error(f"--sides: unknown {sorted(sides - set(SIDES))}; expected some of {SIDES}")
    also_remat = [policy for policy in args.also_remat.split(",") if policy]
    if unknown := sorted(set(also_remat) - set(REMAT_POLICIES)):
        parser.error(f"--also-remat: unknown {unknown}; expected some of {REMAT_POLICIES}")
    result = {
        "model": f"SmolLM2-135M architecture (random weights, float32), {args.precision} compute, one CPU device",
        "cpu": os.popen("lscpu | grep 'Model name' | cut -d: -f2").read().strip(),
        "settings": vars(args),
    }
    with scratch_folder(None, prefix="bench_rl_update_") as workdir:
        runs = {
            "rl_packed": lambda: run_rl(args, workdir, pack=True),
            "rl_dense": lambda: run_rl(args, workdir, pack=True, blocks=False),
            "rl_unpacked": lambda: run_rl(args, workdir, pack=False),
            "plain": lambda: run_plain(args),
        }
        result |= {side: run() for side, run in runs.items() if side in sides}
        for policy in also_remat:
            result[f"rl_packed_{policy}"] = run_rl(args, workdir, pack=True, remat=policy)
    rate = {side: result[side]["tokens_per_second"] for side in SIDES if side in result}
    for name, (a, b) in RATIOS.items():
        if a in rate and b in rate:
            result[name] = rate[a] / rate[b]
    for policy in also_remat:
        result[f"speedup_{policy}_vs_remat"] = result[f"rl_packed_{policy}"]["tokens_per_second"] / rate["rl_packed"]
    text = json.dumps(result, indent=2)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
