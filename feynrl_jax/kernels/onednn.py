"""Matrix products through oneDNN on x86-64 CPUs (bfloat16 and float32), reached from JAX as an XLA FFI custom call.

Why: XLA:CPU widens bfloat16 dot operands to float32 and multiplies at the float32 rate, so a bfloat16 model is no
faster than a float32 one on a CPU. oneDNN runs the same product on the CPU's bfloat16 instructions (AMX tiles
where the CPU has `amx_bf16`, `vdpbf16ps` where it has `avx512_bf16`) with float32 accumulation, as PyTorch does
on these CPUs. Measured on a 2-core AMD EPYC with AVX-512-BF16 and no AMX, a 2048x576x1536 product: XLA bfloat16
196 GFLOP/s, XLA float32 211, oneDNN bfloat16 424, PyTorch bfloat16 425 (`benchmarks/bench_cpu_matmul.py`).
Its float32 products can be faster than XLA's too: on a 2-core Intel Xeon with AVX-512, the product's input
gradient ran at 307 against 276 GFLOP/s and the output projection at 228 against 202 (the product itself at 224
against 242), and a float32 forward and backward pass of SmolLM2-135M ran 1.11x faster with them
(`benchmarks/bench_model_fwd_bwd.py --backends xla,onednn`).

The kernel (`onednn_matmul.cc`) is compiled against the `onednn-cpu-gomp` wheel's library and headers and XLA's
FFI headers (`jax.ffi.include_dir()`) by `build`, which `make setup` runs; the library lands beside this file.
Without it (no compiler, no oneDNN) every product stays with XLA. The library records a hash of its sources
(`onednn_matmul.cc` and `aten_matmul.cc`); one built from other versions is not loaded (`make setup` rebuilds it).

Where PyTorch is installed, `build` also compiles `aten_matmul.cc` into a second library (`aten_library`), which runs
large bf16 products with a bf16 result (`ATEN_MIN_MACS`: a training step's, not a decode step's) on the newer oneDNN
PyTorch is built with, through ATen: on a 2-core AMX Xeon 1.17 against 1.68 ms for `[2048,576] @ [576,1536]`. A
process loads it (and libtorch_cpu) only when it first stages such a product (`_load_aten`); products with a float32
operand or result stay here, as do all products where it is not built or was built for another PyTorch.

The library also writes a decode step's keys and values into a bfloat16 KV cache in place (`cache_write`, its second
FFI target), for the bfloat16 cache a model keeps where its decode products run here (`decoder.cache_dtype`), and
multiplies by the first positions of a KV cache where they lie (`cache_dot`, its third): attention to the prefix of
the cache that a decode step's rows reached, without the copy of that prefix XLA makes for a product.

`model.cpu_matmul` picks the backend of the decoder's projections, attention's two batched products and the output
projection (`decoder.forward`, `attention.attend`, `decoder.logits`), for a bfloat16 or float32 compute dtype:
- "auto" (default): oneDNN where JAX runs on one CPU device, the library is built, oneDNN was measured faster than XLA
  on this machine in the compute dtype (`auto_choice`), and for bfloat16 the CPU has bfloat16 matrix instructions; XLA
  otherwise. The measurement decides, not the CPU's flags: on a 2-core Intel Xeon with AVX-512-BF16 (no AMX) oneDNN's
  bfloat16 products ran at 0.6-0.7x XLA's rate (0.68-0.96x PyTorch's) while its float32 ones ran at 1.10-1.20x (the
  measured product and its two gradient products together), where an AMD EPYC's bfloat16 ones ran at 1.7-2.5x and an AMX
  Xeon's at 1.3-5.4x (`benchmarks/bench_cpu_matmul.py`; README). A decode step's products (one token per row) follow
  a measurement of their own (`auto_choice`'s `one_token`).
- "onednn": oneDNN for bfloat16 and float32 products, refused at validation when the library is not built, and
  where a trainer starts (`run_setup.log_compute`) or a pass is traced when it cannot load, on an accelerator, in a
  multi-device job (XLA's partitioner would gather a custom call's operands onto each device) or, for bfloat16, on
  a CPU without AVX-512 (oneDNN 3.2 has no bfloat16 matmul there).
- "xla": always XLA.

The gradient (`dot`'s custom VJP) is two more oneDNN products that read the transposes through strides; the
cotangent of a float32 output (the logits of a bfloat16 model) is rounded to bfloat16 first, as bfloat16 autocast
does in PyTorch; a float32 model's products and gradients stay float32. `dot_cast` takes a float32 weight that it
casts for the product itself, and gives that weight's gradient in float32 straight from the kernel's float32
accumulator: a model whose stored weights are float32 and whose products are bfloat16 (`decoder._matmul`).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import ctypes
import fcntl
import functools
import hashlib
import importlib.metadata
import importlib.util
import json
import logging
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from feynrl_jax.cache_dirs import default_cache_root
from feynrl_jax.host_memory import usable_cpus
from feynrl_jax.kernels import CPU_MATMUL_BACKENDS, ONEDNN_LIBRARY

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("onednn_matmul.cc")
ATEN_SOURCE = Path(__file__).with_name("aten_matmul.cc")
"""The kernel's bf16 products on PyTorch's oneDNN, a library of its own (`aten_library`)."""
LIBRARY = ONEDNN_LIBRARY
TARGET = "feynrl_onednn_matmul"
CACHE_WRITE_TARGET = "feynrl_cache_write"
"""The library's second FFI target: a KV cache write in place (`cache_write`)."""
CACHE_MATMUL_TARGET = "feynrl_onednn_cache_matmul"
"""The library's third FFI target: a product with the first positions of a KV cache, read in place (`cache_dot`)."""
CPU_BF16_FLAGS = ("amx_bf16", "avx512_bf16")
"""/proc/cpuinfo flags of bfloat16 matrix instructions oneDNN uses."""
AVX512_CORE = ("avx512f", "avx512bw", "avx512vl", "avx512dq")
"""Without bf16 instructions, oneDNN computes a bfloat16 matmul in float32 on these (AVX-512 "core"); without them it
has none."""
AUTO_SHAPE = (2048, 576, 1536)
"""`[M, K, N]` of the product "auto" times both ways, with its two gradient products: SmolLM2-135M's MLP
up-projection over 8 x 256 tokens."""
AUTO_DECODE_ROWS = (8, 32)
"""Rows of the decode-step products "auto" times apart (`auto_choice(..., one_token=True)`): a decode step multiplies
as many rows as the engine has sequences, and the engine decodes a batch's tail in a quarter of its slots."""
AUTO_DECODE_LAYERS = 8
"""MLP layers (`AUTO_SHAPE`'s up-projection and its down-projection, weights of their own) in the timed decode chain:
about 57 MB of float32 weights, more than most CPUs' caches hold, so they stream from memory as a decode step's do."""
AUTO_MIN_SPEEDUP = 1.1
""""auto" takes oneDNN where it ran at least this much faster than XLA (a margin over timing noise)."""
AUTO_FILE = "onednn_auto.json"
"""The file under the cache root (`cache_dirs.default_cache_root`) that keeps each machine's measurement per dtype."""
KERNEL_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))
"""The operand dtypes the kernel multiplies."""
ATEN_MIN_MACS = 2**29
"""The fewest multiply-adds (batch x M x K x N) of a bf16 product with a bf16 result that the kernel hands to PyTorch's
oneDNN (`aten_matmul.cc`): ATen adds some 10-35 us to every call, which only large products repay. On a 2-core AMX
Xeon, `[M,576] @ [576,1536]` took 128 us on ATen against 93 on the kernel's oneDNN 3.2 at 64 rows, 233 against 211 at
256, 374 against 401 at 512 (4.5e8 multiply-adds), 1,165 against 1,681 at 2,048; `[M,576] @ [576,192]` was slower on
ATen up to 1,024 rows and even at 2,048 (`python benchmarks/bench_cpu_matmul.py --aten-rows 32,64,256,512,1024,2048`,
best of 200 calls each). Decode steps (as many rows as sequences) stay on oneDNN 3.2, and a process that stages no
larger bf16 product never loads PyTorch (the bf16 "auto" measurement, `auto_choice`, stages one)."""


