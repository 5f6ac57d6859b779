"""A bfloat16 forward+backward step of ours with and without each of three changes, against PyTorch bf16 autocast.

The three changes (issue #18, a bf16 train step at 1.2x PyTorch where the CPU has AMX):
- the elementwise chains between the products (RoPE, RMSNorm, the MLP's silu(gate) * up) computed in float32 and
  rounded once (`rope.apply_rope`, `decoder.rms_norm`, `decoder.gated`), against the same computed in bfloat16 with
  every operation rounded (the code before; kept here as `*_rounded_per_op`);
- the kernel's bf16 products with a bf16 result on PyTorch's oneDNN 3.12 through ATen
  (`feynrl_jax/kernels/aten_matmul.cc`), against the kernel's own oneDNN 3.2 (`onednn.use_aten_products`);
- the float32 projection kernels cast inside their products, whose weight gradients the kernel then writes in
  float32 (`onednn.dot_cast`, `decoder._kernels_cast_in_products`), against the kernels cast to bfloat16 before the
  layers and their gradients rounded to bfloat16 in every layer (the code before; the variant marked "weight
  gradients in bf16", on the default float32 chains and PyTorch's oneDNN only).

Everything runs in this process, on the model and batch of `bench_model_fwd_bwd.py` (SmolLM2-135M, 8 x 256 tokens,
float32 weights, bfloat16 products, `model.cpu_matmul="onednn"`, `model.remat="auto"`): each of our five variants
compiled once, then `--rounds` rounds in which every variant and PyTorch (float32 weights under
`torch.autocast("cpu", dtype=torch.bfloat16)`, the transformers model) take one timed step each after one untimed
step, in turns, so a change of the machine's speed weighs on all. Prints and writes (`--json`) the median seconds per
step of each, and PyTorch's time over each of ours (above 1: ours is faster).

Run:
    python benchmarks/bench_bf16_step.py --rounds 7 --json docs/bench_bf16_step.json
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import json
import os
import statistics
import time

from feynrl_jax.host_memory import reexec_with_allocator_tunables

reexec_with_allocator_tunables()  # before jax/torch allocate: both sides run with it

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from bench_cpu_matmul import cpu_model, usable_cpus  # noqa: E402
from bench_model_fwd_bwd import model_folder, torch_step  # noqa: E402

import feynrl_jax.models.decoder as decoder  # noqa: E402
from feynrl_jax.checkpoints import load_hf  # noqa: E402
from feynrl_jax.kernels import onednn  # noqa: E402
from feynrl_jax.models import sequence_logprobs  # noqa: E402


def rope_rounded_per_op(x, cos, sin):
    """RoPE as computed before: in the dtype of `x`, each operation rounded to it."""
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    cos, sin = cos[:, :, None, :].astype(x.dtype), sin[:, :, None, :].astype(x.dtype)
    return x * cos + rotated * sin


def rms_norm_rounded_per_op(x, scale, eps):
    """RMSNorm as computed before: float32 statistics, the normalised input rounded, then scaled in `x`'s dtype."""
    xf = x.astype(jnp.float32)
    normed = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return scale.astype(x.dtype) * normed.astype(x.dtype)


def gated_rounded_per_op(gate, up):
    """The MLP's silu(gate) * up as computed before, in the dtype of `gate`."""
    return jax.nn.silu(gate) * up


PER_OP = {"apply_rope": rope_rounded_per_op, "rms_norm": rms_norm_rounded_per_op, "gated": gated_rounded_per_op}
"""The decoder's functions as they were, by name."""


