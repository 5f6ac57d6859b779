"""GEMM rate on this CPU: XLA, oneDNN through our FFI kernel and PyTorch, each in float32 and in bfloat16.

The shapes are SmolLM2-135M's products in a training step of `--tokens` tokens: the MLP's up projection forward
(`[T, D] @ [D, F]`), its two gradients (`dx = dy @ W^T`, `dW = x^T @ dy`, read through strides by the kernel) and
the tied output projection (`[T, D] @ E^T` to float32 logits). Every side runs in this process, each product timed
as the best of `--repeats` after a warm-up, both libraries on every CPU this process may use (`usable_cpus`).

Run:
    python benchmarks/bench_cpu_matmul.py --tokens 2048

Prints GFLOP/s per side and shape, and the ratios of oneDNN to XLA in each dtype and to PyTorch bfloat16 (issue #18:
the model's bf16 dots at PyTorch's rate; `model.cpu_matmul="auto"` takes oneDNN in a dtype where it is faster). The
CPU's bf16 matrix instructions (`amx_bf16`, `avx512_bf16`) are named. `--tokens 32` gives a 32-row decode step's
shapes.
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
    parser.add_argument(
        "--aten-rows",
        default="",
        help="instead: the kernel's bf16 products [rows, hidden] @ [hidden, intermediate] and [rows, hidden] @ "
        "[hidden, 192] for each of these comma-separated row counts, on PyTorch's oneDNN and on its own oneDNN 3.2, "
        "each the best of 200 calls (onednn.ATEN_MIN_MACS)",
    )
    args = parser.parse_args()
    if onednn.problem():
        raise SystemExit(f"the oneDNN kernel cannot run: {onednn.problem()}")
    if args.aten_rows:
        return aten_sweep([int(r) for r in args.aten_rows.split(",")], args.hidden, args.intermediate)
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
    # "oneDNN bf16": the kernel as runs use it, its bf16 products with a bf16 result on PyTorch's oneDNN where built
    # (`onednn.aten_built`); "3.2 bf16": the same products on the kernel's own oneDNN 3.2 (`use_aten_products`).
    sides = ("XLA f32", "oneDNN f32", "torch f32", "XLA bf16", "oneDNN bf16", "torch bf16", "3.2 bf16")
    print(f"the kernel's bf16 products with a bf16 result: {'ATen' if onednn.aten_built() else 'oneDNN 3.2'}")
    header = f"{'product':34s} " + " ".join(f"{side:>11s}" for side in sides)
    print(header + "  oneDNN/XLA f32  oneDNN/XLA bf16  oneDNN/torch bf16")
    for name, (a_shape, b_shape, trans_b, out) in shapes.items():
        measure(name, rng, a_shape, b_shape, trans_b, jnp.dtype(out), args.repeats)


def aten_sweep(rows: list[int], hidden: int, intermediate: int) -> None:
    """The kernel's bf16 products at `rows` rows, forced onto PyTorch's oneDNN and onto its own oneDNN 3.2
    (`onednn.use_aten_products`; the threshold `ATEN_MIN_MACS` set aside), the two taking turns twice."""
    if not onednn.aten_built():
        raise SystemExit("the kernel's ATen library is not built (PyTorch not installed?): make setup")
    rng = np.random.default_rng(0)
    print(f"cpu: {cpu_model()}, {usable_cpus()} cpus; best of 200 calls, microseconds (ratio below 1: ATen faster)")
    threshold = onednn.ATEN_MIN_MACS
    try:
        onednn.ATEN_MIN_MACS = 0
        for n in (intermediate, 192):
            for m in rows:
                a = jnp.asarray(rng.normal(size=(m, hidden)), jnp.bfloat16)
                b = jnp.asarray(rng.normal(size=(hidden, n)), jnp.bfloat16)
                product = jax.jit(lambda a, b: onednn.dot(a, b))
                best = {True: float("inf"), False: float("inf")}
                for aten in (True, False, True, False):
                    onednn.use_aten_products(aten)
                    best[aten] = min(
                        best[aten], best_seconds(lambda f=product, a=a, b=b: f(a, b).block_until_ready(), 200)
                    )
                print(
                    f"[{m},{hidden}]@[{hidden},{n}] ({m * hidden * n:.1e} multiply-adds): ATen {best[True] * 1e6:7.0f}"
                    f"  oneDNN 3.2 {best[False] * 1e6:7.0f}  ratio {best[True] / best[False]:.2f}"
                )
    finally:
        onednn.ATEN_MIN_MACS = threshold
        onednn.use_aten_products(True)


def measure(name: str, rng, a_shape, b_shape, trans_b: bool, out_dtype, repeats: int) -> None:
    """Times `a @ b` (`a @ b.T` with `trans_b`) on the six sides and prints one row (the bfloat16 products give
    `out_dtype`, the float32 ones float32; the bf16 ones once more on the kernel's own oneDNN 3.2)."""
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
    ours = jax.jit(lambda a, b: onednn.dot(a, b, trans_b, out_dtype if a.dtype == jnp.bfloat16 else jnp.float32))
    t32a, t32b = torch.from_numpy(a32), torch.from_numpy(b32)
    t32b = t32b.t() if trans_b else t32b
    ta, tb = t32a.bfloat16(), t32b.bfloat16()
    rates = [
        flops / best_seconds(lambda: xla_jit(ja32, jb32).block_until_ready(), repeats),
        flops / best_seconds(lambda: ours(ja32, jb32).block_until_ready(), repeats),
        flops / best_seconds(lambda: torch.matmul(t32a, t32b), repeats),
        flops / best_seconds(lambda: xla_jit(ja16, jb16).block_until_ready(), repeats),
        flops / best_seconds(lambda: ours(ja16, jb16).block_until_ready(), repeats),
        flops / best_seconds(lambda: torch.matmul(ta, tb), repeats),
    ]
    aten = onednn.use_aten_products(False)  # the same compiled product on the kernel's own oneDNN 3.2
    rates.append(flops / best_seconds(lambda: ours(ja16, jb16).block_until_ready(), repeats))
    onednn.use_aten_products(aten)
    b64 = np.asarray(jb16, np.float64)
    reference = np.asarray(ja16, np.float64) @ (b64.T if trans_b else b64)
    error = np.abs(np.asarray(ours(ja16, jb16), np.float64) - reference).max() / np.abs(reference).max()
    print(
        f"{name:34s} " + " ".join(f"{rate / 1e9:11.0f}" for rate in rates) + f"  {rates[1] / rates[0]:13.2f}x "
        f"{rates[4] / rates[3]:15.2f}x {rates[4] / rates[5]:17.2f}x   (oneDNN bf16 max error {error:.1e} of max |out|)"
    )


if __name__ == "__main__":
    main()