def source_hash() -> str:
    """The first 16 hex digits of the SHA-256 of `onednn_matmul.cc` and `aten_matmul.cc`, compiled into both
    libraries by `build`."""
    return hashlib.sha256(SOURCE.read_bytes() + ATEN_SOURCE.read_bytes()).hexdigest()[:16]


def aten_library(library: Path | None = None) -> Path:
    """Where `build` writes the bf16 products on PyTorch's oneDNN for the kernel at `library` (default `LIBRARY`):
    beside it, `<name>_aten.so`."""
    library = Path(LIBRARY if library is None else library)
    return library.with_name(f"{library.stem}_aten{library.suffix}")


def _torch_version() -> str:
    """The installed PyTorch's version ("" where it is not installed), read without importing torch."""
    try:
        return importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return ""


def _torch_dirs() -> tuple[Path, Path] | None:
    """(include, lib) of the installed PyTorch's C++ headers and libraries (found without importing torch), or None
    where torch or its headers are not installed."""
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return None
    root = Path(next(iter(spec.submodule_search_locations)))
    include, lib = root / "include", root / "lib"
    if (include / "ATen" / "ATen.h").is_file() and (lib / "libtorch_cpu.so").exists():
        return include, lib
    return None


def _prefix_dirs() -> tuple[Path, Path]:
    """(include, lib) of the environment the `onednn-cpu-gomp` wheels install their data files into."""
    return Path(sys.prefix) / "include", Path(sys.prefix) / "lib"


