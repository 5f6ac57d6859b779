"""What the native engine's start costs: programs over every layer against one program per layer, side by side.

XLA:CPU compiles a kernel of its own for every array a program writes. The engine once had programs over all of
SmolLM2-135M's 30 layers that it compiled at the start of every run: splitting the trainer's stacked weights into
per-layer arrays (`unstack_layers`) and writing a prompt's KV into a slot of every layer's cache. Now each is one
program that serves every layer (the layer index traced) and runs once per layer, beside a small program for the
rest: the weights outside the layers, the slot's fields. Freeing slots took the whole state, cache included, through
the sharding constraint a sharded engine has; now it takes the state without its cache (`rollout/native_engine.py`).

Each side runs in a fresh process (nothing compiled is shared), the two sides alternating for `--rounds`, and
times each operation's first call (compile and run) and a later call (run only), float32 random weights:
  - split: the stacked weights into 30 per-layer dicts, and the rest in the params' dtype; split_host: the same
    from numpy arrays, as a rollout worker receives the published weights at every weight load;
  - insert: a 64-position prompt KV into one of 32 slots of a 256-position cache, every layer, and the slot's fields;
  - free: slots marked inactive, under a sharding constraint on a one-device mesh (as a sharded engine's).
With `--generate`, the current engine's first and second `generate` (4 prompts x 8 samples x 16 new tokens, the
demo's shape) are timed too: what is left of its start is compiling prefill and the decode dispatch.

    python benchmarks/bench_engine_start.py --rounds 3 --generate
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import time

from bench_report import alternate_sides

SIDES = ("all_layers", "per_layer")


def measure(side: str, generate: bool) -> dict[str, float]:
    """The first and a later call of each operation, in this process."""
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax
    import jax.numpy as jnp
    import numpy as np

    from feynrl_jax.checkpoints import smollm2_checkpoint_dir
    from feynrl_jax.models import KVCache, ModelConfig, as_param_dtype, init_params, unstack_layers
    from feynrl_jax.rollout import slots as slots_lib

    config = ModelConfig.from_hf(smollm2_checkpoint_dir())
    params = jax.block_until_ready(jax.jit(init_params, static_argnums=0)(config, jax.random.PRNGKey(0)))
    host_params = jax.tree.map(np.asarray, params)  # as a rollout worker receives them
    layers = config.num_layers
    state = jax.block_until_ready(jax.jit(slots_lib.init_state, static_argnums=(0, 1, 2))(config, 32, 256))
    prefix = KVCache(
        k=jnp.ones((layers, 1, config.num_kv_heads, config.head_dim, 64)),
        v=jnp.ones((layers, 1, config.num_kv_heads, 64, config.head_dim)),
    )
    done = jnp.ones((32,), bool)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("tensor",))
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())

    def constrain(tree):
        return jax.tree.map(lambda a: jax.lax.with_sharding_constraint(a, replicated), tree)

    indices = [jnp.int32(i) for i in range(layers)]
    slot, row = jnp.int32(3), jnp.int32(0)
    fields_args = (jnp.int32(7), jnp.int32(50), jnp.int32(16), jnp.zeros((2,), jnp.uint32))

    if side == "all_layers":
        split_all = jax.jit(lambda p: unstack_layers(as_param_dtype(p, config)))

        def insert_all_layers(state, prefix, slot, *fields_args):
            def put(arrays, new):
                return tuple(
                    jax.lax.dynamic_update_slice(a, n.astype(a.dtype), (slot, 0, 0, 0))
                    for a, n in zip(arrays, new, strict=True)
                )

            cache = KVCache(k=put(state.cache.k, prefix.k), v=put(state.cache.v, prefix.v))
            return slots_lib.insert(state._replace(cache=cache), slot, *fields_args)

        insert_all = jax.jit(insert_all_layers, donate_argnums=0)
        free_all = jax.jit(lambda state, done: constrain(slots_lib.deactivate(state, done)), donate_argnums=0)
        ops = {
            "split": lambda: split_all(params),
            "split_host": lambda: split_all(host_params),
            "insert": lambda state: insert_all(state, prefix, slot, *fields_args),
            "free": lambda state: free_all(state, done),
        }
    else:
        layer_of = jax.jit(
            lambda stacked, index: as_param_dtype(
                jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, index, keepdims=False), stacked), config
            )
        )
        in_param_dtype = jax.jit(lambda rest: as_param_dtype(rest, config))
        insert_prefix = jax.jit(functools.partial(slots_lib.insert_prefix, config=config), donate_argnums=(0, 1))
        insert_fields = jax.jit(slots_lib.insert, donate_argnums=0)
        free_fields = jax.jit(lambda fields, done: constrain(slots_lib.deactivate(fields, done)), donate_argnums=0)

        def insert_per_layer(state):
            ks, vs = list(state.cache.k), list(state.cache.v)
            for layer, index in enumerate(indices):
                ks[layer], vs[layer] = insert_prefix(ks[layer], vs[layer], prefix, index, slot, row)
            fields = insert_fields(state._replace(cache=None), slot, *fields_args)
            return fields._replace(cache=KVCache(k=tuple(ks), v=tuple(vs)))

        def split_per_layer(params):
            params = jax.tree.map(lambda a: a if isinstance(a, jax.Array) else jax.device_put(a), params)
            rest = in_param_dtype({key: value for key, value in params.items() if key != "layers"})
            return rest, tuple(layer_of(params["layers"], index) for index in indices)

        ops = {
            "split": lambda: split_per_layer(params),
            "split_host": lambda: split_per_layer(host_params),
            "insert": insert_per_layer,
            "free": lambda state: free_fields(state._replace(cache=None), done)._replace(cache=state.cache),
        }

    result = {}
    for name in ("split", "split_host", "insert", "free"):
        for call in ("first", "later"):
            start = time.perf_counter()
            if name.startswith("split"):
                out = ops[name]()
            else:
                out = state = ops[name](state)
            jax.block_until_ready(out)
            result[f"{name}_{call}_s"] = time.perf_counter() - start
            del out
    if generate and side == "per_layer":
        from feynrl_jax.rollout.native_engine import NativeEngine
        from feynrl_jax.rollout.types import SamplingParams

        start = time.perf_counter()
        engine = NativeEngine(config, params, num_slots=32, cache_len=80, decode_steps_per_dispatch=8)
        result["engine_build_s"] = time.perf_counter() - start
        rng = np.random.default_rng(0)
        for call in ("first", "later"):
            prompts = [rng.integers(0, 1000, size=int(rng.integers(35, 50))).tolist() for _ in range(4)]
            start = time.perf_counter()
            engine.generate(prompts, SamplingParams(n=8, max_new_tokens=16, temperature=1.0, seed=0))
            result[f"generate_{call}_s"] = time.perf_counter() - start
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--generate", action="store_true", help="also time the engine's first and second generate")
    parser.add_argument("--side", choices=SIDES, help=argparse.SUPPRESS)  # one side, in this process
    args = parser.parse_args()
    if args.side:
        print(json.dumps(measure(args.side, args.generate)))
        return

    # No persistent compilation cache: every round compiles, as a first run does.
    env = dict(os.environ, JAX_ENABLE_COMPILATION_CACHE="false", JAX_COMPILATION_CACHE_DIR="")
    runs = alternate_sides(__file__, SIDES, args.rounds, ["--generate"] if args.generate else [], env=env)
    print(f"{'operation':24s} {'all layers':>12s} {'per layer':>12s} {'all / per':>10s}   (seconds, median of rounds)")
    for key in runs["all_layers"][0]:
        old = statistics.median(r[key] for r in runs["all_layers"])
        new = statistics.median(r[key] for r in runs["per_layer"])
        print(f"{key:24s} {old:12.3f} {new:12.3f} {old / new:9.1f}x")
    for key in runs["per_layer"][0]:
        if key not in runs["all_layers"][0]:
            print(f"{key:24s} {'':12s} {statistics.median(r[key] for r in runs['per_layer']):12.3f}")
    print(json.dumps(runs))


if __name__ == "__main__":
    main()
