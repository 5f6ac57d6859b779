"""Memory and time of a train step whose update is chosen before it is computed (`check_updated=False`, what the
runs build on `make_optimizer`'s AdamW) against one that tests the updated params and optimizer state before
keeping them (`check_updated=True`, the default for any other optax optimizer), side by side in one process.

The step is `make_algorithm_train_step`'s GRPO step on a SmolLM2-135M-shaped model with random weights, float32,
`model.remat="full"` (what "auto" picks on a CPU), shaped like the GRPO benchmark's update at 64 new tokens
(`bench_grpo_vs_trl.py --max-new-tokens 64`): `--micro` micro-batches of one row of 64 prompt + 8 x 64 completion
columns (the trainer's shared-prefix layout, `train.shared_prefix`: one row per group).

For each variant it prints the temporary buffers XLA plans for the compiled step
(`memory_analysis().temp_size_in_bytes`: what a step holds beside its params and optimizer state, which are donated
and rewritten) and, with `--steps` > 0, the seconds per step (the variants alternate, `--steps` rounds after one
warm-up each, median), then the ratios in place / checked.

Run:
    python benchmarks/bench_update_guard.py --steps 3
"""

from __future__ import annotations

import argparse
import statistics
import time

from feynrl_jax.host_memory import reexec_with_allocator_tunables

reexec_with_allocator_tunables()  # the allocator every other benchmark and `make` runs with

import jax  # noqa: E402
import numpy as np  # noqa: E402
from bench_model_fwd_bwd import SMOLLM2_135M_SHAPES  # noqa: E402

from feynrl_jax.losses import ALGORITHMS, TrainBatch  # noqa: E402
from feynrl_jax.models import ModelConfig, init_params  # noqa: E402
from feynrl_jax.rollout.types import Rollouts  # noqa: E402
from feynrl_jax.sharding import RULES, make_mesh  # noqa: E402
from feynrl_jax.train.optimizer import make_optimizer  # noqa: E402
from feynrl_jax.train.shared_prefix import shared_prefix_rows  # noqa: E402
from feynrl_jax.train.step import make_algorithm_train_step  # noqa: E402

VARIANTS = {"checked": True, "in place": False}
"""Each variant's `check_updated`."""


def grpo_batch(config: ModelConfig, groups: int, prompt: int, group: int, width: int) -> TrainBatch:
    """`groups` groups of a `prompt`-token prompt and `group` completions of `width` tokens, in the trainer's
    shared-prefix layout (`train.shared_prefix.shared_prefix_rows`: one row per group), completions scored."""
    rng = np.random.default_rng(0)
    n = groups * group
    rollouts = Rollouts(
        prompt_ids=np.repeat(rng.integers(1, config.vocab_size, (groups, prompt)), group, axis=0).astype(np.int32),
        prompt_lengths=np.full(n, prompt, np.int32),
        completion_ids=rng.integers(1, config.vocab_size, (n, width)).astype(np.int32),
        completion_mask=np.ones((n, width), np.float32),
        behavior_logprobs=np.full((n, width), -4.0, np.float32),
        finish_reason=np.zeros(n, np.int32),
        group_id=np.arange(n, dtype=np.int32) // group,
        policy_version=np.zeros(n, np.int32),
    )
    rows = shared_prefix_rows(rollouts, prompt_width=prompt, completion_width=group * width, pad_id=0)
    loss_mask = (rows.sample_row >= 0).astype(np.float32)
    advantages = rng.standard_normal(loss_mask.shape).astype(np.float32) * loss_mask
    return TrainBatch(rows.tokens, rows.positions, rows.segment_ids, loss_mask, advantages, -4.0 * loss_mask)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--micro", type=int, default=4, help="micro-batches (rows) per step")
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--width", type=int, default=64, help="completion tokens")
    parser.add_argument("--steps", type=int, default=0, help="timed rounds (0: memory only)")
    args = parser.parse_args()

    config = ModelConfig.from_hf({"model_type": "llama", **SMOLLM2_135M_SHAPES}, remat="full")
    params = jax.tree.map(np.asarray, init_params(config, jax.random.key(0)))
    param_bytes = sum(x.nbytes for x in jax.tree.leaves(params))
    batch = grpo_batch(config, args.micro, args.prompt, args.group, args.width)
    mesh = make_mesh(1, 1, 1, devices=jax.devices()[:1])
    print(
        f"SmolLM2-135M shapes, random weights, float32, remat full; {args.micro} micro-batches of one row of "
        f"{args.prompt} + {args.group} x {args.width} columns; params {param_bytes / 2**30:.2f} GiB",
        flush=True,
    )
    steps, states, temps, seconds = {}, {}, {}, {name: [] for name in VARIANTS}
    for name, check_updated in VARIANTS.items():
        optimizer, schedule = make_optimizer(1e-6, schedule="constant", weight_decay=0.01)
        step = make_algorithm_train_step(
            ALGORITHMS["grpo"],
            optimizer,
            mesh,
            RULES["dp"],
            config=config,
            hyperparameters={"kl_coef": 0.0},
            grad_accum=args.micro,
            learning_rate_fn=schedule,
            check_updated=check_updated,
        )
        steps[name], states[name] = step, step.init_state(params)
        temps[name] = step.compile(states[name], step.place_batch(batch)).memory_analysis().temp_size_in_bytes
        print(f"{name:8s} (check_updated={check_updated}): temp {temps[name] / 2**30:.2f} GiB", flush=True)
    for round_ in range(args.steps + 1 if args.steps > 0 else 0):
        for name, step in steps.items():
            start = time.perf_counter()
            states[name], metrics = step(states[name], step.place_batch(batch))
            jax.block_until_ready(states[name])
            if round_ > 0:  # the first round warms up
                seconds[name].append(time.perf_counter() - start)
            assert float(metrics["train/update_skipped"].value) == 0.0
    summary = f"in place / checked: temp {temps['in place'] / temps['checked']:.2f}x"
    summary += f" ({(temps['checked'] - temps['in place']) / param_bytes:.2f}x the params' bytes less)"
    if args.steps > 0:
        difference = max(
            float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
            for a, b in zip(jax.tree.leaves(states["checked"].params), jax.tree.leaves(states["in place"].params))
        )
        median = {name: statistics.median(s) for name, s in seconds.items()}
        summary += f"; s/step {median['in place']:.2f} against {median['checked']:.2f}"
        summary += f", {median['in place'] / median['checked']:.2f}x; params' largest difference {difference:.1e}"
    print(summary, flush=True)


if __name__ == "__main__":
    main()