def build(output: Path = LIBRARY, compiler: str | None = None, aten: bool | None = None) -> Path:
    """Compiles `onednn_matmul.cc` into `output` and, where PyTorch is installed, `aten_matmul.cc` into
    `aten_library(output)` (each written to a temporary file, then renamed: never half-written).

    `aten`: build the second library (None: where PyTorch's headers and libtorch_cpu are installed, as `make setup`
    installs them; False: not, and a stale one at that path is removed).

    Raises:
        RuntimeError: no C++ compiler, no oneDNN headers or library in this environment (naming what is missing
            and the package that provides it), `aten=True` without PyTorch, or the compiler's error (for
            `aten_matmul.cc` only with `aten=True`: otherwise a warning, and the kernel alone is built).
    """
    compiler = compiler or os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if not compiler:
        raise RuntimeError("no C++ compiler (g++ or $CXX) found: the oneDNN kernel is not built; XLA runs every dot")
    include, lib = _prefix_dirs()
    if not (include / "oneapi" / "dnnl" / "dnnl.hpp").is_file():
        raise RuntimeError(f"no oneDNN headers in {include}: pip install onednn-devel-cpu-gomp==2023.2.0")
    if not (lib / "libdnnl.so").exists():
        raise RuntimeError(f"no libdnnl.so in {lib}: pip install onednn-cpu-gomp==2023.2.0")
    torch_dirs = _torch_dirs()
    if aten and torch_dirs is None:
        raise RuntimeError("aten=True: PyTorch's C++ headers and libtorch_cpu.so are not installed (pip install torch)")
    output = Path(output)
    common = [compiler, "-O2", "-std=c++17", "-shared", "-fPIC", f'-DFEYNRL_ONEDNN_SOURCE_HASH="{source_hash()}"']
    _compile(
        SOURCE,
        output,
        [
            *common,
            "-Wno-return-type",  # XLA's FFI headers end switch-covered functions without a return
            str(SOURCE),
            f"-I{jax.ffi.include_dir()}",
            f"-I{include}",
            f"-L{lib}",
            "-ldnnl",
            f"-Wl,-rpath,{lib}",
        ],
    )
    aten_library(output).unlink(missing_ok=True)  # no library for another kernel or another PyTorch stays beside it
    if torch_dirs is not None and aten is not False:
        torch_include, torch_lib = torch_dirs
        flags = [
            f'-DFEYNRL_TORCH_VERSION="{_torch_version()}"',
            "-Wno-c++20-extensions",
            f"-I{torch_include}",
            f"-L{torch_lib}",
            "-ltorch_cpu",
            "-lc10",
            f"-Wl,-rpath,{torch_lib}",
        ]
        try:
            _compile(ATEN_SOURCE, aten_library(output), [*common, str(ATEN_SOURCE), *flags])
        except RuntimeError as error:
            if aten:
                raise
            # The kernel is built and runs every product itself; only the faster bf16 path is missing.
            log.warning("%s; the kernel runs its bf16 products on its own oneDNN 3.2", error)
    _load.cache_clear()
    _load_aten.cache_clear()
    return output


def _compile(source: Path, output: Path, command: list[str]) -> None:
    """Runs `command` + `-o <temporary file>`, then renames that file to `output`.

    Raises:
        RuntimeError: the compiler cannot run or fails (its error)."""
    with tempfile.NamedTemporaryFile(dir=output.parent, prefix=output.name, suffix=".tmp", delete=False) as tmp:
        partial = Path(tmp.name)
    command = [*command, "-o", str(partial)]
    try:
        try:
            result = subprocess.run(command, capture_output=True, text=True)
        except OSError as error:
            raise RuntimeError(f"compiling {source.name} failed: cannot run {command[0]}: {error}") from error
        if result.returncode:
            raise RuntimeError(f"compiling {source.name} failed:\n{' '.join(command)}\n{result.stderr[-4000:]}")
        partial.replace(output)
    finally:
        partial.unlink(missing_ok=True)


_REGISTERED: set[str] = set()
_KERNEL: list = []
"""The kernel library XLA calls (the one `_load` registered first), which `_load_aten` hands the ATen products."""
_ATEN_WANTED = [True]
"""Whether bf16 products go to PyTorch's oneDNN where it is built (`use_aten_products`)."""


@functools.cache
def _load() -> tuple[bool, str]:
    """Loads the built library and registers its FFI target once per process: `(loaded, why not)`."""
    if not LIBRARY.is_file():
        return False, f"{LIBRARY} is not built (python -m feynrl_jax.kernels.onednn build; `make setup` runs it)"
    try:
        library = ctypes.cdll.LoadLibrary(str(LIBRARY))
    except OSError as error:
        return False, f"{LIBRARY} does not load: {error}"
    built_from = getattr(library, "feynrl_onednn_source_hash", None)
    if built_from is not None:
        built_from.restype = ctypes.c_char_p
        built_from = built_from().decode()
    if built_from != source_hash():
        return False, (
            f"{LIBRARY} was built from another version of {SOURCE.name}: rebuild it "
            "(python -m feynrl_jax.kernels.onednn build; `make setup` does)"
        )
    if TARGET not in _REGISTERED:  # once per process, also when a rebuilt library is loaded again
        jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(library.FeynrlOnednnMatmul), platform="cpu")
        write = jax.ffi.pycapsule(library.FeynrlCacheWrite)
        jax.ffi.register_ffi_target(CACHE_WRITE_TARGET, write, platform="cpu")
        cache_matmul = jax.ffi.pycapsule(library.FeynrlCacheMatmul)
        jax.ffi.register_ffi_target(CACHE_MATMUL_TARGET, cache_matmul, platform="cpu")
        _REGISTERED.add(TARGET)
        _KERNEL[:] = [library]  # XLA keeps calling this one
    return True, ""


def problem() -> str:
    """Why the kernel cannot run in this process, or "" when it can (loads the library)."""
    return _load()[1]


@functools.cache
def _load_aten() -> bool:
    """Loads `aten_library()` and hands its products to the kernel, once per process: whether large bf16 products
    with a bf16 result now run on PyTorch's oneDNN. False where the kernel does not load, or the library is not built
    (no PyTorch), was built from other sources or for another PyTorch (said in the log; the kernel's own oneDNN runs
    them)."""
    path = aten_library()
    if not _load()[0] or not path.is_file():
        return False
    try:
        library = ctypes.CDLL(str(path))
        library.feynrl_aten_source_hash.restype = ctypes.c_char_p
        library.feynrl_aten_torch_version.restype = ctypes.c_char_p
        library.feynrl_aten_calls.restype = ctypes.c_int64
        built_from = library.feynrl_aten_source_hash().decode()
        built_for = library.feynrl_aten_torch_version().decode()
    except (OSError, AttributeError) as error:
        log.warning("%s does not load (%s): bf16 products stay with the kernel's oneDNN 3.2", path, error)
        return False
    if built_from != source_hash() or built_for != _torch_version():
        log.warning(
            "%s was built from other sources or for PyTorch %s (installed: %s): bf16 products stay with oneDNN 3.2 "
            "(rebuild: python -m feynrl_jax.kernels.onednn build)",
            path,
            built_for,
            _torch_version() or "none",
        )
        return False
    library.feynrl_aten_set_threads(ctypes.c_int(_openmp_threads()))
    _ATEN_LIBRARY[:] = [library]
    _KERNEL[0].feynrl_onednn_set_aten(
        ctypes.cast(library.feynrl_aten_matmul, ctypes.c_void_p), ctypes.c_int64(ATEN_MIN_MACS)
    )
    return True


