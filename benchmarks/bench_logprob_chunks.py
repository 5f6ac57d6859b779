"""Memory and time of the RL update's forward and backward pass with logit chunks capped by token slots, against
chunks of all rows by columns alone (the layout before the cap), side by side in one process.

The pass is the one an RL update runs (`models.sequence_logprobs` with `first_column` at the prompts' width, so only
completions are scored, `model.remat="full"`, what "auto" picked on a CPU in float32 until 2026-12-08) on a
SmolLM2-135M-shaped model with random weights: `--rows` rows of `--prompt` prompt and `--widths` completion columns. The
two layouts:

- "columns": chunks of all rows and at most 256 columns (`chunk_tokens` unbounded);
- "capped": chunks of at most `models.logprobs.CHUNK_TOKENS` token slots (the default), at most 256 columns.

For each it prints the temporary buffers XLA plans for the compiled pass (`memory_analysis().temp_size_in_bytes`:
the activations and logits a step holds beside its params and gradients) and, with `--steps` > 0, the seconds per
step, then the ratios capped / columns.

Run:
    python benchmarks/bench_logprob_chunks.py --widths 64,128,256 --steps 0
    python benchmarks/bench_logprob_chunks.py --widths 128 --steps 2
"""

from __future__ import annotations

import argparse
import time

from feynrl_jax.host_memory import reexec_with_allocator_tunables

reexec_with_allocator_tunables()  # the allocator every other benchmark and `make` runs with

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from bench_model_fwd_bwd import SMOLLM2_135M_SHAPES  # noqa: E402

from feynrl_jax.models import ModelConfig, init_params, sequence_logprobs  # noqa: E402
from feynrl_jax.models.logprobs import CHUNK_SIZE, CHUNK_TOKENS, chunk_positions  # noqa: E402

LAYOUTS = {"columns": 2**62, "capped": CHUNK_TOKENS}
"""Each layout's `chunk_tokens`."""


def measure(config, params, tokens, prompt: int, chunk_tokens: int, steps: int) -> tuple[float, float | None]:
    """(temporary bytes XLA plans for the compiled pass, seconds per step or None)."""
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)

    def loss(p, x):
        lp, _ = sequence_logprobs(p, x, positions, config=config, first_column=prompt, chunk_tokens=chunk_tokens)
        return -lp[:, prompt:].mean()

    compiled = jax.jit(jax.value_and_grad(loss)).lower(params, tokens).compile()
    temp = compiled.memory_analysis().temp_size_in_bytes
    if steps <= 0:
        return temp, None
    jax.block_until_ready(compiled(params, tokens))  # warm-up
    start = time.perf_counter()
    for _ in range(steps):
        jax.block_until_ready(compiled(params, tokens))
    return temp, (time.perf_counter() - start) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=32, help="rows per pass (the GRPO benchmark's 4 x 8 samples)")
    parser.add_argument("--prompt", type=int, default=96, help="prompt columns (not scored)")
    parser.add_argument("--widths", default="64,128,256", help="completion columns, comma-separated")
    parser.add_argument("--steps", type=int, default=0, help="timed steps per layout (0: memory only)")
    args = parser.parse_args()

    config = ModelConfig.from_hf({"model_type": "llama", **SMOLLM2_135M_SHAPES}, remat="full")
    params = init_params(config, jax.random.key(0))
    print(f"SmolLM2-135M shapes, random weights, float32, remat full, {args.rows} rows, {args.prompt} prompt columns")
    for width in (int(w) for w in args.widths.split(",")):
        n = args.prompt + width
        tokens = jnp.asarray(np.random.default_rng(0).integers(1, config.vocab_size, (args.rows, n)), jnp.int32)
        figures = {}
        for layout, chunk_tokens in LAYOUTS.items():
            figures[layout] = measure(config, params, tokens, args.prompt, chunk_tokens, args.steps)
            temp, seconds = figures[layout]
            columns = chunk_positions(args.rows, width, CHUNK_SIZE, chunk_tokens)
            timed = f", {seconds:.2f} s/step" if seconds is not None else ""
            print(f"{width} new columns, {layout:7s} ({args.rows} rows x {columns} columns a chunk): "
                  f"temp {temp / 2**30:.2f} GiB{timed}", flush=True)  # fmt: skip
        (temp_c, s_c), (temp_k, s_k) = figures["columns"], figures["capped"]
        ratio = f"{width} new columns: capped / columns temp {temp_k / temp_c:.2f}x"
        if s_c is not None:
            ratio += f", time {s_k / s_c:.2f}x"
        print(ratio, flush=True)


if __name__ == "__main__":
    main()