def compiled_step(params, config, tokens, positions, per_op: bool, bf16_weight_grads: bool = False):
    """Our jitted forward+backward step (mean token negative log-likelihood), traced with the decoder's elementwise
    functions rounded per operation (`PER_OP`) or as they are, and with `bf16_weight_grads` the kernels cast before
    the layers (their gradients rounded to bfloat16) instead of inside their products."""
    current = {name: getattr(decoder, name) for name in (*PER_OP, "_kernels_cast_in_products")}
    if per_op:
        for name, fn in PER_OP.items():
            setattr(decoder, name, fn)
    if bf16_weight_grads:
        decoder._kernels_cast_in_products = lambda *_: False
    try:

        def loss(p, x, pos):
            lp, _ = sequence_logprobs(p, x, pos, config=config, remat="auto", chunk_size=256)
            return -lp[:, 1:].mean()

        return jax.jit(jax.value_and_grad(loss)).lower(params, tokens, positions).compile()
    finally:
        for name, fn in current.items():
            setattr(decoder, name, fn)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--json", default="", help="write the settings, medians and every step's time here")
    args = parser.parse_args()
    if onednn.problem():
        raise SystemExit(f"the oneDNN kernel cannot run: {onednn.problem()}")
    if not onednn.aten_built():
        raise SystemExit("the kernel's ATen library is not built (PyTorch not installed?): make setup")

    folder = model_folder()
    params, config = load_hf(folder)
    config = dataclasses.replace(config, compute_dtype="bfloat16", cpu_matmul="onednn")
    tokens = np.random.default_rng(0).integers(0, config.vocab_size, (args.batch, args.seq)).astype(np.int32)
    positions = np.broadcast_to(np.arange(args.seq, dtype=np.int32), tokens.shape)
    x, pos = jnp.asarray(tokens), jnp.asarray(positions)
    units = ", ".join(onednn.cpu_bf16_units()) or "none"
    print(f"{cpu_model()}, {usable_cpus()} cpus, bf16 matrix instructions: {units}; batch {args.batch}x{args.seq}")

    steps = {
        "rounded per op": compiled_step(params, config, x, pos, per_op=True),
        "float32 chains": compiled_step(params, config, x, pos, per_op=False),
    }
    variants = {
        f"ours, {chains}, {library}": (step, library == "PyTorch's oneDNN")
        for chains, step in steps.items()
        for library in ("oneDNN 3.2", "PyTorch's oneDNN")
    }
    before = compiled_step(params, config, x, pos, per_op=False, bf16_weight_grads=True)
    variants["ours, float32 chains, PyTorch's oneDNN, weight gradients in bf16"] = (before, True)
    times: dict[str, list[float]] = {name: [] for name in variants}
    times["PyTorch bf16 autocast"] = []
    torch_one = torch_step(folder, tokens, bf16=True)
    for round_ in range(args.rounds):
        for name, (step, aten) in variants.items():
            if onednn.use_aten_products(aten) != aten:
                raise SystemExit("the kernel did not take PyTorch's oneDNN for its bf16 products")
            jax.block_until_ready(step(params, x, pos))  # untimed: the other variant's memory and caches
            start = time.perf_counter()
            jax.block_until_ready(step(params, x, pos))
            times[name].append(time.perf_counter() - start)
        torch_one()
        start = time.perf_counter()
        torch_one()
        times["PyTorch bf16 autocast"].append(time.perf_counter() - start)
        print(f"round {round_}: " + ", ".join(f"{k} {v[-1]:.2f}s" for k, v in times.items()), flush=True)

    medians = {name: statistics.median(t) for name, t in times.items()}
    torch_s = medians["PyTorch bf16 autocast"]
    print(f"\nmedians of {args.rounds} rounds, {args.batch * args.seq} tokens per step")
    for name, seconds in medians.items():
        print(f"{name:66} {seconds:6.2f} s/step  PyTorch / this: {torch_s / seconds:.2f}x")
    if args.json:
        settings = {
            "cpu": cpu_model(),
            "cpus": usable_cpus(),
            "bf16_units": units,
            "batch": args.batch,
            "seq": args.seq,
            "rounds": args.rounds,
            "jax": jax.__version__,
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "unset"),
            "torch": importlib.metadata.version("torch"),
            "kernel_onednn": "onednn-cpu-gomp " + importlib.metadata.version("onednn-cpu-gomp"),
        }
        ratios = {name: torch_s / seconds for name, seconds in medians.items()}
        with open(args.json, "w") as f:
            summary = {"settings": settings, "medians_s": medians, "torch_over_ours": ratios, "runs": times}
            json.dump(summary, f, indent=1)
            f.write("\n")


if __name__ == "__main__":
    main()
