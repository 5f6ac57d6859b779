"""Time of one batched decode step (`forward` with a KV cache, then `logits`) against the memory-bandwidth bound.

SmolLM2-135M shapes with random weights (`init_params`), float32, B slots each feeding one token (T=1) at its own
position into a cache of S positions; the step is jitted with the cache donated, as the native rollout engine
runs it. A decode step reads every weight once, so it takes at least weight bytes / copy bandwidth (a large numpy
copy, read + write counted as STREAM's Copy); the ratio says how far the step is from that bound.

Two layer layouts run side by side, their steps alternating in one process: stacked layers under `lax.scan`
(the trainer's params) and per-layer params with a per-layer cache (`unstack_layers`, `KVCache.unstack`: the
native engine's layout).

`--dispatch-steps N` also times the engine's whole decode dispatch (N steps in one `lax.scan`, greedy sampling
included) in both layouts, and in the per-layer one attending only to the power-of-two cache prefix that the
rows reach (`--live-len`), as the engine does while its sequences are shorter than the cache.

`--prefix-reads` times the engine's decode dispatch with oneDNN's products (`model.cpu_matmul="onednn"`) attending to
the cache prefix that its rows reach (`--live-len`) three ways, taking turns: reading the prefix where it lies in the
cache (`onednn.cache_dot`, what the decoder runs), copying it out first and multiplying the copy (how attention read
it before `cache_dot`: an XLA slice, then `onednn.dot`), and attending to the whole cache.

`--backends xla,onednn` also times the per-layer step with each backend of the model's products
(`model.cpu_matmul` forced, `feynrl_jax/kernels/onednn.py`) at batches `--backend-batches`, the backends taking
turns: what "auto" decides for decode steps by a measurement of their own (`onednn.auto_choice`'s `one_token`).

Run:
    python benchmarks/bench_decode_step.py --batch 32 --cache-len 256 --steps 10 [--dispatch-steps 8 --live-len 128]
    python benchmarks/bench_decode_step.py --backends xla,onednn --backend-batches 32,8 --steps 20
    python benchmarks/bench_decode_step.py --prefix-reads --batch 32 --cache-len 256 --live-len 128 --dispatch-steps 8
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import os
import time

from feynrl_jax.host_memory import reexec_with_allocator_tunables

reexec_with_allocator_tunables()  # before jax/torch allocate: both sides of every comparison run with it

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from bench_rollout import copy_bandwidth  # noqa: E402  (this folder is on sys.path when run as a script)

from feynrl_jax.checkpoints import smollm2_checkpoint_dir  # noqa: E402
from feynrl_jax.models import KVCache, ModelConfig, forward, init_params, logits, unstack_layers  # noqa: E402
from feynrl_jax.rollout.decode import decode_dispatch  # noqa: E402
from feynrl_jax.rollout.prefill import bucket_lengths, pick_bucket  # noqa: E402
from feynrl_jax.rollout.slots import DecodeState  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--cache-len", type=int, default=256)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument(
        "--dispatch-steps", type=int, default=0, help="also time the engine's decode dispatch, this many steps each"
    )
    parser.add_argument("--live-len", type=int, default=0, help="dispatch rows reach positions < this (0: S)")
    parser.add_argument("--backends", default="", help="time the per-layer step with each product backend instead")
    parser.add_argument("--backend-batches", default="32,8", help="with --backends: the batches, comma-separated")
    parser.add_argument(
        "--prefix-reads", action="store_true", help="time attention's cache prefix read in place against copied"
    )
    args = parser.parse_args()
    if args.backends:
        return time_backends(args)
    if args.prefix_reads:
        return time_prefix_reads(args)

    config = ModelConfig.from_hf(smollm2_checkpoint_dir())
    params = init_params(config, jax.random.PRNGKey(0))
    batch, cache_len = args.batch, args.cache_len
    heads = (config.num_layers, batch, config.num_kv_heads)
    key_k, key_v, key_t = jax.random.split(jax.random.PRNGKey(1), 3)
    cache = KVCache(
        k=jax.random.normal(key_k, (*heads, config.head_dim, cache_len)),
        v=jax.random.normal(key_v, (*heads, cache_len, config.head_dim)),
    )
    tokens = jax.random.randint(key_t, (batch, 1), 0, config.vocab_size)
    # Every row at its own position, spread over the cache (continuous batching).
    positions = jnp.asarray(np.linspace(0, cache_len - 1, batch).astype(np.int32)[:, None])

    def step(params, tokens, positions, cache):
        hidden, cache = forward(params, tokens, positions, config=config, cache=cache)
        return logits(params, hidden, config=config), cache

    step = jax.jit(step, donate_argnums=3)
    # The two layer layouts, timed alternately in one process: stacked layers run by lax.scan (the trainer's
    # layout) and per-layer params with a per-layer cache (the native engine's decode layout).
    layout_params = {"stacked (lax.scan)": params, "per-layer (unrolled)": unstack_layers(params)}
    caches = {"stacked (lax.scan)": cache, "per-layer (unrolled)": cache.unstack()}  # the unstacked one copies
    times = {}
    for name in layout_params:
        start = time.perf_counter()
        out, caches[name] = step(layout_params[name], tokens, positions, caches[name])
        jax.block_until_ready(out)
        print(f"{name}: compile + first step {time.perf_counter() - start:.1f} s")
        times[name] = []
    for _ in range(args.steps):
        for name in times:
            start = time.perf_counter()
            out, caches[name] = step(layout_params[name], tokens, positions, caches[name])
            jax.block_until_ready((out, caches[name]))
            times[name].append(time.perf_counter() - start)

    weight_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))
    bandwidth = copy_bandwidth(1 << 28)
    bound_s = weight_bytes / bandwidth
    print(f"SmolLM2-135M shapes ({config.num_params / 1e6:.1f}M params, random init), float32, B={batch}, T=1")
    print(f"cache length S={cache_len}, rows at positions 0..S-1")
    print(f"devices: {jax.devices()}, cpu cores: {os.cpu_count()}")
    print(
        f"bandwidth bound: weights {weight_bytes / 2**20:.0f} MiB / copy bandwidth {bandwidth / 1e9:.1f} GB/s "
        f"= {bound_s * 1e3:.1f} ms/step"
    )
    medians = {name: float(np.median(t)) for name, t in times.items()}
    for name, t in times.items():
        print(
            f"decode step, {name}: median {medians[name] * 1e3:.1f} ms, min {min(t) * 1e3:.1f} ms over "
            f"{args.steps} steps; measured / bound = {medians[name] / bound_s:.1f}x"
        )
    (stacked, stacked_s), (per_layer, per_layer_s) = medians.items()
    min_ratio = min(times[per_layer]) / min(times[stacked])
    print(f"per-layer / stacked = {per_layer_s / stacked_s:.2f} (medians), {min_ratio:.2f} (minima)")
    if args.dispatch_steps:
        live_len = args.live_len or cache_len
        time_dispatches(config, layout_params, caches, batch, cache_len, args.dispatch_steps, live_len)


def engine_attend_len(cache_len: int, live_len: int) -> int:
    """The cache prefix the native engine attends to while its rows stay below `live_len` (its power-of-two buckets
    from 128)."""
    return pick_bucket(bucket_lengths(min(128, cache_len), cache_len), live_len)


def decode_state(cache, positions: np.ndarray, cache_len: int) -> DecodeState:
    """A decode state of `len(positions)` active rows at `positions` over `cache`, every array fresh (a dispatch
    donates, and so deletes, the state it is given)."""
    batch = len(positions)
    return DecodeState(
        cache=cache,
        tokens=jnp.ones((batch,), jnp.int32),
        positions=jnp.asarray(positions),
        active=jnp.ones((batch,), bool),
        generated=jnp.zeros((batch,), jnp.int32),
        max_new=jnp.full((batch,), cache_len, jnp.int32),
        keys=jnp.zeros((batch, 2), jnp.uint32),
    )


def time_dispatches(config, layout_params, caches, batch, cache_len, steps, live_len, repeats=4):
    """The engine's jitted decode dispatch (greedy sampling included), alternating between the stacked layout,
    the per-layer one, and the per-layer one attending to the cache prefix the rows reach (as the engine does)."""
    positions = np.linspace(0, live_len - steps, batch).astype(np.int32)
    attend_len = engine_attend_len(cache_len, live_len)
    dispatch = jax.jit(
        functools.partial(decode_dispatch, config=config, steps=steps, greedy=True, top_k=0, use_top_p=False),
        static_argnames="attend_len",
        donate_argnums=1,
    )
    args = (jnp.zeros((0,), jnp.int32), jnp.float32(1.0), jnp.float32(1.0), jnp.int32(0))

    (stacked, stacked_cache), (per_layer, per_layer_cache) = caches.items()
    runs = {  # name: (params, state, attend_len)
        stacked: (layout_params[stacked], decode_state(stacked_cache, positions, cache_len), None),
        per_layer: (layout_params[per_layer], decode_state(per_layer_cache, positions, cache_len), None),
        f"{per_layer}, attend_len={attend_len}": (
            layout_params[per_layer],
            decode_state(jax.tree.map(jnp.copy, per_layer_cache), positions, cache_len),
            attend_len,
        ),
    }
    times = {name: [] for name in runs}
    for repeat in range(repeats + 1):  # the first round compiles
        for name, (params, run_state, run_attend_len) in runs.items():
            start = time.perf_counter()
            run_state, tokens, *_ = dispatch(
                params, run_state._replace(positions=jnp.asarray(positions)), *args, attend_len=run_attend_len
            )
            jax.block_until_ready((run_state, tokens))
            runs[name] = (params, run_state, run_attend_len)
            if repeat:
                times[name].append((time.perf_counter() - start) / steps)
    print(f"engine decode dispatch: {steps} steps, greedy, rows at positions 0..{live_len - 1}")
    medians = {name: float(np.median(t)) for name, t in times.items()}
    for name, median in medians.items():
        print(f"  {name}: {median * 1e3:.1f} ms/step median, / stacked = {median / medians[stacked]:.2f}")


def time_backends(args) -> None:
    """The per-layer decode step (forward + logits, float32) with each `--backends` product backend forced, the
    backends taking turns at each batch of `--backend-batches`; medians over `--steps` steps."""
    from feynrl_jax.kernels import onednn

    backends = args.backends.split(",")
    if any(b not in ("xla", "onednn") for b in backends):
        raise SystemExit(f"--backends {args.backends!r}: each one 'xla' or 'onednn'")
    if "onednn" in backends and onednn.problem():
        raise SystemExit(f"--backends onednn: {onednn.problem()}")
    config = ModelConfig.from_hf(smollm2_checkpoint_dir())
    params = unstack_layers(init_params(config, jax.random.PRNGKey(0)))
    print(f"SmolLM2-135M shapes, float32, per-layer decode step, cache length {args.cache_len}")
    for batch in [int(b) for b in args.backend_batches.split(",")]:
        heads = (config.num_layers, batch, config.num_kv_heads)
        cache = KVCache(
            k=jax.random.normal(jax.random.PRNGKey(1), (*heads, config.head_dim, args.cache_len)),
            v=jax.random.normal(jax.random.PRNGKey(2), (*heads, args.cache_len, config.head_dim)),
        )
        tokens = jax.random.randint(jax.random.PRNGKey(3), (batch, 1), 0, config.vocab_size)
        positions = jnp.asarray(np.linspace(0, args.cache_len - 1, batch).astype(np.int32)[:, None])
        runs = {}
        for backend in backends:
            ours = dataclasses.replace(config, param_dtype="float32", compute_dtype="float32", cpu_matmul=backend)

            def step(params, tokens, positions, cache, ours=ours):
                hidden, cache = forward(params, tokens, positions, config=ours, cache=cache)
                return logits(params, hidden, config=ours), cache

            runs[backend] = [jax.jit(step, donate_argnums=3), jax.tree.map(jnp.copy, cache.unstack())]
        times = {backend: [] for backend in backends}
        for repeat in range(args.steps + 1):  # the first round compiles
            for backend, run in runs.items():
                start = time.perf_counter()
                out, run[1] = run[0](params, tokens, positions, run[1])
                jax.block_until_ready((out, run[1]))
                if repeat:
                    times[backend].append(time.perf_counter() - start)
        medians = {backend: float(np.median(t)) for backend, t in times.items()}
        line = ", ".join(f"{backend} {median * 1e3:.1f} ms" for backend, median in medians.items())
        ratio = f"; xla / onednn = {medians['xla'] / medians['onednn']:.2f}" if len(medians) == 2 else ""
        print(f"  batch {batch}: {line} (medians){ratio}")


@contextlib.contextmanager
def copied_prefix():
    """While open, `onednn.cache_dot` copies the cache prefix out and multiplies the copy (`onednn.dot`), as
    attention did before it read the prefix in place: what a function traced meanwhile runs."""
    from feynrl_jax.kernels import onednn

    in_place = onednn.cache_dot

    def copied(a, cache, length, keys, out_dtype=None):
        prefix = cache[..., :length] if keys else cache[..., :length, :]
        return onednn.dot(a, prefix, False, a.dtype if out_dtype is None else out_dtype)

    onednn.cache_dot = copied
    try:
        yield
    finally:
        onednn.cache_dot = in_place


def time_prefix_reads(args, repeats: int = 6) -> None:
    """The engine's decode dispatch (greedy, `--dispatch-steps` steps, per-layer params and cache) with oneDNN's
    products, the rows below `--live-len` of a `--cache-len` cache: attending to the prefix they reach read in place,
    the same prefix copied out first, and the whole cache, taking turns; medians over `repeats` dispatches each."""
    from feynrl_jax.kernels import onednn

    if onednn.problem():
        raise SystemExit(f"--prefix-reads: {onednn.problem()}")
    config = dataclasses.replace(
        ModelConfig.from_hf(smollm2_checkpoint_dir()),
        param_dtype="float32",
        compute_dtype="float32",
        cpu_matmul="onednn",
    )
    params = unstack_layers(init_params(config, jax.random.PRNGKey(0)))
    batch, cache_len, steps = args.batch, args.cache_len, max(args.dispatch_steps, 1)
    live_len = args.live_len or cache_len // 2
    attend_len = engine_attend_len(cache_len, live_len)
    if attend_len >= cache_len:
        raise SystemExit(f"--live-len {live_len}: its bucket ({attend_len}) is the whole cache; nothing to slice")
    heads = (config.num_layers, batch, config.num_kv_heads)
    cache = KVCache(
        k=jax.random.normal(jax.random.PRNGKey(1), (*heads, config.head_dim, cache_len)),
        v=jax.random.normal(jax.random.PRNGKey(2), (*heads, cache_len, config.head_dim)),
    ).unstack()
    positions = np.linspace(0, live_len - steps, batch).astype(np.int32)
    extra = (jnp.zeros((0,), jnp.int32), jnp.float32(1.0), jnp.float32(1.0), jnp.int32(0))
    runs = {  # name: [dispatch, state, attend_len, context]
        "prefix in place": [attend_len, contextlib.nullcontext],
        "prefix copied": [attend_len, copied_prefix],
        "whole cache": [None, contextlib.nullcontext],
    }
    for name, (length, context) in runs.items():
        dispatch = jax.jit(
            functools.partial(decode_dispatch, config=config, steps=steps, greedy=True, top_k=0, use_top_p=False),
            static_argnames="attend_len",
            donate_argnums=1,
        )
        runs[name] = [dispatch, decode_state(jax.tree.map(jnp.copy, cache), positions, cache_len), length, context]
    times = {name: [] for name in runs}
    tokens = {}
    for repeat in range(repeats + 1):  # the first round compiles
        for name, run in runs.items():
            dispatch, state, length, context = run
            start = time.perf_counter()
            with context():
                state, tokens[name], *_ = dispatch(
                    params, state._replace(positions=jnp.asarray(positions)), *extra, attend_len=length
                )
                jax.block_until_ready((state, tokens[name]))
            run[1] = state
            if repeat:
                times[name].append((time.perf_counter() - start) / steps)
    same = all(np.array_equal(tokens[name], tokens["prefix in place"]) for name in tokens)
    print(f"SmolLM2-135M shapes, float32, oneDNN products, B={batch}, cache length {cache_len}")
    print(
        f"engine decode dispatch: {steps} steps, greedy, rows at positions 0..{live_len - 1}, attend_len={attend_len}"
    )
    medians = {name: float(np.median(t)) for name, t in times.items()}
    for name, median in medians.items():
        ratio = medians[name] / medians["prefix in place"]
        print(f"  {name}: {median * 1e3:.1f} ms/step median, / prefix in place = {ratio:.2f}")
    print(f"  greedy tokens the same in all three: {same}")


if __name__ == "__main__":
    main()