_ATEN_LIBRARY: list = []
"""The loaded `aten_library()` (`_load_aten`)."""


def _openmp_threads() -> int:
    """The OpenMP threads of this process: the first level of `OMP_NUM_THREADS` where set (Ray's actors set it,
    `orchestration.runtime.openmp_threads_from_cores`), else the CPUs of its affinity mask, as libgomp and that
    function count them."""
    first = os.environ.get("OMP_NUM_THREADS", "").split(",")[0].strip()
    return int(first) if first.isdigit() and int(first) > 0 else len(os.sched_getaffinity(0))


def aten_calls() -> int:
    """How many products have run on PyTorch's oneDNN in this process (0 where its library is not loaded)."""
    return int(_ATEN_LIBRARY[0].feynrl_aten_calls()) if _ATEN_LIBRARY else 0


def use_aten_products(enabled: bool) -> bool:
    """Hands the kernel's large bf16 products with a bf16 result to PyTorch's oneDNN (`enabled`, the default, where
    built) or keeps them on the kernel's own oneDNN 3.2 until told otherwise, for programs compiled before as well:
    the kernel reads the choice at every product. For benchmarks and tests that compare the two. Returns whether
    they now run on PyTorch's oneDNN."""
    _ATEN_WANTED[0] = enabled
    if not enabled:
        if _load()[0]:
            _KERNEL[0].feynrl_onednn_set_aten(None, ctypes.c_int64(0))
        _load_aten.cache_clear()  # handed over again when enabled
        return False
    _load_aten.cache_clear()
    return _load_aten()


def aten_built() -> bool:
    """Whether the kernel's bf16 products with a bf16 result can run on PyTorch's oneDNN here (`aten_library()` is
    built beside a kernel that loads); it is loaded when the first such product is staged."""
    return _load()[0] and aten_library().is_file()


@functools.cache
def _cpuinfo(field: str) -> str:
    """The value of the first CPU's `field` in /proc/cpuinfo ("flags", "model name"); "" where it cannot be read."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.split(":", 1)[0].strip() == field), "")
    except OSError:
        return ""


def _cpu_flags() -> frozenset[str]:
    """This CPU's /proc/cpuinfo flags (empty where they cannot be read)."""
    return frozenset(_cpuinfo("flags").split())


def cpu_bf16_units() -> tuple[str, ...]:
    """The `CPU_BF16_FLAGS` this CPU has."""
    return tuple(flag for flag in CPU_BF16_FLAGS if flag in _cpu_flags())


def bf16_products_here() -> bool:
    """Whether the kernel's oneDNN 3.2 has a bfloat16 matmul on this CPU: bf16 instructions, or AVX-512 "core" where
    it computes one in float32 (`AVX512_CORE`). Without either (an AVX2-only CPU) it has none, and the kernel fails
    on a bfloat16 product: `model.cpu_matmul="onednn"` is refused for bfloat16 there, and "auto" keeps XLA."""
    return bool(cpu_bf16_units()) or set(AVX512_CORE) <= _cpu_flags()


def _machine_key() -> str:
    """What a measurement of "auto" holds for: the CPU model, the CPUs this process may use and oneDNN's OpenMP
    threads (Ray's actors get `OMP_NUM_THREADS` set), the bf16 instructions, the kernel's source, JAX's version."""
    model = _cpuinfo("model name") or "unknown"
    units = "+".join(cpu_bf16_units()) or "none"
    threads = _openmp_threads()  # as oneDNN will run them: the same in `build` and in a run's Ray actors
    bf16_library = f"aten, torch {_torch_version()}" if aten_built() else "onednn 3.2"
    return (
        f"{model} | {usable_cpus()} cpus | {threads} OpenMP threads | {units} | kernel {source_hash()} "
        f"({bf16_library}) | jax {jax.__version__}"
    )


def _record_key(dtype: str, one_token: bool = False) -> str:
    """The key of a measurement of products in `dtype` on this machine (`_machine_key`), of a decode step's products
    where `one_token`."""
    return f"{_machine_key()} | {dtype}" + (" | decode" if one_token else "")


def _time_turns(runs: tuple, arguments: tuple, repeats: int) -> list[float]:
    """Seconds of each of `runs` (jitted functions of `arguments`), each the best of `repeats`; they take turns, so a
    change of load on the machine weighs on all of them. A first round compiles and is not timed."""
    best = [float("inf")] * len(runs)
    for round_ in range(1 + repeats):
        for i, run in enumerate(runs):
            start = time.perf_counter()
            out = jax.block_until_ready(run(*arguments))
            if any(isinstance(leaf, jax.core.Tracer) for leaf in jax.tree.leaves(out)):  # staged, not run
                raise RuntimeError("the timed products were traced instead of run (call this outside a trace)")
            if round_:
                best[i] = min(best[i], time.perf_counter() - start)
    return best


