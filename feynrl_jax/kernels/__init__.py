"""Native kernels called from XLA through `jax.ffi`, each with XLA itself as the fallback.

`onednn`: bfloat16 matrix products on x86-64 CPUs through oneDNN (AVX-512-BF16 or AMX), which XLA:CPU computes in
float32 at under half the rate on many CPUs, and float32 products where oneDNN measures faster than XLA. Built at
install time (`python -m feynrl_jax.kernels.onednn build`, run by `make setup`); chosen by `model.cpu_matmul`.
"""

from pathlib import Path

CPU_MATMUL_BACKENDS = ("auto", "xla", "onednn")
"""Values of `model.cpu_matmul` (`feynrl_jax.kernels.onednn`)."""
ONEDNN_LIBRARY = Path(__file__).with_name("_onednn_matmul.so")
"""Where `python -m feynrl_jax.kernels.onednn build` writes the oneDNN kernel (no JAX import needed to look)."""
