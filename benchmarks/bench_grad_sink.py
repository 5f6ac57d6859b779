"""Memory and time of a train step that adds each micro-batch's layer gradients into its accumulator in place
(`grad_sink`, `models.forward`: what a run's step does) against one whose model returns them as a stack of their
own, added to the accumulator afterwards, side by side in one process.

The step is the GRPO step of the runs (`make_train_step` on the GRPO loss, `model_logprob_fn`,
`check_updated=False`) on a SmolLM2-135M-shaped model with random weights, float32, `model.remat="full"` (what
"auto" picks on a CPU), shaped like the GRPO benchmark's update at 64 new tokens (`bench_grpo_vs_trl.py
--max-new-tokens 64`): `--micro` micro-batches of one row of 64 prompt + 8 x 64 completion columns in the
trainer's shared-prefix layout (`testing.batches.shared_prefix_batch`). The other variant's `predict` is the same
function without the `sinks_layer_grads` mark, so the step accumulates as it did before the sink.

For each variant it prints the temporary buffers XLA plans for the compiled step
(`memory_analysis().temp_size_in_bytes`) and, with `--steps` > 0, the seconds per step (the variants alternate,
`--steps` rounds after one warm-up each, median), then the ratios sink / stack and the params' largest difference.

Run:
    python benchmarks/bench_grad_sink.py --steps 3
"""

from __future__ import annotations

from feynrl_jax.host_memory import reexec_with_allocator_tunables

reexec_with_allocator_tunables()  # the allocator every other benchmark and `make` runs with

import jax  # noqa: E402
from bench_update_guard import compare_steps, step_setup  # noqa: E402

from feynrl_jax.losses import ALGORITHMS  # noqa: E402
from feynrl_jax.sharding import RULES  # noqa: E402
from feynrl_jax.train.optimizer import make_optimizer  # noqa: E402
from feynrl_jax.train.step import ParamsSpec, TrainStep, make_train_step, model_logprob_fn  # noqa: E402


def main() -> None:
    args, config, params, batch, mesh = step_setup(__doc__)
    layer_bytes = sum(x.nbytes for x in jax.tree.leaves(params["layers"]))
    sinking = model_logprob_fn(config)

    def build(predict) -> TrainStep:
        optimizer, schedule = make_optimizer(1e-6, schedule="constant", weight_decay=0.01)
        return make_train_step(
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

    builders = {
        "sink": lambda: build(sinking),
        "stack": lambda: build(lambda *a, **k: sinking(*a, **k)),  # the same function without the mark
    }
    temps, median, difference = compare_steps(builders, params, batch, args.steps)
    summary = f"sink / stack: temp {temps['sink'] / temps['stack']:.2f}x"
    less = (temps["stack"] - temps["sink"]) / layer_bytes
    summary += f" ({less:.2f}x the layers' {layer_bytes / 2**30:.2f} GiB less)"
    if median:
        summary += f"; s/step {median['sink']:.2f} against {median['stack']:.2f}"
        summary += f", {median['sink'] / median['stack']:.2f}x; params' largest difference {difference:.1e}"
    print(summary, flush=True)


if __name__ == "__main__":
    main()