def _time_products(dtype: str, repeats: int = 5) -> tuple[float, float]:
    """Seconds `(oneDNN, XLA)`, each the best of `repeats`, of `AUTO_SHAPE`'s product in `dtype` and its two
    gradient products."""
    m, k, n = AUTO_SHAPE
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(m, k)), dtype)
    w = jnp.asarray(rng.normal(size=(k, n)) / np.sqrt(k), dtype)

    def step(product):
        return jax.jit(jax.grad(lambda x, w: jnp.sum(product(x, w).astype(jnp.float32)), argnums=(0, 1)))

    onednn_s, xla_s = _time_turns((step(lambda x, w: dot(x, w, out_dtype=x.dtype)), step(jnp.matmul)), (x, w), repeats)
    return onednn_s, xla_s


def _time_decode_products(dtype: str, repeats: int = 5) -> dict[int, tuple[float, float]]:
    """Seconds `(oneDNN, XLA)` by rows (`AUTO_DECODE_ROWS`), each the best of `repeats`, of a decode step's kind of
    products in `dtype`: `AUTO_DECODE_LAYERS` MLP layers of `AUTO_SHAPE`'s width, `x @ up` then `@ down`, forward
    only, on as many rows as a decode step has sequences."""
    _, k, n = AUTO_SHAPE
    rng = np.random.default_rng(0)
    weights = [
        (
            jnp.asarray(rng.normal(size=(k, n)) / np.sqrt(k), dtype),
            jnp.asarray(rng.normal(size=(n, k)) / np.sqrt(n), dtype),
        )
        for _ in range(AUTO_DECODE_LAYERS)
    ]

    def chain(product):
        def run(x, weights):
            for up, down in weights:
                x = product(product(x, up), down)
            return x

        return jax.jit(run)

    runs = (chain(lambda x, w: dot(x, w, out_dtype=x.dtype)), chain(jnp.matmul))
    times = {}
    for rows in AUTO_DECODE_ROWS:
        x = jnp.asarray(rng.normal(size=(rows, k)), dtype)
        onednn_s, xla_s = _time_turns(runs, (x, weights), repeats)
        times[rows] = (onednn_s, xla_s)
    return times


def _measure(dtype: str, one_token: bool = False) -> dict:
    """`auto_choice`'s record (`_training_record` or `_decode_record`), measured on a thread of its own: JAX's trace
    state is per thread, and a trace in progress on the caller's (a model being jitted) would stage these
    computations instead of running them."""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(_decode_record if one_token else _training_record, dtype).result()


def _training_record(dtype: str) -> dict:
    """The record of a training step's products (`_time_products`)."""
    onednn_s, xla_s = _time_products(dtype)
    return {"onednn_s": onednn_s, "xla_s": xla_s, "onednn": xla_s >= AUTO_MIN_SPEEDUP * onednn_s}


def _decode_record(dtype: str) -> dict:
    """The record of a decode step's products (`_time_decode_products`): oneDNN where it was faster by the margin at
    every size of batch measured (the engine runs both), the times summed and kept by rows."""
    by_rows = _time_decode_products(dtype)
    return {
        "onednn_s": sum(onednn_s for onednn_s, _ in by_rows.values()),
        "xla_s": sum(xla_s for _, xla_s in by_rows.values()),
        "onednn": all(xla_s >= AUTO_MIN_SPEEDUP * onednn_s for onednn_s, xla_s in by_rows.values()),
        "by_rows": {str(rows): {"onednn_s": o, "xla_s": x} for rows, (o, x) in by_rows.items()},
    }


def _valid(record, one_token: bool = False) -> bool:
    """A stored measurement: the verdict a bool, both times finite positive numbers, and for a decode step's products
    the times of each of `AUTO_DECODE_ROWS` (a record of other rows is measured again)."""
    if not isinstance(record, dict) or not isinstance(record.get("onednn"), bool) or not _valid_times(record):
        return False
    if not one_token:
        return True
    by_rows = record.get("by_rows")
    wanted = {str(rows) for rows in AUTO_DECODE_ROWS}
    return isinstance(by_rows, dict) and set(by_rows) == wanted and all(map(_valid_times, by_rows.values()))


def _valid_times(times) -> bool:
    """`times["onednn_s"]` and `times["xla_s"]` are finite positive numbers."""
    values = [times.get(k) for k in ("onednn_s", "xla_s")] if isinstance(times, dict) else [None]
    return all(isinstance(t, int | float) and not isinstance(t, bool) and math.isfinite(t) and t > 0 for t in values)


def _stored(path: Path) -> dict:
    """The measurements in `path` by machine key; {} where it is missing or not a JSON object."""
    try:
        known = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return known if isinstance(known, dict) else {}


