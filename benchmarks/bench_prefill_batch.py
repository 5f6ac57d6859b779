"""The native engine's batched prefill (`NativeEngine(prefill_batch=4)`, the default) against one prompt at a time
(`prefill_batch=1`), side by side in one process.

The demo's model (SmolLM2-135M-Instruct, `configs/grpo_demo.py`, float32) and its held-out prompts (chat-rendered,
about 30 tokens), two engines of 32 slots and 8 decode steps per dispatch that differ in `prefill_batch` only, each
warmed up by one call of each leg first, then taking turns for `--rounds` rounds on:
  - `evaluation`: the demo's evaluation, 64 prompts, one greedy sample each, 16 new tokens (the trainer's
    evaluation engine, `eval.*`): 32 new prompts enter the slots at a time;
  - `rollout`: a demo rollout's shape, 8 prompts, 8 samples each at temperature 1, 16 new tokens (32 slots hold 4
    prompts' samples at a time). With several samples per prompt the engine prefills one prompt at a time
    (`PREFILL_BATCH` says why), so this leg is the control: both sides run the same programs. Before that rule it
    measured 3.10 s batched against 3.38 s (1.09x).
Reports per leg and side the median seconds of a `generate` call and the prefill calls it made, the ratio one at a
time / batched, and how many completions differ between the sides (a batched prefill's matrix products round
differently in the last bits: a near-tie may go the other way).

    python benchmarks/bench_prefill_batch.py          # 5 rounds, about 3 minutes on 2 cores
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", default="", help="also write the results here")
    args = parser.parse_args()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    sys.path.insert(0, os.path.join(ROOT, "configs"))
    import grpo_demo

    from feynrl_jax.eval.evaluate import load_eval_set, sampling_from_config
    from feynrl_jax.rollout.native_engine import NativeEngine
    from feynrl_jax.rollout.types import SamplingParams
    from feynrl_jax.train import run_setup
    from feynrl_jax.train.sft_loop import train_prompts

    config = grpo_demo.get_config()
    with tempfile.TemporaryDirectory() as run_dir:
        source = run_setup.resolve_model_source(config.model, run_dir)
        tokenizer = run_setup.load_run_tokenizer(source)
        model_config = run_setup.model_config(config.model, source, tokenizer)
        params = run_setup.load_params(model_config, source, seed=config.seed)
    eval_set = load_eval_set(config, tokenizer, exclude_prompts=train_prompts(config))
    prompts = [list(p) for p in eval_set.prompt_ids]
    greedy = dataclasses.replace(sampling_from_config(config, tokenizer), n=1)  # the demo's eval: greedy, 16 tokens
    sampled = SamplingParams(temperature=1.0, max_new_tokens=16, n=8, stop_token_ids=greedy.stop_token_ids, seed=0)
    legs = {"evaluation": (prompts, greedy), "rollout": (prompts[:8], sampled)}
    cache_len = max(len(p) for p in prompts) + 16
    engines = {
        side: NativeEngine(
            model_config, params, num_slots=32, cache_len=cache_len, decode_steps_per_dispatch=8, prefill_batch=size
        )
        for side, size in (("batched", 4), ("one_at_a_time", 1))
    }
    outputs: dict[tuple[str, str], object] = {}
    for engine in engines.values():  # compiles
        for leg_prompts, sampling in legs.values():
            engine.generate(leg_prompts, sampling)
    seconds: dict[tuple[str, str], list[float]] = {}
    calls: dict[tuple[str, str], float] = {}
    differing: dict[str, list[int]] = {leg: [] for leg in legs}
    for round_ in range(args.rounds):
        for leg, (leg_prompts, sampling) in legs.items():
            sides = list(engines) if round_ % 2 == 0 else list(engines)[::-1]
            for side in sides:
                seed_sampling = dataclasses.replace(sampling, seed=round_)
                t0 = time.perf_counter()
                out = engines[side].generate(leg_prompts, seed_sampling)
                seconds.setdefault((leg, side), []).append(time.perf_counter() - t0)
                calls[(leg, side)] = engines[side].last_stats["prefill_calls"]
                outputs[(leg, side)] = out
            differ = int(
                (outputs[(leg, "batched")].completion_ids != outputs[(leg, "one_at_a_time")].completion_ids)
                .any(axis=1)
                .sum()
            )
            differing[leg].append(differ)
            print(
                f"round {round_ + 1}, {leg}: "
                + ", ".join(f"{side} {seconds[(leg, side)][-1]:.2f} s" for side in engines)
                + f", {differ} completions differ",
                flush=True,
            )
    summary = {}
    for leg in legs:
        medians = {side: statistics.median(seconds[(leg, side)]) for side in engines}
        summary[leg] = {
            "seconds": medians,
            "prefill_calls": {side: calls[(leg, side)] for side in engines},
            "one_at_a_time_over_batched": medians["one_at_a_time"] / medians["batched"],
            "rows": len(legs[leg][0]) * legs[leg][1].n,
            "completions_that_differ_per_round": differing[leg],
        }
        print(
            f"{leg:10s}: batched {medians['batched']:.2f} s ({calls[(leg, 'batched')]:.0f} prefill calls), one at a "
            f"time {medians['one_at_a_time']:.2f} s ({calls[(leg, 'one_at_a_time')]:.0f}): "
            f"{summary[leg]['one_at_a_time_over_batched']:.2f}x"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"settings": vars(args), "legs": summary}, f, indent=1)


if __name__ == "__main__":
    main()
