"""Memory and time of a train step that adds each micro-batch's layer gradients into its accumulator in place
(`grad_sink`, `models.forward`: what a run's step does) against one whose model returns them as a stack of their
own, added to the accumulator afterwards, side by side in one process.

The step is the GRPO step of the runs (`make_train_step` on the GRPO loss, `model_logprob_fn`,
`check_updated=False`) on a SmolLM2-135M-shaped model with random weights, float32, `model.remat="full"` (what
"auto" picks on a CPU), shaped like the GRPO benchmark's update at 64 new tokens (`bench_grpo_vs_trl.py
--max-new-tokens 64`): `--micro` micro-batches of one row of 64 prompt + 8 x 64 completion columns in the
trainer's shared-prefix layout (`bench_update_guard.grpo_batch`). The other variant's `predict` is the same
function without the `sinks_layer_grads` mark, so the step accumulates as it did before the sink.

For each variant it prints the temporary buffers XLA plans for the compiled step
(`memory_analysis().temp_size_in_bytes`) and, with `--steps` > 0, the seconds per step (the variants alternate,
`--steps` rounds after one warm-up each, median), then the ratios sink / stack and the params' largest difference.

Run:
    python benchmarks/bench_grad_sink.py --steps 3
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
from bench_update_guard import grpo_batch  # noqa: E402

from feynrl_jax.losses import ALGORITHMS  # noqa: E402
from feynrl_jax.models import ModelConfig, init_params  # noqa: E402
from feynrl_jax.sharding import RULES, make_mesh  # noqa: E402
from feynrl_jax.train.optimizer import make_optimizer  # noqa: E402
from feynrl_jax.train.step import ParamsSpec, make_train_step, model_logprob_fn  # noqa: E402


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
    layer_bytes = sum(x.nbytes for x in jax.tree.leaves(params["layers"]))
    batch = grpo_batch(config, args.micro, args.prompt, args.group, args.width)
    mesh = make_mesh(1, 1, 1, devices=jax.devices()[:1])
    print(
        f"SmolLM2-135M shapes, random weights, float32, remat full; {args.micro} micro-batches of one row of "
        f"{args.prompt} + {args.group} x {args.width} columns; params {param_bytes / 2**30:.2f} GiB, of which "
        f"the layers {layer_bytes / 2**30:.2f} GiB",
        flush=True,
    )
    sinking = model_logprob_fn(config)
    variants = {"sink": sinking, "stack": lambda *a, **k: sinking(*a, **k)}  # the second lacks the mark
    steps, states, temps, seconds = {}, {}, {}, {name: [] for name in variants}
    for name, predict in variants.items():
        optimizer, schedule = make_optimizer(1e-6, schedule="constant", weight_decay=0.01)
        step = make_train_step(
            ALGORITHMS["grpo"].make_loss(kl_coef=0.0),
            optimizer,
            mesh,
            RULES["dp"],
            predict=predict,
            params_spec=ParamsSpec.of_model(config),
            grad_accum=args.micro,
            learning_rate_fn=schedule,
            check_updated=False,
        )
        steps[name], states[name] = step, step.init_state(params)
        temps[name] = step.compile(states[name], step.place_batch(batch)).memory_analysis().temp_size_in_bytes
        print(f"{name:6s}: temp {temps[name] / 2**30:.2f} GiB", flush=True)
    for round_ in range(args.steps + 1 if args.steps > 0 else 0):
        for name, step in steps.items():
            start = time.perf_counter()
            states[name], metrics = step(states[name], step.place_batch(batch))
            jax.block_until_ready(states[name])
            if round_ > 0:  # the first round warms up
                seconds[name].append(time.perf_counter() - start)
            assert float(metrics["train/update_skipped"].value) == 0.0
    summary = f"sink / stack: temp {temps['sink'] / temps['stack']:.2f}x"
    summary += f" ({(temps['stack'] - temps['sink']) / layer_bytes:.2f}x the layers' bytes less)"
    if args.steps > 0:
        difference = max(
            float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
            for a, b in zip(jax.tree.leaves(states["stack"].params), jax.tree.leaves(states["sink"].params))
        )
        median = {name: statistics.median(s) for name, s in seconds.items()}
        summary += f"; s/step {median['sink']:.2f} against {median['stack']:.2f}"
        summary += f", {median['sink'] / median['stack']:.2f}x; params' largest difference {difference:.1e}"
    print(summary, flush=True)


if __name__ == "__main__":
    main()
