"""Memory and time of a train step that adds each micro-batch's layer gradients into its accumulator in place
(`grad_sink`, `models.forward`: what a run's step does) against one whose model returns them as a stack of their
own, added to the accumulator afterwards, side by side in one process.

The step is the GRPO step of the runs (`make_train_step` on the GRPO loss, `model_logprob_fn`, `check_updated=False`)
or, with `--model critic`, PPO's critic step (`make_critic_train_step`: the value loss over `critic_values`, whose
backbone's layers sink), on a SmolLM2-135M-shaped model with random weights, `model.remat="full"` (the policy a sink
needs; "auto" on a CPU in bfloat16, and in float32 until 2026-12-08), shaped like the GRPO benchmark's update at 64 new
tokens (`bench_grpo_vs_trl.py --max-new-tokens 64`): `--micro` micro-batches of one row of 64 prompt + 8 x 64 completion
columns in the trainer's shared-prefix layout (`testing.batches.shared_prefix_batch`). The other variant's `predict` is
the same function without the `layer_sink` mark, so the step accumulates as it did before the sink.

`--blocks`: the model runs attention in blocks and scores the completion columns only, as the runs' trainer predicts
on this layout (without it, dense attention over the row). `--also-remat dots,none` (policy model): one more
variant per policy, "stack dots" and "stack none", the same step under `model.remat` "dots" or "none", which take
no sink (`models.sinks_layer_grads`): what rematerialising every layer, the sink's policy, costs against them.

`--precision bfloat16`: bfloat16 weights and compute from float32 master weights (`model.master_dtype`), the
accumulator float32, as `model.master_dtype="float32"` trains a bfloat16 model. Where its bfloat16 products run on
oneDNN (`--cpu-matmul`, as `model.cpu_matmul`: `onednn.use_onednn`), a third variant, "cast in products", is the
sink step with the float32 kernels cast inside their products (`onednn.dot_cast`, whose weight gradients come out
in float32), which `decoder._kernels_cast_in_products` leaves out of a pass into a sink: against "sink", where each
layer's kernels are cast once before its products, it measures that choice.

For each variant it prints the temporary buffers XLA plans for the compiled step
(`memory_analysis().temp_size_in_bytes`) and, with `--steps` > 0, the seconds per step (the variants alternate,
`--steps` rounds after one warm-up each, median), then the ratios sink / stack and the params' largest difference.

Run:
    python benchmarks/bench_grad_sink.py --steps 3
    python benchmarks/bench_grad_sink.py --steps 3 --model critic
    python benchmarks/bench_grad_sink.py --steps 5 --precision bfloat16 --cpu-matmul auto
    python benchmarks/bench_grad_sink.py --steps 3 --width 128 --micro 2 --blocks --also-remat dots,none
"""

from __future__ import annotations

from feynrl_jax.host_memory import reexec_with_allocator_tunables

reexec_with_allocator_tunables()  # the allocator every other benchmark and `make` runs with

import contextlib  # noqa: E402
import dataclasses  # noqa: E402
import functools  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
from bench_update_guard import compare_steps, step_setup  # noqa: E402

import feynrl_jax.models.decoder as decoder  # noqa: E402
from feynrl_jax.kernels import CPU_MATMUL_BACKENDS, onednn  # noqa: E402
from feynrl_jax.losses import ALGORITHMS  # noqa: E402
from feynrl_jax.sharding import RULES  # noqa: E402
from feynrl_jax.train.critic import (  # noqa: E402
    critic_params_spec,
    critic_values,
    init_critic_params,
    make_critic_train_step,
    value_loss,
)
from feynrl_jax.train.optimizer import make_optimizer  # noqa: E402
from feynrl_jax.train.shared_prefix import shared_bounds  # noqa: E402
from feynrl_jax.train.step import ParamsSpec, TrainStep, make_train_step, model_logprob_fn  # noqa: E402