@contextlib.contextmanager
def _exclusive(path: Path):
    """Holds an exclusive lock on `path` + ".lock" (where it can be created): processes starting together measure
    one after the other, and the later ones read the first's record."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        handle = open(f"{path}.lock", "a")
    except OSError:
        yield
        return
    with handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        yield


def auto_choice(dtype, one_token: bool = False) -> dict:
    """Whether "auto" takes oneDNN for products in `dtype` (bfloat16 or float32) on this machine: `{"onednn_s",
    "xla_s", "onednn"}`, the seconds of `AUTO_SHAPE`'s forward and backward products in `dtype` by each backend and
    the verdict (oneDNN at least `AUTO_MIN_SPEEDUP` times faster).

    `one_token`: the verdict for a decode step's products (one token per row), measured apart: a chain of
    `AUTO_DECODE_LAYERS` MLP layers, forward only, at each of `AUTO_DECODE_ROWS` rows (`"by_rows"` holds the times),
    oneDNN where it was faster by the margin at every one. Few rows and weights streamed from memory rank the two
    backends differently from a training step's products: on a 2-core Intel Xeon with AVX-512, oneDNN's float32
    products ran 1.1-1.2x faster at 2048 rows, but decode steps of 32 and 8 rows with them ran at 1.03-1.06x and
    0.92-0.95x XLA's speed; on a 2-core AMD EPYC with AVX2 they ran at 0.96-1.20x at 2048 rows and the decode steps at
    1.31-1.32x (`benchmarks/bench_decode_step.py --backends xla,onednn`).

    Measured once per machine, dtype and kind (`_machine_key`; a training step's products in 1.9 s on a 2-core
    machine, 2.1 s on 16 AMX cores, a decode step's in 1.0-1.2 s on a 2-core AMD EPYC) and kept in
    `<cache root>/onednn_auto.json`, which later processes read, so every run on the machine takes the same backend;
    a new CPU, kernel or JAX measures again, and so does a record that is not a valid measurement. Where the file
    cannot be written, the measurement holds for this process only. Where it fails (`{"onednn": False, "error":
    ...}`), XLA runs, and the next process tries again. Call it where the kernel can run (`problem()` is "").
    """
    return _auto_choice(jnp.dtype(dtype).name, one_token)


@functools.cache
def _auto_choice(dtype: str, one_token: bool = False) -> dict:
    """`auto_choice` for a dtype's name, once per process."""
    key = _record_key(dtype, one_token)
    path = Path(default_cache_root()) / AUTO_FILE
    record = _stored(path).get(key)
    if _valid(record, one_token):
        return record
    with _exclusive(path):
        known = _stored(path)  # another process may have measured while this one waited
        if _valid(known.get(key), one_token):
            return known[key]
        try:
            record = _measure(dtype, one_token)
        except Exception as error:  # XLA is always there
            log.warning("model.cpu_matmul='auto': timing oneDNN against XLA failed (%s); XLA runs", error)
            return {"onednn": False, "error": f"{type(error).__name__}: {error}"}
        partial = None
        try:
            with tempfile.NamedTemporaryFile(
                "w", dir=path.parent, prefix=AUTO_FILE, suffix=".tmp", delete=False
            ) as tmp:
                partial = Path(tmp.name)
                json.dump({**known, key: record}, tmp, indent=1)
            partial.replace(path)
        except OSError:
            if partial is not None:
                partial.unlink(missing_ok=True)
    return record


def use_onednn(backend: str, dtype, one_token: bool = False) -> bool:
    """Whether the model's products of `dtype` go to oneDNN under `model.cpu_matmul=backend` (see module doc).

    `one_token`: the pass feeds one token per row (a decode step), which "auto" decides by its own measurement
    (`auto_choice`'s `one_token`).

    Raises:
        ValueError: `backend="onednn"` where it cannot run (not loadable, not a CPU, several devices), naming
            `model.cpu_matmul`.
    """
    dtype = jnp.dtype(dtype)
    if backend == "xla" or dtype not in KERNEL_DTYPES:
        return False
    if backend == "onednn":
        why = problem()
        if not why and jax.default_backend() != "cpu":
            why = f"JAX runs on {jax.default_backend()!r}, not a CPU"
        if not why and dtype == jnp.bfloat16 and not bf16_products_here():
            why = "this CPU has neither bf16 instructions nor AVX-512, where oneDNN 3.2 has no bfloat16 matmul"
        if not why and jax.device_count() > 1:
            why = f"the job has {jax.device_count()} devices; the kernel runs where there is one"
        if why:
            raise ValueError(f"model.cpu_matmul='onednn' cannot run: {why}. Set model.cpu_matmul='auto' or 'xla'.")
        return True
    if backend != "auto":
        raise ValueError(f"model.cpu_matmul={backend!r}: expected one of {CPU_MATMUL_BACKENDS}")
    return auto_applies(dtype) and bool(auto_choice(dtype, one_token)["onednn"])


def auto_applies(dtype) -> bool:
    """Whether "auto" times oneDNN against XLA for products of `dtype` here (`auto_choice`): a dtype the kernel
    multiplies, JAX on one CPU device, the kernel loadable, and for bfloat16 a CPU with bf16 instructions."""
    dtype = jnp.dtype(dtype)
    if dtype not in KERNEL_DTYPES or (dtype == jnp.bfloat16 and not cpu_bf16_units()):
        return False
    return jax.default_backend() == "cpu" and jax.device_count() == 1 and not problem()


def _require_kernel() -> None:
    """Raises RuntimeError (why the library cannot run) where it does not load."""
    loaded, why = _load()
    if not loaded:
        raise RuntimeError(f"feynrl_jax.kernels.onednn: {why}")


def _check_result_dtype(name: str, operands, result) -> None:
    """Raises ValueError where float32 operands would give a result other than float32 (the kernel's rule)."""
    if operands == jnp.float32 and jnp.dtype(result) != jnp.float32:
        raise ValueError(f"{name}: float32 operands give a float32 result, not {jnp.dtype(result).name}")


def _call(a: jax.Array, b: jax.Array, trans_a: bool, trans_b: bool, out_dtype) -> jax.Array:
    """`op(a) @ op(b)` by the FFI target; `op` transposes the last two axes when its flag is set. Leading axes (the
    same for both operands) are batch axes: folded into one for the kernel's batched product."""
    _require_kernel()
    if a.ndim != b.ndim or a.ndim < 2 or a.shape[:-2] != b.shape[:-2]:
        raise ValueError(f"onednn.dot: operands {a.shape} and {b.shape} need the same batch axes before 2 matrix axes")
    _check_result_dtype("onednn.dot", a.dtype, out_dtype)
    batch = a.shape[:-2]
    m = a.shape[-1] if trans_a else a.shape[-2]
    n = b.shape[-2] if trans_b else b.shape[-1]
    large = math.prod((*a.shape, n)) >= ATEN_MIN_MACS
    if a.dtype == jnp.bfloat16 and jnp.dtype(out_dtype) == jnp.bfloat16 and large and _ATEN_WANTED[0]:
        _load_aten()  # before the product runs: the kernel hands it to PyTorch's oneDNN where built
    if len(batch) > 1:
        a, b = a.reshape(math.prod(batch), *a.shape[-2:]), b.reshape(math.prod(batch), *b.shape[-2:])
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct((*a.shape[:-2], m, n), out_dtype), vmap_method="sequential")
    return call(a, b, trans_a=np.int64(trans_a), trans_b=np.int64(trans_b)).reshape(*batch, m, n)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def dot(a: jax.Array, b: jax.Array, trans_b: bool = False, out_dtype=None) -> jax.Array:
    """`a [..., M, K] @ b [..., K, N]` (or `a @ b.T` for `b [..., N, K]` with `trans_b`) by oneDNN, as `out_dtype`
    (None: the operands' dtype); leading axes, the same in both operands, index a batch of independent products
    (attention's heads).

    `a` and `b` are both bfloat16 or both float32 (the kernel checks); `out_dtype` is bfloat16 or float32 for
    bfloat16 operands, float32 for float32 ones, and the accumulation is float32 either way. Differentiable in both
    operands (see the module docstring)."""
    return _call(a, b, False, trans_b, a.dtype if out_dtype is None else out_dtype)


