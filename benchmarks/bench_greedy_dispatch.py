"""What a greedy evaluation costs after sampled rollouts on one native engine: `greedy` static (a decode program of
its own) against `greedy` traced (`NativeEngine(traced_greedy=True)`: the rollouts' programs, a `lax.cond` picking
the branch), side by side.

The native engine's decode dispatch takes `greedy` as a static argument, so an engine that serves a run's held-out
evaluation (greedy) and its rollouts (sampled) compiles decode programs for each, though both have the same shapes
(the engine's slots). With `traced_greedy` (a colocated run's engine, `rollout.colocate`) `greedy` is traced
(`rollout/native_engine.py`, `_decode_inputs`; `sampling.sample`).

Each side runs in a fresh process (JAX's persistent cache off), the two alternating for `--rounds`, on an engine
of the demo's shape (SmolLM2-135M's architecture with random weights, 32 slots, an 80-position cache, 8 decode
steps per dispatch) and times, in order: a sampled generation (4 prompts x 8 samples x 16 new tokens, temperature
1: the demo's rollout), then a greedy one (64 prompts x 16 new tokens: the demo's evaluation), each the first time
(compiling what it needs) and again (run only); it counts the decode programs compiled, and checks that both sides
return the same tokens. With `--greedy-alone`, only the greedy generation: an engine that only evaluates, as a
trainer's evaluation engine does when a rollout worker generates (there the traced program, which holds both
branches, only costs its larger compile).

    python benchmarks/bench_greedy_dispatch.py --rounds 3
    python benchmarks/bench_greedy_dispatch.py --rounds 3 --greedy-alone
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

from bench_report import alternate_sides

SIDES = ("static", "traced")


def measure(side: str, greedy_alone: bool) -> dict:
    os.environ.update(JAX_PLATFORMS="cpu", JAX_ENABLE_COMPILATION_CACHE="false")
    import jax
    import numpy as np

    from feynrl_jax.checkpoints import smollm2_checkpoint_dir
    from feynrl_jax.compile_clock import compile_clock
    from feynrl_jax.models import ModelConfig, init_params
    from feynrl_jax.rollout import native_engine
    from feynrl_jax.rollout.types import SamplingParams

    config = ModelConfig.from_hf(smollm2_checkpoint_dir())
    params = jax.block_until_ready(jax.jit(init_params, static_argnums=0)(config, jax.random.PRNGKey(0)))
    engine = native_engine.NativeEngine(
        config, params, num_slots=32, cache_len=80, decode_steps_per_dispatch=8, traced_greedy=side == "traced"
    )
    rng = np.random.default_rng(0)
    prompt = lambda: rng.integers(10, config.vocab_size, size=int(rng.integers(40, 56))).tolist()  # noqa: E731
    rollout_prompts, eval_prompts = [prompt() for _ in range(4)], [prompt() for _ in range(64)]
    requests = {
        "sampled": (rollout_prompts, SamplingParams(n=8, max_new_tokens=16, temperature=1.0, seed=1)),
        "greedy": (eval_prompts, SamplingParams(greedy=True, max_new_tokens=16)),
    }
    if greedy_alone:  # an engine that only evaluates (a rollout worker's run: the trainer's evaluation engine)
        del requests["sampled"]
    clock = compile_clock()
    out, digest = {}, 0
    for name, (prompts, sampling) in requests.items():
        before = len(clock.names())
        t0 = time.perf_counter()
        rollouts = engine.generate(prompts, sampling)
        out[f"{name}_first_seconds"] = time.perf_counter() - t0
        out[f"{name}_dispatch_programs"] = clock.names()[before:].count("jit(dispatch)")
        t0 = time.perf_counter()
        engine.generate(prompts, sampling)
        out[f"{name}_later_seconds"] = time.perf_counter() - t0
        digest = (digest * 31 + int(np.asarray(rollouts.completion_ids, np.int64).sum())) % (1 << 61)
    return out | {"tokens_digest": digest}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--greedy-alone", action="store_true", help="only the greedy generation (an engine that only evaluates)"
    )
    parser.add_argument("--json", help="write the summary here")
    parser.add_argument("--side", choices=SIDES, help=argparse.SUPPRESS)  # a child's side
    args = parser.parse_args()
    if args.side:
        print(json.dumps(measure(args.side, args.greedy_alone)))
        return
    results = alternate_sides(__file__, SIDES, args.rounds, ["--greedy-alone"] if args.greedy_alone else [])
    digests = {r["tokens_digest"] for side in SIDES for r in results[side]}
    if len(digests) != 1:
        raise SystemExit(f"the two sides' tokens differ: {digests}")
    summary = {"rounds": args.rounds, "greedy_alone": args.greedy_alone}
    for side in SIDES:
        keys = [k for k in results[side][0] if k.endswith("_seconds")]
        summary[side] = {f"{k}_median": statistics.median(r[k] for r in results[side]) for k in keys}
        summary[side] |= {k: results[side][0][k] for k in results[side][0] if k.endswith("_programs")}
    for key in ("sampled_first_seconds", "greedy_first_seconds", "sampled_later_seconds", "greedy_later_seconds"):
        if f"{key}_median" in summary["traced"]:
            summary[f"{key}_static_over_traced"] = (
                summary["static"][f"{key}_median"] / summary["traced"][f"{key}_median"]
            )
    print(json.dumps(summary, indent=1))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(summary, f, indent=1)


if __name__ == "__main__":
    main()