def options(parser) -> None:
    parser.add_argument("--model", choices=("policy", "critic"), default="policy")
    parser.add_argument("--precision", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument(
        "--also-remat",
        default="",
        help="policy model: comma-separated further model.remat policies (dots, none), each run as one more "
        "variant, 'stack <policy>' (the ordinary scan under that policy: no sink), compared with 'sink'",
    )
    parser.add_argument(
        "--blocks",
        action="store_true",
        help="policy model: attention in blocks and the prompt columns unscored, as the runs' trainer predicts on "
        "this layout (`shared_prefix.shared_bounds`, `first_column`); default: dense attention, every column scored",
    )
    parser.add_argument(
        "--cpu-matmul",
        choices=CPU_MATMUL_BACKENDS,
        default="xla",
        help="model.cpu_matmul of the steps (the runs' default is auto; the README's figures before the bfloat16 "
        "variant ran on xla)",
    )


@contextlib.contextmanager
def kernels_cast_in_sink(sink_passes: list[bool]):
    """`decoder._kernels_cast_in_products` without its exclusion of passes into a gradient sink, for the steps traced
    within; appends to `sink_passes` whether each pass it decided for was one (the benchmark checks one was)."""
    decide = decoder._kernels_cast_in_products

    def decide_in_sink_too(config, dtype, use_onednn, into_sink):
        sink_passes.append(into_sink)
        return decide(config, dtype, use_onednn, False)

    decoder._kernels_cast_in_products = decide_in_sink_too
    try:
        yield
    finally:
        decoder._kernels_cast_in_products = decide


def main() -> None:
    args, config, params, batch, mesh = step_setup(__doc__, options)
    config, master = dataclasses.replace(config, cpu_matmul=args.cpu_matmul), None
    if args.precision == "bfloat16":
        config, master = dataclasses.replace(config, param_dtype="bfloat16", compute_dtype="bfloat16"), "float32"
    print(f"{args.model}, {args.precision} compute, model.cpu_matmul={args.cpu_matmul!r}", flush=True)
    layer_bytes = sum(x.nbytes for x in jax.tree.leaves(params["layers"]))
    optimizer, schedule = make_optimizer(1e-6, schedule="constant", weight_decay=0.01)
    step_options = dict(grad_accum=args.micro, learning_rate_fn=schedule, check_updated=False)

    also = [policy for policy in args.also_remat.split(",") if policy]
    if also and args.model != "policy" or set(also) - {"dots", "none"}:
        raise SystemExit(f"--also-remat {args.also_remat!r}: policies of dots, none, for --model policy only")
    bounds = shared_bounds(args.prompt, args.width) if args.blocks else None

    def policy_predict(config):
        if bounds is None:
            return model_logprob_fn(config)
        return model_logprob_fn(config, first_column=args.prompt, segment_bounds=bounds)

    if args.model == "policy":
        sinking = policy_predict(config)
        loss, spec = ALGORITHMS["grpo"].make_loss(kl_coef=0.0), ParamsSpec.of_model(config)
    else:
        params = jax.tree.map(np.asarray, init_critic_params(params, config))
        params["value_head"]["kernel"] = np.full_like(params["value_head"]["kernel"], 0.01)  # passes a gradient
        rng = np.random.default_rng(0)
        batch = dataclasses.replace(
            batch,
            returns=rng.standard_normal(batch.tokens.shape).astype(np.float32),
            values=(0.1 * rng.standard_normal(batch.tokens.shape)).astype(np.float32),
        )

        def sinking(params, batch, grad_sink=None):
            values = critic_values(
                params, batch.tokens, batch.positions, batch.segment_ids, config=config, grad_sink=grad_sink
            )
            return values, None

        sinking.layer_sink = ("backbone", "layers")  # the mark the runs' critic step gives its own (asserted below)
        loss, spec = functools.partial(value_loss, value_clip=0.2), critic_params_spec(config)
        runs_step = make_critic_train_step(
            config,
            optimizer,
            mesh,
            RULES["dp"],
            value_clip=0.2,
            grad_accum=args.micro,
            params_spec=spec.with_master_dtype(master),
            check_updated=False,
        )
        assert runs_step.sinks_layer_grads, "the runs' critic step does not sink"

    def build(predict) -> TrainStep:
        return make_train_step(
            loss,
            optimizer,
            mesh,
            RULES["dp"],
            predict=predict,
            params_spec=spec.with_master_dtype(master),
            **step_options,
        )

    builders = {
        "sink": lambda: build(sinking),
        "stack": lambda: build(lambda *a, **k: sinking(*a, **k)),  # the same function without the mark
    }
    assert builders["sink"]().sinks_layer_grads and not builders["stack"]().sinks_layer_grads
    for policy in also:  # a predict under "dots" or "none" carries no sink mark (`sinks_layer_grads`)
        other = policy_predict(dataclasses.replace(config, remat=policy))
        builders[f"stack {policy}"] = lambda other=other: build(other)
        assert not builders[f"stack {policy}"]().sinks_layer_grads
    tracing, sink_passes = {}, []
    if args.precision == "bfloat16":
        if onednn.use_onednn(config.cpu_matmul, config.compute_dtype, False):
            builders["cast in products"] = builders["sink"]
            tracing["cast in products"] = lambda: kernels_cast_in_sink(sink_passes)
        else:
            print(f"no 'cast in products' variant: bfloat16 products not on oneDNN (--cpu-matmul {args.cpu_matmul})")
    temps, median, difference = compare_steps(builders, params, batch, args.steps, tracing)
    if tracing and not any(sink_passes):
        raise SystemExit("the 'cast in products' variant traced no pass into a sink: it measured nothing")
    summary = f"sink / stack: temp {temps['sink'] / temps['stack']:.2f}x"
    less = (temps["stack"] - temps["sink"]) / layer_bytes
    summary += f" ({less:.2f}x the layers' {layer_bytes / 2**30:.2f} GiB less)"
    if median:
        summary += f"; s/step {median['sink']:.2f} against {median['stack']:.2f}"
        summary += f", {median['sink'] / median['stack']:.2f}x; params' largest difference {difference:.1e}"
    print(summary, flush=True)
    for name in [name for name in temps if name == "cast in products" or name.startswith("stack ")]:
        line = f"{name} / sink: temp {temps[name] / temps['sink']:.2f}x"
        if median:
            line += f"; s/step {median[name]:.2f} against {median['sink']:.2f}, {median[name] / median['sink']:.2f}x"
        print(line, flush=True)


if __name__ == "__main__":
    main()
