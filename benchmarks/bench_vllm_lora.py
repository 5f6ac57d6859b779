"""vLLM serving a LoRA policy against a fully fine-tuned one: the weight sync of an RL step, and decoding.

Model: the SmolLM2-135M architecture (random weights, which cost the same as real ones), float32, the engine set-up
of an RL rollout worker (`VLLMEngine` in this process, started without weights, `load_format="dummy"`). Three
sides, each in a fresh process of this script, one after the other, on the same prompts:

- full: the engine takes every version as Hugging Face tensors (`load_weights`, what a full fine-tuning run sends);
- merge and adapter: a LoRA policy (rank `--rank` on all seven projections); the engine holds the base and takes
  every version as the adapters alone (`load_adapter_weights`, PEFT tensors), either merging them into its copy of
  the base and loading plain weights (`lora_mode="merge"`), or writing them to /dev/shm as vLLM's LoRA adapter,
  applied unmerged (`lora_mode="adapter"`).

Reported per side: bytes and seconds of one weight sync (median of `--syncs`, each a new version), and decode
throughput (`generate` of `--prompts` prompts x `--n` samples of `--new-tokens` tokens, median of `--repeats`),
the LoRA sides with their adapter applied. Ratios are full / LoRA side (decode: LoRA side / full).

Run:
    VLLM_CPU_KVCACHE_SPACE=1 python benchmarks/bench_vllm_lora.py --rank 16 --json runs/bench_vllm_lora.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from bench_lora import SMOLLM2_135M  # noqa: E402  (this folder; the one SmolLM2-135M architecture of the benchmarks)

SIDES = ("full", "merge", "adapter")


def run_side(args: argparse.Namespace) -> dict:
    """One side, in this process."""
    import jax
    import numpy as np

    from feynrl_jax.checkpoints import export_hf, load_tokenizer, smollm2_checkpoint_dir
    from feynrl_jax.checkpoints.hf_names import hf_tensors
    from feynrl_jax.checkpoints.peft_adapters import peft_tensors
    from feynrl_jax.models import ModelConfig, init_params, lora
    from feynrl_jax.models.config import LORA_TARGETS
    from feynrl_jax.rollout.types import SamplingParams
    from feynrl_jax.rollout.vllm_engine import VLLMEngine

    use_lora = args.side != "full"
    config = ModelConfig(
        **SMOLLM2_135M,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
        **(dict(lora_rank=args.rank, lora_alpha=2.0 * args.rank, lora_targets=LORA_TARGETS) if use_lora else {}),
    )
    params = jax.tree.map(np.asarray, init_params(config, jax.random.key(0)))
    with tempfile.TemporaryDirectory() as tmp:
        folder = export_hf(None, config, os.path.join(tmp, "engine_model"))
        load_tokenizer(smollm2_checkpoint_dir()).save_pretrained(folder)
        engine = VLLMEngine(
            folder,
            dtype="float32",
            max_model_len=512,
            max_num_seqs=args.prompts * args.n,
            enforce_eager=True,
            in_process=True,
            lora_config=config if use_lora else None,
            lora_mode=args.side if use_lora else "merge",
            engine_kwargs={"load_format": "dummy"},
        )
        rng = np.random.default_rng(0)
        if use_lora:
            engine.load_weights(dict(hf_tensors(lora.base_params(params), config.without_lora(), np.float32)), 0)
        seconds, nbytes = [], 0
        for version in range(1, args.syncs + 1):
            if use_lora:  # a new version: new adapters (trained-looking, B != 0)
                for target in config.lora_targets:
                    b = params["layers"][target]["lora_b"]
                    params["layers"][target]["lora_b"] = (0.01 * rng.standard_normal(b.shape)).astype(np.float32)
                tensors = peft_tensors(params, config)
                start = time.perf_counter()
                engine.load_adapter_weights(tensors, version)
            else:
                params["final_norm"]["scale"] = params["final_norm"]["scale"] + np.float32(1e-3)
                tensors = dict(hf_tensors(params, config, np.float32))
                start = time.perf_counter()
                engine.load_weights(tensors, version)
            seconds.append(time.perf_counter() - start)
            nbytes = sum(t.nbytes for t in tensors.values())
        prompts = [list(rng.integers(3, 49152, size=args.prompt_len)) for _ in range(args.prompts)]
        sampling = SamplingParams(
            n=args.n, temperature=1.0, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens
        )
        engine.generate(prompts, sampling)  # warm-up
        rates = []
        for _ in range(args.repeats):
            engine.generate(prompts, sampling)
            rates.append(engine.last_stats["tokens_per_second"])
        engine.close()
    return {
        "side": args.side,
        "sync_bytes": int(nbytes),
        "sync_seconds": statistics.median(seconds),
        "decode_tokens_per_second": statistics.median(rates),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--syncs", type=int, default=3, help="weight syncs timed per side")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--n", type=int, default=8, help="samples per prompt")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2, help="timed generate calls per side")
    parser.add_argument("--side", choices=SIDES, help=argparse.SUPPRESS)  # one side, in this process
    parser.add_argument("--json", default="")
    args = parser.parse_args()
    if args.side:
        print(json.dumps(run_side(args)))
        return
    sides = {}
    for side in SIDES:
        argv = [sys.executable, os.path.abspath(__file__), *sys.argv[1:], "--side", side]
        argv = [a for i, a in enumerate(argv) if not (a == "--json" or (i and argv[i - 1] == "--json"))]
        out = subprocess.run(argv, check=True, capture_output=True, text=True, env={**os.environ})
        sides[side] = json.loads(out.stdout.strip().splitlines()[-1])
        print(json.dumps(sides[side]), flush=True)
    full = sides["full"]
    result = {"model": "SmolLM2-135M architecture, float32", "rank": args.rank, **sides}
    for side in SIDES[1:]:
        result[f"{side}_sync_bytes_ratio"] = full["sync_bytes"] / sides[side]["sync_bytes"]
        result[f"{side}_sync_seconds_ratio"] = full["sync_seconds"] / sides[side]["sync_seconds"]
        result[f"{side}_decode_over_full"] = sides[side]["decode_tokens_per_second"] / full["decode_tokens_per_second"]
    print(json.dumps(result, indent=1))
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