def _dot_fwd(a, b, trans_b, out_dtype):
    return dot(a, b, trans_b, out_dtype), (a, b)


def _dot_bwd(trans_b, out_dtype, residuals, g):
    a, b = residuals
    g = g.astype(a.dtype)
    if trans_b:  # out = a @ b.T: da = g @ b, db = g.T @ a
        return _call(g, b, False, False, a.dtype), _call(g, a, True, False, b.dtype)
    return _call(g, b, False, True, a.dtype), _call(a, g, True, False, b.dtype)  # da = g @ b.T, db = a.T @ g


dot.defvjp(_dot_fwd, _dot_bwd)


def cache_write(
    cache: jax.Array, update: jax.Array, index: jax.Array, layer, keys_transposed: bool, rows: jax.Array | None = None
) -> jax.Array:
    """`update [R, T, K, Dh]` written into rows `rows [R]` (default `0..R-1`) of a KV cache at per-row positions
    `index [R, T]`, in place: one layer's `cache [B, K, Dh, S]` (keys, stored transposed: `keys_transposed`) or
    `[B, K, S, Dh]` (values), `cache[rows[i], :, :, index[i, t]] = update[i, t]` (`[rows[i], :, index[i, t], :]` for
    values), or layer `layer` of a stacked cache `[L, B, K, ...]` (`layer` is ignored for one layer's). Positions
    outside `[0, S)` are dropped, as `.at[...].set(mode="drop")` drops them (callers give no negative ones), and so
    are rows outside `[0, B)` and a layer outside `[0, L)`.

    For a bfloat16 cache on a CPU (`decoder.cache_dtype`): XLA:CPU widens a bfloat16 scatter's or
    dynamic-update-slice's whole operand to float32 and narrows it back, the whole cache at every decode step; the
    kernel copies the written positions' bits and nothing else. The result aliases `cache` (donate it, or XLA copies
    it first). No gradient (decoding only)."""
    _require_kernel()
    call = jax.ffi.ffi_call(
        CACHE_WRITE_TARGET, jax.ShapeDtypeStruct(cache.shape, cache.dtype), input_output_aliases={0: 0}
    )
    rows = jnp.arange(update.shape[0], dtype=jnp.int32) if rows is None else jnp.asarray(rows, jnp.int32)
    index, layer = jnp.asarray(index, jnp.int32), jnp.asarray(layer, jnp.int32)
    return call(cache, update.astype(cache.dtype), index, rows, layer, keys_transposed=np.int64(keys_transposed))


