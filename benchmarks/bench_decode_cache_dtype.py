"""bfloat16 decode on a CPU: the native engine's decode dispatch against a bfloat16 KV cache and a float32 one.

XLA:CPU computes a bfloat16 dot by widening both operands to float32, so decode attention against a bfloat16 cache
converts the whole cache at every step. `feynrl_jax.models.cache_dtype` therefore gives a bfloat16 model a float32
cache on a CPU (holding bfloat16-rounded values). This script measures what that buys, both caches in one process,
their dispatches alternating.

Model: SmolLM2-135M's shapes with random weights (`init_params`), `param_dtype = compute_dtype = "bfloat16"`,
`cpu_matmul="auto"` (oneDNN products where the kernel is built, as a run gets), per-layer params and a per-layer
cache (the engine's layout, `unstack_layers`, `KVCache.unstack`). `--batch` rows, each at its own position spread
over the first `--live-len` positions of a `--cache-len` cache (continuous batching), run the engine's jitted decode
dispatch (`decode_dispatch`, `--dispatch-steps` steps in one `lax.scan`, sampling at temperature 1, the state
donated). The first round compiles and is not timed; the median of `--repeats` rounds is reported per step.

Run:
    python benchmarks/bench_decode_cache_dtype.py --batch 32 --cache-len 256 --dispatch-steps 16
"""

from __future__ import annotations

import argparse
import functools
import os
import time

from feynrl_jax.host_memory import reexec_with_allocator_tunables

reexec_with_allocator_tunables()  # before jax allocates

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from bench_cpu_matmul import usable_cpus  # noqa: E402
from bench_decode_step import decode_state  # noqa: E402
from bench_model_fwd_bwd import SMOLLM2_135M_SHAPES  # noqa: E402

from feynrl_jax.kernels import onednn  # noqa: E402
from feynrl_jax.models import ModelConfig, cache_dtype, init_cache, init_params, unstack_layers  # noqa: E402
from feynrl_jax.rollout.decode import decode_dispatch  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--cache-len", type=int, default=256)
    parser.add_argument("--live-len", type=int, default=192, help="rows sit at positions below this")
    parser.add_argument("--dispatch-steps", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    shapes = {"model_type": "llama", **SMOLLM2_135M_SHAPES}
    config = ModelConfig.from_hf(shapes, param_dtype="bfloat16", compute_dtype="bfloat16", cpu_matmul="auto")
    params = unstack_layers(init_params(config, jax.random.key(0)))
    batch, steps = args.batch, args.dispatch_steps
    positions = np.linspace(0, args.live_len - steps, batch).astype(np.int32)  # fresh arrays: dispatch donates
    dispatch = jax.jit(
        functools.partial(decode_dispatch, config=config, steps=steps, greedy=False, top_k=0, use_top_p=False),
        donate_argnums=1,
    )
    sampling = (jnp.zeros((0,), jnp.int32), jnp.float32(1.0), jnp.float32(1.0), jnp.int32(0))

    def state(dtype):
        cache = jax.tree.map(lambda a: a.astype(dtype), init_cache(config, batch, args.cache_len)).unstack()
        return decode_state(cache, positions, args.cache_len)

    states = {"bfloat16 cache": state(jnp.bfloat16), "float32 cache (cache_dtype)": state(jnp.float32)}
    times = {name: [] for name in states}
    for repeat in range(args.repeats + 1):  # the first round compiles
        for name, run_state in states.items():
            start = time.perf_counter()
            run_state, tokens, *_ = dispatch(params, run_state._replace(positions=jnp.asarray(positions)), *sampling)
            jax.block_until_ready((run_state, tokens))
            states[name] = run_state
            if repeat:
                times[name].append((time.perf_counter() - start) / steps)

    units = ", ".join(onednn.cpu_bf16_units()) or "none"
    products = "oneDNN" if onednn.use_onednn(config.cpu_matmul, config.compute_dtype) else "XLA"
    print(f"SmolLM2-135M shapes, random weights, bfloat16, {products} products; bf16 instructions: {units}")
    print(f"usable cpus {usable_cpus()} of {os.cpu_count()}; cache_dtype here: {cache_dtype(config).name}")
    print(
        f"B={batch} rows at positions 0..{args.live_len - 1} of a {args.cache_len}-position cache, "
        f"{steps} steps per dispatch, sampling at T=1"
    )
    medians = {name: float(np.median(t)) for name, t in times.items()}
    for name, median in medians.items():
        print(f"  {name}: {median * 1e3:.1f} ms/step, {batch / median:.0f} tokens/s (median of {args.repeats})")
    (narrow, narrow_s), (wide, wide_s) = medians.items()
    print(f"  {wide} / {narrow}: {narrow_s / wide_s:.2f}x faster")


if __name__ == "__main__":
    main()
