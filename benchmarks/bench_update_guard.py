"""Memory and time of a train step whose update is chosen before it is computed (`check_updated=False`, what the
runs build on `make_optimizer`'s AdamW) against one that tests the updated params and optimizer state before
keeping them (`check_updated=True`, the default for any other optax optimizer), side by side in one process.

The step is `make_algorithm_train_step`'s GRPO step on a SmolLM2-135M-shaped model with random weights, float32,
`model.remat="full"` (what "auto" picked on a CPU in float32 until 2026-12-08; "dots" since), shaped like the GRPO
benchmark's update at 64 new tokens (`bench_grpo_vs_trl.py --max-new-tokens 64`): `--micro` micro-batches of one row of
64 prompt + 8 x 64 completion columns (the trainer's shared-prefix layout, `train.shared_prefix`: one row per group).

For each variant it prints the temporary buffers XLA plans for the compiled step
(`memory_analysis().temp_size_in_bytes`: what a step holds beside its params and optimizer state, which are donated
and rewritten) and, with `--steps` > 0, the seconds per step (the variants alternate, `--steps` rounds after one
warm-up each, median), then the ratios in place / checked.

Run:
    python benchmarks/bench_update_guard.py --steps 3
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from collections.abc import Callable

from feynrl_jax.host_memory import reexec_with_allocator_tunables

reexec_with_allocator_tunables()  # the allocator every other benchmark and `make` runs with

import jax  # noqa: E402
import numpy as np  # noqa: E402
from bench_model_fwd_bwd import SMOLLM2_135M_SHAPES  # noqa: E402

from feynrl_jax.losses import ALGORITHMS  # noqa: E402
from feynrl_jax.models import ModelConfig, init_params  # noqa: E402
from feynrl_jax.sharding import RULES, make_mesh  # noqa: E402
from feynrl_jax.testing.batches import shared_prefix_batch  # noqa: E402
from feynrl_jax.train.optimizer import make_optimizer  # noqa: E402
from feynrl_jax.train.step import TrainStep, make_algorithm_train_step  # noqa: E402

VARIANTS = {"checked": True, "in place": False}
"""Each variant's `check_updated`."""


def step_setup(
    description: str, add_arguments: Callable[[argparse.ArgumentParser], None] | None = None
) -> tuple[argparse.Namespace, ModelConfig, dict, object, object]:
    """The command line of this benchmark and `bench_grad_sink.py` (whose own options `add_arguments` adds), and what
    both step: `(args, config, host params, batch, one-device mesh)`: a SmolLM2-135M-shaped model with random
    weights, float32, remat "full", and `--micro` group rows of `--prompt` + `--group` x `--width` columns
    (`testing.batches.shared_prefix_batch`)."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    if add_arguments is not None:
        add_arguments(parser)
    parser.add_argument("--micro", type=int, default=4, help="micro-batches (rows) per step")
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--width", type=int, default=64, help="completion tokens")
    parser.add_argument("--steps", type=int, default=0, help="timed rounds (0: memory only)")
    args = parser.parse_args()
    config = ModelConfig.from_hf({"model_type": "llama", **SMOLLM2_135M_SHAPES}, remat="full")
    params = jax.tree.map(np.asarray, init_params(config, jax.random.key(0)))
    batch = shared_prefix_batch(config.vocab_size, args.micro, prompt=args.prompt, group=args.group, width=args.width)
    param_bytes = sum(x.nbytes for x in jax.tree.leaves(params))
    print(
        f"SmolLM2-135M shapes, random weights, float32, remat full; {args.micro} micro-batches of one row of "
        f"{args.prompt} + {args.group} x {args.width} columns; params {param_bytes / 2**30:.2f} GiB",
        flush=True,
    )
    return args, config, params, batch, make_mesh(1, 1, 1, devices=jax.devices()[:1])


def compare_steps(
    builders: dict[str, Callable[[], TrainStep]],
    params,
    batch,
    rounds: int,
    tracing: dict[str, Callable[[], contextlib.AbstractContextManager]] | None = None,
) -> tuple[dict[str, int], dict[str, float], float]:
    """Builds each variant's step, compiles it for `batch` and, with `rounds` > 0, times `rounds` steps of each after
    a warm-up, the variants alternating. `tracing`: per variant, a context its step is built and compiled in (a call
    after `TrainStep.compile` runs the compiled program without tracing again).

    Returns:
        `(XLA's temporary bytes per variant, median seconds per step per variant (empty without rounds), the largest
        difference between the first two variants' params after the steps (0 without rounds))`.
    """
    steps, states, temps, seconds = {}, {}, {}, {name: [] for name in builders}
    for name, build in builders.items():
        with (tracing or {}).get(name, contextlib.nullcontext)():
            step = build()
            steps[name], states[name] = step, step.init_state(params)
            temps[name] = step.compile(states[name], step.place_batch(batch)).memory_analysis().temp_size_in_bytes
        print(f"{name:8s}: temp {temps[name] / 2**30:.2f} GiB", flush=True)
    for round_ in range(rounds + 1 if rounds > 0 else 0):
        for name, step in steps.items():
            start = time.perf_counter()
            states[name], metrics = step(states[name], step.place_batch(batch))
            jax.block_until_ready(states[name])
            if round_ > 0:  # the first round warms up
                seconds[name].append(time.perf_counter() - start)
            assert float(metrics["train/update_skipped"].value) == 0.0
    if rounds <= 0:
        return temps, {}, 0.0
    first, second = (jax.tree.leaves(states[name].params) for name in list(builders)[:2])
    difference = max(float(np.max(np.abs(np.asarray(a) - np.asarray(b)))) for a, b in zip(first, second))
    return temps, {name: statistics.median(s) for name, s in seconds.items()}, difference


def main() -> None:
    args, config, params, batch, mesh = step_setup(__doc__)

    def build(check_updated: bool) -> TrainStep:
        optimizer, schedule = make_optimizer(1e-6, schedule="constant", weight_decay=0.01)
        return make_algorithm_train_step(
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

    builders = {name: (lambda check=check: build(check)) for name, check in VARIANTS.items()}
    temps, median, difference = compare_steps(builders, params, batch, args.steps)
    param_bytes = sum(x.nbytes for x in jax.tree.leaves(params))
    summary = f"in place / checked: temp {temps['in place'] / temps['checked']:.2f}x"
    summary += f" ({(temps['checked'] - temps['in place']) / param_bytes:.2f}x the params' bytes less)"
    if median:
        summary += f"; s/step {median['in place']:.2f} against {median['checked']:.2f}"
        summary += f", {median['in place'] / median['checked']:.2f}x; params' largest difference {difference:.1e}"
    print(summary, flush=True)


if __name__ == "__main__":
    main()