def cache_dot(a: jax.Array, cache: jax.Array, length: int, keys: bool, out_dtype=None) -> jax.Array:
    """`a` times the first `length` positions of one layer's KV cache, by oneDNN reading them where they lie:
    `a [..., M, Dh] @ cache[..., :, :length]` for the keys' `cache [..., Dh, S]` (`keys`; the result `[..., M,
    length]`), `a [..., M, length] @ cache[..., :length, :]` for the values' `cache [..., S, Dh]` (`[..., M, Dh]`).

    The same product as `dot(a, <that prefix>)`, without the prefix's copy: XLA materialises a slice that feeds a
    custom call, and in a float32 decode step of SmolLM2-135M (32 rows attending to 128 of 256 cache positions,
    2-core AMD EPYC with AVX2) those copies took as long as attention's products themselves
    (`benchmarks/bench_decode_step.py --prefix-reads`). Leading axes, the same in both operands, index a batch of
    products (batch and KV head). `a` and `cache` share one dtype (bfloat16 or float32), `out_dtype` as in `dot`. No
    gradient (decoding only).
    """
    _require_kernel()
    out_dtype = a.dtype if out_dtype is None else jnp.dtype(out_dtype)
    rows, cols = cache.shape[-2:]
    used = (rows, length) if keys else (length, cols)
    if (
        a.ndim != cache.ndim
        or a.ndim < 2
        or a.shape[:-2] != cache.shape[:-2]
        or a.shape[-1] != used[0]
        or not 0 < length <= (cols if keys else rows)
    ):
        raise ValueError(f"onednn.cache_dot: {a.shape} @ the first {length} positions of the cache {cache.shape}")
    _check_result_dtype("onednn.cache_dot", a.dtype, out_dtype)
    batch, m = a.shape[:-2], a.shape[-2]
    a, cache = a.reshape(math.prod(batch), *a.shape[-2:]), cache.reshape(math.prod(batch), rows, cols)
    out = jax.ShapeDtypeStruct((a.shape[0], m, used[1]), out_dtype)
    call = jax.ffi.ffi_call(CACHE_MATMUL_TARGET, out, vmap_method="sequential")
    return call(a, cache, keys_transposed=np.int64(keys)).reshape(*batch, m, used[1])


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def dot_cast(a: jax.Array, w: jax.Array, dtype) -> jax.Array:
    """`a [M, K] @ w [K, N]` by oneDNN, `w` (float32) cast to `dtype` for the product: `dot(a, w.astype(dtype))`
    with `a` in `dtype`, the result in `dtype`.

    The difference is the gradient of `w`: `dot`'s is the product's cotangent in `dtype`, which the cast's
    transpose widens again, so it is rounded to `dtype` on the way; here the kernel writes it in float32 from its
    float32 accumulator. In a layer scan XLA:CPU then stores each layer's weight gradient without a conversion
    (a rounding it ran slowly, element by element, in every layer), and the stack needs no widening at the end:
    a bfloat16 forward+backward pass of SmolLM2-135M over float32 weights (8 x 256 tokens, the 2-core AMX Xeon)
    ran 1.07x faster (`benchmarks/bench_bf16_step.py`), with a weight gradient closer to the float32 one.
    """
    return _call(a, w.astype(dtype), False, False, dtype)


def _dot_cast_fwd(a, w, dtype):
    return dot_cast(a, w, dtype), (a, w)


def _dot_cast_bwd(dtype, residuals, g):
    a, w = residuals
    g = g.astype(a.dtype)
    return _call(g, w.astype(dtype), False, True, a.dtype), _call(a, g, True, False, jnp.float32)


dot_cast.defvjp(_dot_cast_fwd, _dot_cast_bwd)


def main(argv: list[str] | None = None) -> int:
    """`python -m feynrl_jax.kernels.onednn build [--required]`: compiles the kernel. Without `--required` a machine
    that cannot build it (no compiler, no oneDNN) is told so and the exit status is 0: XLA runs every product."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] != "build" or set(argv[1:]) - {"--required"}:
        print("usage: python -m feynrl_jax.kernels.onednn build [--required]", file=sys.stderr)
        return 2
    try:
        path = build()
    except RuntimeError as error:
        print(f"oneDNN kernel not built: {error}", file=sys.stderr)
        return 1 if "--required" in argv else 0
    loaded, why = _load()
    if not loaded:
        print(f"oneDNN kernel built at {path} but {why}", file=sys.stderr)
        return 1
    units = ", ".join(cpu_bf16_units()) or "none (model.cpu_matmul='auto' keeps XLA for bfloat16)"
    bf16 = "PyTorch's oneDNN (ATen)" if aten_built() else "the onednn-cpu-gomp wheel's oneDNN 3.2 (no PyTorch)"
    print(f"oneDNN kernel built: {path}; bf16 products in {bf16}; this CPU's bf16 matrix instructions: {units}")
    for line in measure_auto():
        print(line)
    return 0


def measure_auto() -> list[str]:
    """Takes "auto"'s measurements for this machine now (`auto_choice`: each dtype it applies to, a training step's
    products and a decode step's) where none is stored; returns a line for each.

    `build` (and so `make setup`) runs it where the machine is otherwise idle, so that runs read a verdict instead of
    measuring while their other processes start: on a 2-core AMD EPYC a GRPO run that measured at start-up, while its
    other processes compiled, found oneDNN's decode products no faster than XLA's at 8 rows (32.5 against 32.3 ms),
    where the idle machine measured them 1.6-1.9x faster. The records hold for processes with the same
    `_machine_key`: the same CPUs and OpenMP threads (`_openmp_threads`).
    """
    lines = []
    for dtype in KERNEL_DTYPES:
        if not auto_applies(dtype):
            continue
        for one_token, kind in ((False, "training"), (True, "decode")):
            record = auto_choice(dtype, one_token)
            backend = "oneDNN" if record["onednn"] else "XLA"
            lines.append(f"model.cpu_matmul='auto', {dtype.name} {kind} products: {backend} ({describe(record)})")
    return lines


def describe(record: dict) -> str:
    """What an `auto_choice` record measured, for a log line: the speed ratio, or why it could not be timed."""
    if "error" in record:
        return f"oneDNN could not be timed: {record['error']}"
    return f"oneDNN measured at {record['xla_s'] / record['onednn_s']:.2f}x XLA's speed here"


if __name__ == "__main__":
    sys.exit(main())
