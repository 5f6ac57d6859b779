"""LoRA and QLoRA against full fine-tuning on one model, side by side in one process: memory, weight-sync bytes,
step time.

Model: the SmolLM2-135M architecture (30 layers, D=576, F=1536, 9 heads, tied embeddings; random weights, which
cost the same as real ones), float32, adapters of rank `--rank` on all seven projections; the QLoRA side also stores
the base's projection kernels in NF4 (`model.lora.quantize_base="nf4"`, `feynrl_jax.models.quant`). Every side
builds the real train step (`make_algorithm_train_step`, GRPO loss with a KL term, AdamW) on one device and
reports:

- train state bytes (params + optimizer state), from the arrays the step holds;
- reference model bytes: full fine-tuning keeps a copy of the initial weights; a LoRA run's reference is the
  policy's own base (`lora.base_params(state.params)`), so the extra bytes are those of arrays not shared with
  the state (by buffer address: 0 when no copy exists);
- bytes one weight sync carries (what the trainer publishes: all params vs the adapters alone, in param_dtype);
- train step seconds on the same batch (median of `--steps` after a compile step).

Run:
    python benchmarks/bench_lora.py --rank 16 --batch 8 --seq 128 --steps 3 --json runs/bench_lora.json

Prints one JSON object with every side and the ratios (full / LoRA, full / QLoRA).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import time

import jax
import numpy as np

from feynrl_jax.losses import ALGORITHMS, TrainBatch
from feynrl_jax.models import ModelConfig, init_params, lora
from feynrl_jax.models.config import LORA_TARGETS
from feynrl_jax.sharding import RULES, make_mesh
from feynrl_jax.train.optimizer import make_optimizer
from feynrl_jax.train.step import make_algorithm_train_step

SMOLLM2_135M = dict(
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_layers=30,
    num_heads=9,
    num_kv_heads=3,
    head_dim=64,
    tie_word_embeddings=True,
    rope_theta=100000.0,
)


def tree_bytes(tree) -> int:
    return int(sum(leaf.nbytes for leaf in jax.tree.leaves(tree)))


def buffer_addresses(tree) -> set[int]:
    return {leaf.unsafe_buffer_pointer() for leaf in jax.tree.leaves(tree)}


def make_batch(config: ModelConfig, batch: int, seq: int) -> TrainBatch:
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, config.vocab_size, (batch, seq)).astype(np.int32)
    positions = np.broadcast_to(np.arange(seq, dtype=np.int32), (batch, seq)).copy()
    segments = np.ones((batch, seq), np.int32)
    mask = (np.arange(seq)[None, :] >= seq // 2).astype(np.float32).repeat(batch, 0)
    advantages = rng.standard_normal((batch, 1)).astype(np.float32) * mask
    old = np.full((batch, seq), -np.log(config.vocab_size), np.float32) * mask
    return TrainBatch(tokens, positions, segments, mask, advantages, old, ref_logprobs=old.copy())


def measure(config: ModelConfig, batch: TrainBatch, steps: int) -> dict[str, float]:
    mesh = make_mesh(1, 1, 1, devices=jax.devices()[:1])
    optimizer, _ = make_optimizer(1e-5, warmup_steps=0, total_steps=100, schedule="constant")
    step = make_algorithm_train_step(
        ALGORITHMS["grpo"],
        optimizer,
        mesh,
        RULES["dp"],
        config=config,
        hyperparameters={"kl_coef": 0.05},
        check_updated=False,  # as the runs build it on make_optimizer's AdamW
    )
    state = step.init_state(init_params(config, jax.random.key(0)))
    if config.lora_rank:
        reference = lora.base_params(state.params)  # no copy: the state's frozen arrays
    else:
        reference = jax.tree.map(lambda p: p.copy(), state.params)  # what a full fine-tuning run must keep
    shared = buffer_addresses(state.params)
    reference_extra = sum(
        leaf.nbytes for leaf in jax.tree.leaves(reference) if leaf.unsafe_buffer_pointer() not in shared
    )
    published = lora.adapters_of(state.params) if config.lora_rank else state.params
    placed = step.place_batch(batch)
    t0 = time.perf_counter()
    state, metrics = step(state, placed)
    jax.block_until_ready(metrics)
    compile_s = time.perf_counter() - t0
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        state, metrics = step(state, placed)
        jax.block_until_ready(metrics)
        times.append(time.perf_counter() - t0)
    return {
        "params_bytes": tree_bytes(state.params),
        "trained_params_bytes": tree_bytes(step.params_spec.trained(state.params)),
        "optimizer_bytes": tree_bytes(state.opt_state),
        "state_bytes": tree_bytes(state.params) + tree_bytes(state.opt_state),
        "reference_extra_bytes": int(reference_extra),
        "sync_bytes": tree_bytes(published),
        "step_seconds": statistics.median(times),
        "first_step_seconds": compile_s,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--alpha", type=float, default=32.0)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--json", default="")
    args = parser.parse_args()

    base = ModelConfig(**SMOLLM2_135M)
    adapted = ModelConfig(**SMOLLM2_135M, lora_rank=args.rank, lora_alpha=args.alpha, lora_targets=LORA_TARGETS)
    batch = make_batch(base, args.batch, args.seq)
    full = measure(base, batch, args.steps)
    lora_side = measure(adapted, batch, args.steps)
    qlora_side = measure(dataclasses.replace(adapted, base_quantization="nf4"), batch, args.steps)
    ratio = lambda key, side=lora_side: full[key] / max(side[key], 1)  # noqa: E731
    result = {
        "model": "SmolLM2-135M architecture (random weights), float32",
        "rank": args.rank,
        "batch": [args.batch, args.seq],
        "cpu": os.popen("lscpu | grep 'Model name' | cut -d: -f2").read().strip(),
        "full": full,
        "lora": lora_side,
        "ratio_state_bytes": ratio("state_bytes"),
        "ratio_optimizer_bytes": ratio("optimizer_bytes"),
        "ratio_sync_bytes": ratio("sync_bytes"),
        "reference_extra_bytes": {"full": full["reference_extra_bytes"], "lora": lora_side["reference_extra_bytes"]},
        "ratio_step_seconds": full["step_seconds"] / lora_side["step_seconds"],
        "qlora": qlora_side,
        "qlora_ratio_params_bytes": ratio("params_bytes", qlora_side),
        "qlora_ratio_state_bytes": ratio("state_bytes", qlora_side),
        "qlora_ratio_step_seconds": full["step_seconds"] / qlora_side["step_seconds"],
    }
    text = json.dumps(result, indent=2)
    print(text)
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
