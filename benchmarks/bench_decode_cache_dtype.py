"""bfloat16 decode on a CPU: the native engine's decode dispatch against a bfloat16 KV cache and a float32 one.

XLA:CPU computes a bfloat16 dot by widening both operands to float32, so decode attention against a bfloat16 cache
converts the whole cache at every step, and it widens a bfloat16 scatter (the step's cache write) the same way.
`feynrl_jax.models.cache_dtype` therefore gives a bfloat16 model a float32 cache on a CPU (holding bfloat16-rounded
values) where the decode step's products run on XLA. Where they run on oneDNN the cache stays bfloat16: attention's
products read it on the bf16 instructions, and the kernel writes it in place (`onednn.cache_write`). This script
measures the caches in one process, their dispatches alternating: the bfloat16 cache as `forward` writes it, the same
cache written by XLA's scatter instead (`.at[...].set`, the write before `onednn.cache_write`), and the float32 one.

Model: SmolLM2-135M's shapes with random weights (`init_params`), `param_dtype = compute_dtype = "bfloat16"`,
`cpu_matmul="auto"` (oneDNN products where the kernel is built, as a run gets), per-layer params and a per-layer
cache (the engine's layout, `unstack_layers`, `KVCache.unstack`). `--batch` rows, each at its own position spread
over the first `--live-len` positions of a `--cache-len` cache (continuous batching), run the engine's jitted decode
dispatch (`decode_dispatch`, `--dispatch-steps` steps in one `lax.scan`, sampling at temperature 1, the state
donated). The first round compiles and is not timed; the median of `--repeats` rounds is reported per step.

`--engine`: instead, the native engine's whole generation (`NativeEngine.generate`: prefill, the prompts' keys and
values inserted into slots, decode dispatches, the narrowed tail) of SmolLM2-135M-Instruct (`bench_rollout.py`'s
32 chat prompts, 128 new tokens at T=1, its weights, `cpu_matmul="auto"`), with the bfloat16 cache (`cache_dtype`)
and with a float32 one (`cache_dtype` replaced while that engine is built and generates), the two engines taking
turns, `--repeats` rounds after one that compiles; tokens per second, median.

Run:
    python benchmarks/bench_decode_cache_dtype.py --batch 32 --cache-len 256 --dispatch-steps 16
    python benchmarks/bench_decode_cache_dtype.py --engine --repeats 3
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
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

import feynrl_jax.models.decoder as decoder  # noqa: E402
from feynrl_jax.kernels import onednn  # noqa: E402
from feynrl_jax.models import ModelConfig, cache_dtype, init_cache, init_params, unstack_layers  # noqa: E402
from feynrl_jax.rollout.decode import decode_dispatch  # noqa: E402


@contextlib.contextmanager
def scatter_writes():
    """`forward`'s bfloat16 cache writes (`decoder.write_cache`) by XLA's scatter (`.at[...].set`, mode "drop")
    instead of the kernel, for the programs traced within."""
    kernel_write = decoder.write_cache

    def scatter(cache, update, positions, *, keys, config, rows=None, layer=None):
        return decoder._scatter_cache(cache, update, positions, keys=keys, rows=rows, layer=layer)

    decoder.write_cache = scatter
    try:
        yield
    finally:
        decoder.write_cache = kernel_write


@contextlib.contextmanager
def float32_cache():
    """`decoder.cache_dtype` giving float32 (the cache before the bfloat16 one) while an engine is built and runs."""
    chosen = decoder.cache_dtype
    decoder.cache_dtype = lambda config: jnp.dtype(jnp.float32)
    try:
        yield
    finally:
        decoder.cache_dtype = chosen


def engine_rounds(repeats: int) -> None:
    """`--engine`: the native engine's generation with each cache, the engines taking turns (see the module doc)."""
    from bench_model_fwd_bwd import model_folder
    from bench_rollout import chat_prompts

    from feynrl_jax.checkpoints import load_hf, load_tokenizer
    from feynrl_jax.rollout import NativeEngine, SamplingParams

    folder = model_folder()
    params, config = load_hf(folder)
    config = dataclasses.replace(config, param_dtype="bfloat16", compute_dtype="bfloat16", cpu_matmul="auto")
    prompts = chat_prompts(load_tokenizer(folder), 32)
    cache_len = max(map(len, prompts)) + 128
    contexts = {"bfloat16 cache (cache_dtype)": contextlib.nullcontext, "float32 cache": float32_cache}
    engines = {}
    for name, context in contexts.items():
        with context():
            engines[name] = NativeEngine(config, params, num_slots=32, cache_len=cache_len)
    rates = {name: [] for name in engines}
    for repeat in range(repeats + 1):  # the first round compiles
        for name, engine in engines.items():
            with contexts[name]():
                start = time.perf_counter()
                rollouts = engine.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=128, seed=repeat))
                seconds = time.perf_counter() - start
            if repeat:
                rates[name].append(float(rollouts.completion_mask.sum()) / seconds)
    held = {name: engine._state.cache.k[0].dtype.name for name, engine in engines.items()}
    print(f"{folder}: bfloat16, 32 prompts, 128 new tokens, T=1; caches held: {held}")
    medians = {name: float(np.median(r)) for name, r in rates.items()}
    for name, median in medians.items():
        print(f"  {name}: {median:.1f} tokens/s (median of {repeats})")
    (narrow, narrow_rate), (wide, wide_rate) = medians.items()
    print(f"  {narrow} / {wide}: {narrow_rate / wide_rate:.2f}x the tokens/s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--cache-len", type=int, default=256)
    parser.add_argument("--live-len", type=int, default=192, help="rows sit at positions below this")
    parser.add_argument("--dispatch-steps", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--engine", action="store_true", help="the native engine's whole generation instead")
    args = parser.parse_args()
    if args.engine:
        return engine_rounds(args.repeats)

    shapes = {"model_type": "llama", **SMOLLM2_135M_SHAPES}
    config = ModelConfig.from_hf(shapes, param_dtype="bfloat16", compute_dtype="bfloat16", cpu_matmul="auto")
    params = unstack_layers(init_params(config, jax.random.key(0)))
    batch, steps = args.batch, args.dispatch_steps
    positions = np.linspace(0, args.live_len - steps, batch).astype(np.int32)  # fresh arrays: dispatch donates

    def dispatch():  # a jit of its own per variant: each traces (and keeps) its own program
        step = functools.partial(decode_dispatch, config=config, steps=steps, greedy=False, top_k=0, use_top_p=False)
        return jax.jit(step, donate_argnums=1)

    sampling = (jnp.zeros((0,), jnp.int32), jnp.float32(1.0), jnp.float32(1.0), jnp.int32(0))

    def state(dtype):
        cache = jax.tree.map(lambda a: a.astype(dtype), init_cache(config, batch, args.cache_len)).unstack()
        return decode_state(cache, positions, args.cache_len)

    variants = {  # name: (dispatch, state, the context its program is traced in)
        "bfloat16 cache": (dispatch(), state(jnp.bfloat16), contextlib.nullcontext),
        "bfloat16 cache, XLA's scatter": (dispatch(), state(jnp.bfloat16), scatter_writes),
        "float32 cache": (dispatch(), state(jnp.float32), contextlib.nullcontext),
    }
    times = {name: [] for name in variants}
    for repeat in range(args.repeats + 1):  # the first round compiles
        for name, (run, run_state, tracing) in variants.items():
            start = time.perf_counter()
            with tracing() if repeat == 0 else contextlib.nullcontext():
                run_state, tokens, *_ = run(params, run_state._replace(positions=jnp.asarray(positions)), *sampling)
            jax.block_until_ready((run_state, tokens))
            variants[name] = (run, run_state, tracing)
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
    wide_s = medians["float32 cache"]
    for name in ("bfloat16 cache", "bfloat16 cache, XLA's scatter"):
        print(f"  {name} against the float32 cache: {wide_s / medians[name]:.2f}x faster")


if __name__ == "__main__":
    main()
