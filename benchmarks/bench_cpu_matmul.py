"""GEMM rate on this CPU: XLA float32, XLA bfloat16, oneDNN bfloat16 through our FFI kernel, PyTorch bfloat16.

The shapes are SmolLM2-135M's products in a training step of `--tokens` tokens: the MLP's up projection forward
(`[T, D] @ [D, F]`), its two gradients (`dx = dy @ W^T`, `dW = x^T @ dy`, read through strides by the kernel) and
the tied output projection (`[T, D] @ E^T` to float32 logits). Every side runs in this process, each product timed
as the best of `--repeats` after a warm-up, both libraries on every CPU this process may use (`usable_cpus`).

Run:
    python benchmarks/bench_cpu_matmul.py --tokens 2048

Prints GFLOP/s per side and shape, and the ratio of oneDNN to XLA bfloat16 and to PyTorch bfloat16 (issue #18: the
model's bf16 dots at PyTorch's rate). The CPU's bf16 matrix instructions (`amx_bf16`, `avx512_bf16`) are named.
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import time

import jax
import jax.numpy as jnp
import numpy as np

from feynrl_jax.host_memory import usable_cpus  # the other benchmarks import it from here
from feynrl_jax.kernels import onednn


def best_seconds(fn, repeats: int) -> float:
    fn()  # warm-up (and compile)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        return next(line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name"))
    except (OSError, StopIteration):
        return platform.processor() or "unknown"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--hidden", type=int, default=576)
    parser.add_argument("--intermediate", type=int, default=1536)
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    if onednn.problem():
        raise SystemExit(f"the oneDNN kernel cannot run: {onednn.problem()}")
    import torch

    torch.set_num_threads(usable_cpus())
    t, d, f, v = args.tokens, args.hidden, args.intermediate, args.vocab
    units = ", ".join(onednn.cpu_bf16_units()) or "none"
    print(f"cpu: {cpu_model()}, {usable_cpus()} usable of {os.cpu_count()} cpus, bf16 matrix instructions: {units}")
    rng = np.random.default_rng(0)
    # name: (a shape, b shape, trans_b, output dtype); out = a @ b (a @ b.T with trans_b)
    shapes = {
        f"up fwd   [{t},{d}]@[{d},{f}]": ((t, d), (d, f), False, "bfloat16"),
        f"up dx    [{t},{f}]@[{d},{f}]^T": ((t, f), (d, f), True, "bfloat16"),
        f"logits   [{t},{d}]@[{v},{d}]^T": ((t, d), (v, d), True, "float32"),
    }
    header = f"{'product':34s} {'XLA f32':>9s} {'XLA bf16':>9s} {'oneDNN bf16':>12s} {'torch bf16':>11s}"
    print(header + "  oneDNN/XLA-bf16  oneDNN/torch")
    for name, (a_shape, b_shape, trans_b, out) in shapes.items():
        measure(name, rng, a_shape, b_shape, trans_b, jnp.dtype(out), args.repeats)


def measure(name: str, rng, a_shape, b_shape, trans_b: bool, out_dtype, repeats: int) -> None:
    """Times `a @ b` (`a @ b.T` with `trans_b`) on the four sides and prints one row."""
    import torch

    a32 = rng.normal(size=a_shape).astype(np.float32)
    b32 = rng.normal(size=b_shape).astype(np.float32)
    flops = 2 * a_shape[0] * a_shape[1] * (b_shape[0] if trans_b else b_shape[1])
    ja32, jb32 = jnp.asarray(a32), jnp.asarray(b32)
    ja16, jb16 = ja32.astype(jnp.bfloat16), jb32.astype(jnp.bfloat16)

    def xla(a, b):
        wide = out_dtype if a.dtype == jnp.bfloat16 else None
        return jnp.matmul(a, b.T if trans_b else b, preferred_element_type=wide)

    xla_jit = jax.jit(xla)
    ours = jax.jit(lambda a, b: onednn.dot(a, b, trans_b, out_dtype))
    ta, tb = torch.from_numpy(a32).bfloat16(), torch.from_numpy(b32).bfloat16()
    tb = tb.t() if trans_b else tb
    rates = [
        flops / best_seconds(lambda: xla_jit(ja32, jb32).block_until_ready(), repeats),
        flops / best_seconds(lambda: xla_jit(ja16, jb16).block_until_ready(), repeats),
        flops / best_seconds(lambda: ours(ja16, jb16).block_until_ready(), repeats),
        flops / best_seconds(lambda: torch.matmul(ta, tb), repeats),
    ]
    b64 = np.asarray(jb16, np.float64)
    reference = np.asarray(ja16, np.float64) @ (b64.T if trans_b else b64)
    error = np.abs(np.asarray(ours(ja16, jb16), np.float64) - reference).max() / np.abs(reference).max()
    print(
        f"{name:34s} {rates[0] / 1e9:9.0f} {rates[1] / 1e9:9.0f} {rates[2] / 1e9:12.0f} {rates[3] / 1e9:11.0f}"
        f"  {rates[2] / rates[1]:15.2f}x {rates[2] / rates[3]:12.2f}x   (oneDNN max error {error:.1e} of max |out|)"
    )


if __name__ == "__main__":
    main()
