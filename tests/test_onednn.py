"""The oneDNN matmul kernel (`feynrl_jax/kernels/onednn.py`, bfloat16 and float32) and the `model.cpu_matmul` switch.

Tolerances come from the arithmetic, never from this CPU: oneDNN multiplies bfloat16 or float32 operands exactly
and accumulates in float32, then rounds the result to the output dtype. Against a float64 product of the same
operands the error is at most the output rounding `U |ref|` (U = 2^-8 for bfloat16, 2^-24 for float32) plus the
float32 accumulation error `K 2^-24 (|a| @ |b|)` (Higham, "Accuracy and Stability of Numerical Algorithms", 2002,
eq. 3.5, with the first-order bound K u). Gradients are such products of the cotangent rounded to the operands'
dtype (one more U of that dtype relative to the cotangent).

The model-level checks (the switch reaches the compiled step, "auto" resolves by the CPU and a measurement, the bfloat16
and float32 steps are as close to float64 as XLA's own steps, a float32 decode step follows its own measurement) run in
a subprocess with one CPU device: the kernel is refused where JAX has several devices, as this test process has
(conftest's 8 fake devices).

On a CPU with neither bf16 instructions nor AVX-512 (AVX2 only) the kernel's oneDNN 3.2 has no bfloat16 matmul, so the
model never sends it one (`onednn.bf16_products_here`); the bfloat16 product tests are skipped there, with the reason,
and `test_an_avx2_cpu_gets_no_bf16_products` checks the rule and, on such a CPU, that the kernel indeed fails.
"""

from __future__ import annotations

import ctypes
import functools
import importlib.metadata
import importlib.util
import json
import os
import pathlib
import shutil
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from feynrl_jax.config.errors import ConfigError
from feynrl_jax.config.validation import validate
from feynrl_jax.kernels import onednn
from feynrl_jax.models import attention

pytestmark = pytest.mark.skipif(
    shutil.which(os.environ.get("CXX", "g++")) is None, reason="no C++ compiler: the kernel cannot be built here"
)
U_BF16, U_F32 = 2.0**-8, 2.0**-24
BF16_HERE = onednn.bf16_products_here()
needs_bf16_products = pytest.mark.skipif(
    not BF16_HERE,
    reason="oneDNN 3.2 has no bfloat16 matmul on this CPU (neither bf16 instructions nor AVX-512); the model never "
    "sends it one here (test_an_avx2_cpu_gets_no_bf16_products)",
)
BF16 = pytest.param(jnp.bfloat16, marks=needs_bf16_products, id="bfloat16")


@pytest.fixture(scope="module")
def kernel():
    """The installed kernel, built now if `make setup` has not or its source changed since (so this file tests the
    build too). Skipped where oneDNN is not installed (`make setup` installs it on x86-64 Linux)."""
    if onednn.problem():
        try:
            onednn.build()
        except RuntimeError as error:
            if "no oneDNN" in str(error) or "no libdnnl" in str(error):
                pytest.skip(str(error))
            raise
    assert onednn.problem() == ""
    return onednn


@pytest.fixture(params=["oneDNN 3.2", "ATen"])
def bf16_library(request, kernel, monkeypatch):
    """Where the kernel's bf16 products with a bf16 result run: its own oneDNN 3.2, or PyTorch's through ATen for every
    size (`ATEN_MIN_MACS` 0, so these small products reach it; checked by its call count)."""
    aten = request.param == "ATen"
    if aten:
        if importlib.util.find_spec("torch") is None or not onednn.aten_built():
            pytest.skip("PyTorch is not installed: no ATen library")
        monkeypatch.setattr(onednn, "ATEN_MIN_MACS", 0)
    assert onednn.use_aten_products(aten) == aten
    calls = onednn.aten_calls()

    def check(bf16_results: bool) -> None:
        """The test's products ran on ATen exactly where they should: bf16 products with a bf16 result, on "ATen"."""
        assert (onednn.aten_calls() > calls) == (aten and bf16_results), (request.param, bf16_results)

    yield check
    monkeypatch.undo()
    onednn.use_aten_products(True)  # as every other test finds it


def _normal(rng, shape, dtype=jnp.bfloat16):
    """Standard normal samples rounded to `dtype` (bfloat16 unless given)."""
    return jnp.asarray(rng.normal(size=shape), jnp.float32).astype(dtype)


def _f64(x):
    return np.asarray(x, np.float64)


def _t(x):
    """The transpose of the matrix axes (the last two)."""
    return np.swapaxes(x, -1, -2)


def _bound(a, b, out_dtype):
    """Elementwise error bound of `a @ b` from bf16 or float32 operands (see the module docstring)."""
    k = a.shape[-1]
    u = U_BF16 if out_dtype == jnp.bfloat16 else U_F32
    return u * np.abs(_f64(a) @ _f64(b)) + k * U_F32 * (np.abs(_f64(a)) @ np.abs(_f64(b))) + 1e-30


def test_build_writes_a_library_that_loads(tmp_path, kernel):
    path = onednn.build(tmp_path / "kernel.so", aten=False)
    assert not onednn.aten_library(path).exists()
    assert path.is_file() and not list(tmp_path.glob("*.tmp"))
    library = ctypes.CDLL(str(path))
    library.feynrl_onednn_source_hash.restype = ctypes.c_char_p
    assert library.feynrl_onednn_source_hash().decode() == onednn.source_hash()
    assert library.FeynrlOnednnMatmul
    with pytest.raises(RuntimeError, match="failed"):
        onednn.build(tmp_path / "other.so", compiler=str(tmp_path / "missing-compiler"))
    assert not list(tmp_path.glob("other*"))  # nothing half-written


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="PyTorch is not installed: no ATen library")
def test_build_writes_the_aten_library_where_pytorch_is_installed_and_removes_it_when_told_not_to(tmp_path, kernel):
    path = onednn.build(tmp_path / "kernel.so")
    aten = onednn.aten_library(path)
    assert aten == tmp_path / "kernel_aten.so" and aten.is_file()
    library = ctypes.CDLL(str(aten))
    library.feynrl_aten_source_hash.restype = ctypes.c_char_p
    library.feynrl_aten_torch_version.restype = ctypes.c_char_p
    assert library.feynrl_aten_source_hash().decode() == onednn.source_hash()
    assert library.feynrl_aten_torch_version().decode() == importlib.metadata.version("torch")
    assert library.feynrl_aten_matmul
    onednn.build(path, aten=False)  # a kernel without it leaves no stale one beside it
    assert path.is_file() and not aten.exists() and not list(tmp_path.glob("*.tmp"))


_ATEN_ROUTING = textwrap.dedent(
    """
    import json
    import jax, jax.numpy as jnp, numpy as np
    from feynrl_jax.kernels import onednn

    def torch_loaded():
        with open("/proc/self/maps") as maps:
            return "libtorch_cpu" in maps.read()

    def within(out, a, b):  # the float64 bound of a bf16 result
        a64, b64 = np.asarray(a, np.float64), np.asarray(b, np.float64)
        ref = a64 @ b64
        bound = 2.0**-8 * np.abs(ref) + a64.shape[1] * 2.0**-24 * (np.abs(a64) @ np.abs(b64))
        return bool((np.abs(np.asarray(out, np.float64) - ref) <= bound).all())

    rng = np.random.default_rng(0)
    # [1024, 512] @ [512, 1024]: ATEN_MIN_MACS multiply-adds exactly; [64, 96] @ [96, 80]: far fewer
    a32, b32 = rng.normal(size=(1024, 512)).astype(np.float32), rng.normal(size=(512, 1024)).astype(np.float32)
    a, b = jnp.asarray(a32, jnp.bfloat16), jnp.asarray(b32, jnp.bfloat16)
    out = {"built": onednn.aten_built(), "threshold": 1024 * 512 * 1024 == onednn.ATEN_MIN_MACS}
    jax.block_until_ready(jax.jit(lambda a, b: onednn.dot(a, b))(a32, b32))
    jax.block_until_ready(jax.jit(lambda a, b: onednn.dot(a, b, out_dtype=jnp.float32))(a, b))
    out["after_float32_results"] = torch_loaded()
    small = jax.jit(lambda a, b: onednn.dot(a, b))(a[:64, :96], b[:96, :80])
    out["after_small_bf16"] = torch_loaded()
    out["small_within"] = within(small, a[:64, :96], b[:96, :80])
    f = jax.jit(lambda a, b: onednn.dot(a, b))
    calls = onednn.aten_calls()
    on_aten = f(a, b)
    out["after_large_bf16"] = torch_loaded()
    out["ran_on_aten"] = onednn.aten_calls() == calls + 1
    out["handed_back"] = onednn.use_aten_products(False)  # the same program, the kernel's own oneDNN
    on_own = f(a, b)
    retraced = jax.jit(lambda a, b: onednn.dot(a, b) + 0)(a, b)  # staging a new large product keeps it there
    out["stayed_off"] = onednn.aten_calls() == calls + 1
    out["handed_again"] = onednn.use_aten_products(True)
    out["aten_within"], out["own_within"] = within(on_aten, a, b), within(on_own, a, b)
    print("RESULT " + json.dumps(out))
    """
)


@needs_bf16_products
@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="PyTorch is not installed: no ATen library")
def test_only_bf16_products_load_pytorch_and_both_backends_are_within_the_bound(kernel):
    # A fresh process (this one may have imported torch): float32 products, bf16 ones with a float32 result and small
    # bf16 ones never load libtorch_cpu; the first bf16 product of ATEN_MIN_MACS with a bf16 result does, and runs
    # there. The same compiled program, handed back to the kernel's own oneDNN 3.2, gives a result within the same
    # float64 bound.
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=1", JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-c", _ATEN_ROUTING], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("RESULT "))[7:])
    assert result == {
        "built": True,
        "threshold": True,
        "after_float32_results": False,
        "after_small_bf16": False,
        "small_within": True,
        "after_large_bf16": True,
        "ran_on_aten": True,
        "handed_back": False,
        "stayed_off": True,
        "handed_again": True,
        "aten_within": True,
        "own_within": True,
    }


# A 2-D product, and batched ones (attention's per-head products) with one and two batch axes.
BATCHES = [(), (3,), (2, 3)]


@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize("trans_b", [False, True])
# float32 operands give a float32 result only (test_kernel_refuses_mismatched_operands).
@pytest.mark.parametrize(
    ("in_dtype", "out_dtype"),
    [
        pytest.param(jnp.bfloat16, jnp.bfloat16, marks=needs_bf16_products, id="bfloat16-bfloat16"),
        pytest.param(jnp.bfloat16, jnp.float32, marks=needs_bf16_products, id="bfloat16-float32"),
        (jnp.float32, jnp.float32),
    ],
)
def test_dot_against_float64(bf16_library, in_dtype, out_dtype, trans_b, batch):
    rng = np.random.default_rng(0)
    a = _normal(rng, (*batch, 37, 96), in_dtype)
    b = _normal(rng, (*batch, 53, 96) if trans_b else (*batch, 96, 53), in_dtype)
    out = jax.jit(lambda a, b: onednn.dot(a, b, trans_b, out_dtype))(a, b)
    assert out.dtype == out_dtype and out.shape == (*batch, 37, 53)
    bm = _t(b) if trans_b else b
    error = np.abs(_f64(out) - _f64(a) @ _f64(bm))
    assert (error <= _bound(a, bm, out_dtype)).all(), error.max()
    bf16_library(in_dtype == out_dtype == jnp.bfloat16)


@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize("trans_b", [False, True])
@pytest.mark.parametrize("dtype", [BF16, jnp.float32])
def test_dot_gradients_against_float64(bf16_library, dtype, trans_b, batch):
    rng = np.random.default_rng(1)
    a, w = _normal(rng, (*batch, 24, 40), dtype), rng.normal(size=(*batch, 24, 32))
    b = _normal(rng, (*batch, 32, 40) if trans_b else (*batch, 40, 32), dtype)

    def loss(a, b):
        return jnp.sum(onednn.dot(a, b, trans_b, jnp.float32) * jnp.asarray(w, jnp.float32))

    da, db = jax.jit(jax.grad(loss, argnums=(0, 1)))(a, b)
    assert da.dtype == dtype and db.dtype == dtype
    assert da.shape == a.shape and db.shape == b.shape
    g = _f64(jnp.asarray(w, jnp.float32).astype(dtype))  # the cotangent, rounded to the operands' dtype by the VJP
    bm = _t(_f64(b)) if trans_b else _f64(b)  # out = a @ bm
    aw, u = np.abs(w), U_BF16 if dtype == jnp.bfloat16 else U_F32
    # da = g @ bm.T, db = a.T @ g (or g.T @ a for the transposed b): the cotangent's rounding (u relative to |w|,
    # w itself float64 here) plus the product's own bound (the gradients are rounded to the operands' dtype).
    ref_da, bound_da = g @ _t(bm), u * (aw @ np.abs(_t(bm))) + _bound(g, _t(bm), dtype)
    left, right = (_t(g), _f64(a)) if trans_b else (_t(_f64(a)), g)
    aw_left, aw_right = (_t(aw), np.abs(_f64(a))) if trans_b else (_t(np.abs(_f64(a))), aw)
    ref_db, bound_db = left @ right, u * (aw_left @ aw_right) + _bound(left, right, dtype)
    assert (np.abs(_f64(da) - ref_da) <= bound_da).all()
    assert (np.abs(_f64(db) - ref_db) <= bound_db).all()
    bf16_library(dtype == jnp.bfloat16)  # the gradient products give bf16 results


@needs_bf16_products
def test_dot_cast_is_dot_of_the_cast_weight_with_a_float32_weight_gradient(bf16_library):
    """`onednn.dot_cast(a, w, bf16)` (a float32 `w`): the product and `a`'s gradient bit for bit `dot`'s of
    `w.astype(bf16)`; `w`'s gradient float32, within the kernel's float32 accumulation bound of the float64
    `a.T @ g` (K U relative to `|a|.T @ |g|`, g the cotangent rounded to bf16 as `dot`'s VJP rounds it), where
    `dot`'s own is that product rounded to bfloat16 (it fails the same bound, so the check tells them apart)."""
    rng = np.random.default_rng(3)
    a, w, cot = _normal(rng, (48, 64)), jnp.asarray(rng.normal(size=(64, 40)), jnp.float32), rng.normal(size=(48, 40))

    def loss(product):
        return lambda a, w: jnp.sum(product(a, w).astype(jnp.float32) * jnp.asarray(cot, jnp.float32))

    cast = jax.jit(jax.value_and_grad(loss(lambda a, w: onednn.dot_cast(a, w, jnp.bfloat16)), argnums=(0, 1)))
    plain = jax.jit(
        jax.value_and_grad(
            loss(lambda a, w: onednn.dot(a, w.astype(jnp.bfloat16), False, jnp.bfloat16)), argnums=(0, 1)
        )
    )
    (out_c, (da_c, dw_c)), (out_p, (da_p, dw_p)) = cast(a, w), plain(a, w)
    assert dw_c.dtype == jnp.float32 and da_c.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(out_c), np.asarray(out_p))
    np.testing.assert_array_equal(np.asarray(da_c, np.float32), np.asarray(da_p, np.float32))
    g = _f64(jnp.asarray(cot, jnp.float32).astype(jnp.bfloat16))
    ref = _t(_f64(a)) @ g
    bound = 64 * U_F32 * (np.abs(_t(_f64(a))) @ np.abs(g)) + 1e-30
    assert (np.abs(_f64(dw_c) - ref) <= bound).all()
    assert not (np.abs(_f64(dw_p) - ref) <= bound).all()  # rounded to bfloat16: outside the float32 bound
    bf16_library(True)  # the product and `a`'s gradient give bf16 results


@pytest.mark.parametrize("cache", ["whole", "prefix"])
@pytest.mark.parametrize("dtype", [BF16, jnp.float32])
def test_attention_products_in_onednn_against_float64(bf16_library, dtype, cache):
    """`attention.attend` with its two products in oneDNN, against float64 attention of the same inputs.

    "prefix": the keys and values are the first positions of a longer cache (`length`, a decode step's `attend_len`),
    whose later positions hold NaN: oneDNN reads a float32 prefix where it lies (`onednn.cache_dot`, no copy) and
    nothing past it, so the bound below holds unchanged. XLA's products, and oneDNN's bfloat16 ones, read a copy of
    the prefix: the same values as attending to the unpadded arrays.

    bfloat16: the pass rounds the scaled queries to bfloat16 (as XLA's bfloat16 pass does; the reference starts from
    the same rounded values), the probabilities to bfloat16 before the second product (U relative to each term of
    `P @ |V|`) and the output to bfloat16 (U relative); the float32 scores and sums add terms below 2^-16 relative
    at these sizes. The bound is twice the first two.

    float32: nothing is rounded to a narrower type. A score's error is at most its accumulation bound
    `e = Dh U (|q| @ |k|)`, plus its rounding and that of subtracting the row's max (3 U of the row's largest
    score); a softmax of scores each off by at most `max e` has every probability
    off by a factor within `exp(+-2 max e)`, and exp, the sum over S keys and the division add `(S + 3) U` relative;
    the second product adds `S U` relative to `P @ |V|` and the output rounding U relative to it. With `2 max e` far
    below 1, `exp(2 max e) - 1 <= 4 max e`."""
    rng = np.random.default_rng(2)
    b, t, h, kv, dh = 2, 24, 4, 2, 32
    q, k, v = (
        _normal(rng, (b, t, h, dh), dtype),
        _normal(rng, (b, kv, dh, t), dtype),
        _normal(rng, (b, kv, t, dh), dtype),
    )
    mask = jnp.asarray(np.tril(np.ones((t, t), bool))[None].repeat(b, 0))
    length, kc, vc = None, k, v  # the cache attended to
    if cache == "prefix":  # 8 more positions of NaN after the t attended
        length = t
        kc = jnp.concatenate([k, jnp.full((b, kv, dh, 8), jnp.nan, dtype)], axis=3)
        vc = jnp.concatenate([v, jnp.full((b, kv, 8, dh), jnp.nan, dtype)], axis=2)
        xla = jax.jit(lambda *a: attention.attend(*a, False))(q, k, v, mask)
        prefix = jax.jit(lambda *a: attention.attend(*a, False, length))(q, kc, vc, mask)
        np.testing.assert_array_equal(np.asarray(prefix, np.float32), np.asarray(xla, np.float32))
    text = jax.jit(lambda *a: attention.attend(*a, True, length)).lower(q, kc, vc, mask).as_text()
    in_place = length is not None and dtype == jnp.float32
    assert (text.count(onednn.TARGET), text.count(onednn.CACHE_MATMUL_TARGET)) == ((0, 2) if in_place else (2, 0))
    text = jax.jit(lambda *a: attention.attend(*a, False, length)).lower(q, kc, vc, mask).as_text()
    assert text.count(onednn.TARGET) == text.count(onednn.CACHE_MATMUL_TARGET) == 0
    out = jax.jit(lambda *a: attention.attend(*a, True, length))(q, kc, vc, mask)
    assert out.dtype == dtype
    out = _f64(out)
    # float64 reference: query head `i` uses KV head `i // (h / kv)`.
    q_scaled = _f64(q * jnp.asarray(dh**-0.5, dtype))
    heads = np.arange(h) // (h // kv)
    scores = np.einsum("bthd,bhds->bhts", q_scaled, _f64(k)[:, heads])
    scores = np.where(np.asarray(mask)[:, None], scores, -np.inf)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    ref = np.einsum("bhts,bhsd->bthd", probs, _f64(v)[:, heads])
    spread = np.einsum("bhts,bhsd->bthd", probs, np.abs(_f64(v)[:, heads]))
    if dtype == jnp.bfloat16:
        bound = 2 * U_BF16 * (spread + np.abs(ref))
    else:
        score_error = dh * U_F32 * np.einsum("bthd,bhds->bhts", np.abs(q_scaled), np.abs(_f64(k))[:, heads])
        finite = np.abs(np.where(np.isfinite(scores), scores, 0))
        score_error += 3 * U_F32 * finite.max(-1, keepdims=True)  # rounding, and the max's shift (|s - max| <= 2 max)
        worst = score_error.max(-1).transpose(0, 2, 1)[..., None]  # [b, t, h, 1]: over each row's keys
        assert worst.max() < 0.1  # where exp(2 e) - 1 <= 4 e holds with room to spare
        bound = (4 * worst + (2 * t + 3) * U_F32) * spread + U_F32 * np.abs(ref)
    assert (np.abs(out - ref) <= bound).all(), np.abs(out - ref).max()
    bf16_library(dtype == jnp.bfloat16)  # probabilities times values: a bf16 result


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bfloat16", "float32"])
@pytest.mark.parametrize("keys", [True, False], ids=["keys", "values"])
def test_cache_write_is_the_scatter_it_replaces(kernel, dtype, keys):
    """`onednn.cache_write` is, bit for bit, the scatter `forward` wrote the cache with (`.at[...].set`, mode "drop"):
    a stacked cache's layer (a layer outside the stack writes nothing) and one layer's cache, several tokens per
    row, positions at both ends and out of range (dropped), rows chosen (the engine's slot inserts; a row outside the
    cache dropped), with the cache donated (written in place) or not (XLA copies it for the aliased result)."""
    rng = np.random.default_rng(0)
    layers, batch, heads, head_dim, length = 3, 4, 2, 8, 16
    shape = (layers, batch, heads, head_dim, length) if keys else (layers, batch, heads, length, head_dim)
    cache = jnp.asarray(rng.normal(size=shape), dtype)
    update = jnp.asarray(rng.normal(size=(batch, 3, heads, head_dim)), dtype)
    index = jnp.asarray([[0, 5, 15], [16, 3, 2], [7, 8, 9], [1, 99, 14]], jnp.int32)  # 16 and 99: dropped
    rows = jnp.arange(batch)[:, None]

    def scatter(cache, at):
        where = (*at, rows, slice(None), slice(None), index) if keys else (*at, rows, slice(None), index)
        return np.asarray(cache.at[where].set(update, mode="drop"))

    write = jax.jit(functools.partial(onednn.cache_write, keys_transposed=keys))
    donated = jax.jit(functools.partial(onednn.cache_write, keys_transposed=keys), donate_argnums=0)
    for layer in (0, 2, 3):
        want = scatter(cache, (layer,))
        assert (want != np.asarray(cache)).any() == (layer < layers)
        np.testing.assert_array_equal(np.asarray(write(cache, update, index, layer)), want)
        np.testing.assert_array_equal(np.asarray(donated(jnp.copy(cache), update, index, layer)), want)
    one = cache[1]
    np.testing.assert_array_equal(np.asarray(donated(jnp.copy(one), update, index, 0)), scatter(one, ()))
    # into chosen rows: update row i into cache row rows[i]; a row outside the cache is dropped
    rows = jnp.asarray([2, 0, 7, 3], jnp.int32)
    where = (rows[:, None], slice(None), slice(None), index) if keys else (rows[:, None], slice(None), index)
    want = np.asarray(one.at[where].set(update, mode="drop"))
    np.testing.assert_array_equal(np.asarray(donated(jnp.copy(one), update, index, 0, rows=rows)), want)
    with pytest.raises(Exception, match="cache_write: the shapes of cache, update and index do not agree"):
        jax.block_until_ready(write(cache, update[:, :2], index, 0))


@pytest.mark.parametrize("length", [1, 13, 24])
@pytest.mark.parametrize(
    ("in_dtype", "out_dtype"),
    [
        pytest.param(jnp.bfloat16, jnp.bfloat16, marks=needs_bf16_products, id="bfloat16-bfloat16"),
        pytest.param(jnp.bfloat16, jnp.float32, marks=needs_bf16_products, id="bfloat16-float32"),
        (jnp.float32, jnp.float32),
    ],
)
def test_cache_dot_multiplies_the_first_positions_where_they_lie(kernel, in_dtype, out_dtype, length):
    """`onednn.cache_dot`: `a` times the first `length` of S = 24 positions of a cache's keys `[B, K, Dh, S]` and
    values `[B, K, S, Dh]` (batch and KV head leading), against float64 (`_bound`). The positions after `length` hold
    NaN: a product that read one would be NaN. `length = S` is the whole cache. Shapes that do not fit are refused."""
    rng = np.random.default_rng(3)
    batch, dh, s = (3, 2), 16, 24
    keys = np.array(_normal(rng, (*batch, dh, s), in_dtype), np.float32)
    values = np.array(_normal(rng, (*batch, s, dh), in_dtype), np.float32)
    keys[..., length:], values[..., length:, :] = np.nan, np.nan
    keys, values = jnp.asarray(keys, in_dtype), jnp.asarray(values, in_dtype)
    q, probs = _normal(rng, (*batch, 5, dh), in_dtype), _normal(rng, (*batch, 5, length), in_dtype)
    for a, cache, is_keys in ((q, keys, True), (probs, values, False)):
        prefix = cache[..., :length] if is_keys else cache[..., :length, :]
        out = jax.jit(lambda a, c, k=is_keys: onednn.cache_dot(a, c, length, k, out_dtype))(a, cache)
        assert out.dtype == out_dtype and out.shape == (*batch, 5, length if is_keys else dh)
        error = np.abs(_f64(out) - _f64(a) @ _f64(prefix))
        assert (error <= _bound(a, prefix, out_dtype)).all(), (is_keys, error.max())
    with pytest.raises(ValueError, match="the first 25 positions of the cache"):
        onednn.cache_dot(q, keys, 25, True, out_dtype)
    with pytest.raises(ValueError, match=r"the first 7 positions of the cache"):
        onednn.cache_dot(probs, values, 7, False, out_dtype)  # probs has `length` columns, not 7


def test_kernel_refuses_mismatched_operands(kernel):
    a = jnp.ones((4, 8), jnp.bfloat16)
    with pytest.raises(Exception, match="onednn_matmul: operands must both be bf16 or f32"):
        jax.block_until_ready(onednn._call(a, jnp.ones((8, 4), jnp.float32), False, False, jnp.float32))
    with pytest.raises(ValueError, match="float32 operands give a float32 result, not bfloat16"):
        onednn.dot(jnp.ones((4, 8)), jnp.ones((8, 4)), False, jnp.bfloat16)
    assert onednn.dot(jnp.ones((4, 8)), jnp.ones((8, 4))).dtype == jnp.float32  # the operands' dtype by default
    empty = onednn.dot(jnp.ones((2, 3, 0, 8), jnp.bfloat16), jnp.ones((2, 3, 8, 4), jnp.bfloat16))
    assert empty.shape == (2, 3, 0, 4)
    with pytest.raises(ValueError, match="same batch axes"):
        onednn.dot(jnp.ones((2, 4, 8), jnp.bfloat16), jnp.ones((3, 8, 4), jnp.bfloat16))


def test_switch_resolution_in_this_multi_device_process(kernel):
    assert jax.device_count() > 1  # conftest
    for dtype in (jnp.bfloat16, jnp.float32):
        assert onednn.use_onednn("auto", dtype) is False  # several devices: XLA
        assert onednn.use_onednn("xla", dtype) is False
        # (bfloat16 on an AVX2-only CPU is refused for the CPU first: test_an_avx2_cpu_gets_no_bf16_products)
        why = "the job has 8 devices" if BF16_HERE or dtype == jnp.float32 else "this CPU has neither bf16 instructions"
        with pytest.raises(ValueError, match=f"model.cpu_matmul='onednn' cannot run: {why}"):
            onednn.use_onednn("onednn", dtype)
    assert not any(onednn.use_onednn(backend, jnp.float16) for backend in ("auto", "onednn"))  # no such kernel


def test_a_library_built_from_another_source_is_not_loaded(kernel, monkeypatch):
    monkeypatch.setattr(onednn, "source_hash", lambda: "0" * 16)
    onednn._load.cache_clear()
    try:
        assert "built from another version of onednn_matmul.cc" in onednn.problem()
        assert onednn.use_onednn("auto", jnp.bfloat16) is False
    finally:
        monkeypatch.undo()
        onednn._load.cache_clear()
    assert onednn.problem() == ""


FAST_ONEDNN = {"onednn_s": 1.0, "xla_s": 2.0, "onednn": True}
"""A record of oneDNN twice as fast as XLA."""


def decode_record(record: dict) -> dict:
    """`record` as a decode step's (`auto_choice(..., one_token=True)`): its times split over AUTO_DECODE_ROWS."""
    share = {k: record[k] / len(onednn.AUTO_DECODE_ROWS) for k in ("onednn_s", "xla_s")}
    return {**record, "by_rows": {str(rows): share for rows in onednn.AUTO_DECODE_ROWS}}


def fast(one_token: bool = False) -> dict:
    """`FAST_ONEDNN` as a training step's record or a decode step's."""
    return decode_record(FAST_ONEDNN) if one_token else dict(FAST_ONEDNN)


def test_build_takes_autos_measurements_where_none_is_stored(kernel, auto_cache, monkeypatch, capsys):
    # `python -m feynrl_jax.kernels.onednn build` measures every kind "auto" applies to here (the build itself is the
    # installed library's, tested above), prints each, and a run's process with the same OpenMP threads reads them.
    monkeypatch.setattr(onednn, "build", lambda: onednn.LIBRARY)
    monkeypatch.setattr(jax, "device_count", lambda: 1)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    measured = []
    monkeypatch.setattr(
        onednn, "_measure", lambda dtype, one_token=False: measured.append((dtype, one_token)) or fast(one_token)
    )
    assert onednn.main(["build"]) == 0
    kinds = [(dtype, one_token) for dtype in ("bfloat16", "float32") for one_token in (False, True)]
    want = [kind for kind in kinds if kind[0] == "float32" or onednn.cpu_bf16_units()]
    assert measured == want
    printed = capsys.readouterr().out
    for dtype, one_token in want:
        assert f"{dtype} {'decode' if one_token else 'training'} products: oneDNN (oneDNN measured at 2.00x" in printed
    assert set(json.loads(auto_cache.read_text())) == {onednn._record_key(*kind) for kind in want}
    # A run's Ray actor on this machine (Ray's OMP_NUM_THREADS=1 replaced by the driver's, here unset) has the same
    # key: nothing is measured again.
    from feynrl_jax.orchestration import runtime

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv(runtime.DRIVER_OMP_THREADS, "")
    runtime.openmp_threads_from_cores()
    onednn._auto_choice.cache_clear()
    assert onednn.measure_auto() and measured == want
    # Other threads (more than this process may use, so also other on a 1-CPU machine): other keys, every kind
    # measured again for itself.
    monkeypatch.setenv("OMP_NUM_THREADS", str(len(os.sched_getaffinity(0)) + 1))
    onednn._auto_choice.cache_clear()
    assert not {onednn._record_key(*kind) for kind in want} & set(json.loads(auto_cache.read_text()))
    onednn.measure_auto()
    assert measured == want + want


def test_an_avx2_cpu_gets_no_bf16_products(kernel, auto_cache, monkeypatch):
    if not BF16_HERE:  # this CPU is one: its oneDNN 3.2 indeed has no bfloat16 matmul (why the rule exists)
        onednn.use_aten_products(False)
        try:
            with pytest.raises(jax.errors.JaxRuntimeError, match="could not create a primitive descriptor"):
                jax.block_until_ready(onednn.dot(jnp.ones((8, 16), jnp.bfloat16), jnp.ones((16, 4), jnp.bfloat16)))
        finally:
            onednn.use_aten_products(True)
    # On a CPU with neither bf16 instructions nor AVX-512, "auto" never times nor takes the kernel for bfloat16, in a
    # training pass or a decode step, whatever a stored record says, and "onednn" is refused for it; float32 is
    # unaffected.
    monkeypatch.setattr(onednn, "_cpu_flags", lambda: frozenset({"avx2", "fma"}))
    monkeypatch.setattr(jax, "device_count", lambda: 1)
    stored = {
        onednn._record_key("bfloat16"): FAST_ONEDNN,
        onednn._record_key("bfloat16", True): decode_record(FAST_ONEDNN),
    }
    auto_cache.write_text(json.dumps(stored))

    def measure(dtype, one_token=False):
        assert dtype == "float32", "bfloat16 timed on a CPU without bfloat16 products"
        return fast(one_token)

    monkeypatch.setattr(onednn, "_measure", measure)
    assert not onednn.bf16_products_here()
    assert not onednn.auto_applies(jnp.bfloat16) and onednn.auto_applies(jnp.float32)
    for one_token in (False, True):
        assert not onednn.use_onednn("auto", jnp.bfloat16, one_token=one_token)
        assert onednn.use_onednn("auto", jnp.float32, one_token=one_token)  # the (patched) measurement decides
        with pytest.raises(ValueError, match="neither bf16 instructions nor AVX-512"):
            onednn.use_onednn("onednn", jnp.bfloat16, one_token=one_token)
    assert all("float32" in line for line in onednn.measure_auto())


def test_trainers_log_the_backend_and_refuse_onednn_on_several_devices():
    from feynrl_jax.models.config import ModelConfig
    from feynrl_jax.train import run_setup

    line = run_setup.log_compute(ModelConfig(compute_dtype="bfloat16", cpu_matmul="auto", remat="auto"))
    assert "matrix products by XLA; decode steps' products by XLA" in line and "remat 'full'" in line
    with pytest.raises(ValueError, match="model.cpu_matmul='onednn' cannot run"):
        run_setup.log_compute(ModelConfig(compute_dtype="bfloat16", cpu_matmul="onednn"))


def test_validation_names_the_key(kernel, tmp_path, monkeypatch):
    import feynrl_jax.kernels

    spec = importlib.util.spec_from_file_location(
        "grpo_demo", pathlib.Path(__file__).parents[1] / "configs/grpo_demo.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    config = module.get_config(None)
    config.model.cpu_matmul = "onednn"
    validate(config, num_devices=1)  # the kernel is built (the fixture): accepted
    config.model.cpu_matmul = "mkl"
    with pytest.raises(ConfigError, match="model.cpu_matmul"):
        validate(config, num_devices=1)
    monkeypatch.setattr(feynrl_jax.kernels, "ONEDNN_LIBRARY", tmp_path / "absent.so")
    config.model.cpu_matmul = "onednn"
    with pytest.raises(ConfigError, match="model.cpu_matmul='onednn' but the kernel is not built"):
        validate(config, num_devices=1)


@pytest.fixture
def auto_cache(tmp_path, monkeypatch):
    """`auto_choice` over an empty cache root of the test's own (never the user's verdict), forgotten after."""
    monkeypatch.setenv("FEYNRL_JAX_CACHE", str(tmp_path))
    onednn._auto_choice.cache_clear()
    yield tmp_path / onednn.AUTO_FILE
    onednn._auto_choice.cache_clear()


# The timed products take 3 x 2 M K N FLOPs (about 10.9 GFLOP): no CPU runs that in under a millisecond. (Products
# staged into the caller's trace instead of run are refused by `_time_turns` itself.)
MIN_REAL_SECONDS = 1e-3


def test_auto_times_both_backends_once_per_machine_and_dtype_and_follows_the_faster(kernel, auto_cache, monkeypatch):
    # Measured while a jit trace is in progress on this thread, as when a model's pass is traced first.
    seen = {}
    jax.jit(lambda x: seen.setdefault("record", onednn.auto_choice("float32")) and x).lower(1.0)
    measured = {("float32", False): seen["record"]}
    if BF16_HERE or onednn.aten_built():  # (an AVX2-only CPU multiplies bfloat16 on ATen alone)
        measured["bfloat16", False] = onednn.auto_choice("bfloat16")
    # A decode step's products are measured apart, at each of AUTO_DECODE_ROWS rows (under a trace too).
    jax.jit(lambda x: seen.setdefault("decode", onednn.auto_choice("float32", one_token=True)) and x).lower(1.0)
    measured["float32", True] = seen["decode"]
    for (_, one_token), record in measured.items():
        assert record["onednn_s"] > MIN_REAL_SECONDS and record["xla_s"] > MIN_REAL_SECONDS, record
        if not one_token:
            assert record["onednn"] == (record["xla_s"] >= onednn.AUTO_MIN_SPEEDUP * record["onednn_s"])
    by_rows = measured["float32", True]["by_rows"]
    assert sorted(by_rows) == sorted(str(rows) for rows in onednn.AUTO_DECODE_ROWS)
    assert measured["float32", True]["onednn_s"] == pytest.approx(sum(t["onednn_s"] for t in by_rows.values()))
    assert measured["float32", True]["xla_s"] == pytest.approx(sum(t["xla_s"] for t in by_rows.values()))
    assert all(min(t.values()) > 0 for t in by_rows.values()), by_rows  # (`_time_turns` refuses staged products)
    assert measured["float32", True]["onednn"] == all(
        t["xla_s"] >= onednn.AUTO_MIN_SPEEDUP * t["onednn_s"] for t in by_rows.values()
    )
    stored = json.loads(auto_cache.read_text())
    assert stored == {onednn._record_key(dtype, one_token): record for (dtype, one_token), record in measured.items()}
    assert onednn._record_key("float32").startswith(onednn._machine_key())
    assert onednn._record_key("float32", one_token=True) != onednn._record_key("float32")
    assert not list(auto_cache.parent.glob("*.tmp"))
    # A later process reads the machine's records instead of measuring, and "auto" follows each dtype's and each
    # kind's own verdict (the one-device condition is met here by hand: this process has 8 fake devices).
    monkeypatch.setattr(onednn, "_measure", lambda *a: pytest.fail("measured again despite the stored record"))
    monkeypatch.setattr(jax, "device_count", lambda: 1)
    for onednn_s, verdict in ((0.01, True), (0.05, False)):
        record = {"onednn_s": onednn_s, "xla_s": 0.03, "onednn": verdict}
        other = {"onednn_s": 0.08 - onednn_s, "xla_s": 0.03, "onednn": not verdict}
        auto_cache.write_text(
            json.dumps(
                {
                    onednn._record_key("bfloat16"): record,
                    onednn._record_key("float32"): other,
                    onednn._record_key("bfloat16", one_token=True): decode_record(other),
                    onednn._record_key("float32", one_token=True): decode_record(record),
                }
            )
        )
        onednn._auto_choice.cache_clear()
        assert onednn.auto_choice("bfloat16") == record and onednn.auto_choice("float32") == other
        assert onednn.use_onednn("auto", jnp.bfloat16) == (verdict and bool(onednn.cpu_bf16_units()))
        assert onednn.use_onednn("auto", jnp.float32) == (not verdict)
        assert onednn.use_onednn("auto", jnp.float32, one_token=True) == verdict
        assert onednn.use_onednn("auto", jnp.bfloat16, one_token=True) == (
            not verdict and bool(onednn.cpu_bf16_units())
        )
        assert onednn.use_onednn("onednn", jnp.float32, one_token=True)  # forced, whatever the measurement
        assert not onednn.use_onednn("xla", jnp.float32, one_token=True)
    # A decode record without the times of each of AUTO_DECODE_ROWS (another set of rows) is measured again.
    monkeypatch.setattr(onednn, "_measure", lambda dtype, one_token=False: decode_record(FAST_ONEDNN))
    for by_rows in (
        None,
        {"8": {"onednn_s": 0.01, "xla_s": 0.03}},
        {**decode_record(FAST_ONEDNN)["by_rows"], "64": {}},
    ):
        stale = {**FAST_ONEDNN, "onednn": False, "by_rows": by_rows}
        auto_cache.write_text(json.dumps({onednn._record_key("float32", one_token=True): stale}))
        onednn._auto_choice.cache_clear()
        assert onednn.auto_choice("float32", one_token=True) == decode_record(FAST_ONEDNN)
    # Another machine's record (another CPU, kernel or JAX) does not count for this one, nor does a broken record.
    fresh = dict(FAST_ONEDNN)
    monkeypatch.setattr(onednn, "_measure", lambda *a: fresh)
    key = onednn._record_key("bfloat16")
    for broken in (
        None,
        {"onednn_s": 0.01, "xla_s": 0.03, "onednn": "false"},
        {"onednn_s": 0, "xla_s": 1, "onednn": True},
    ):
        auto_cache.write_text(json.dumps({"other cpu | 2 cpus | bfloat16": record, key: broken}))
        onednn._auto_choice.cache_clear()
        assert onednn.auto_choice("bfloat16") == fresh
        assert json.loads(auto_cache.read_text()) == {"other cpu | 2 cpus | bfloat16": record, key: fresh}
    # A measurement that fails leaves XLA in charge and nothing stored, so the next process tries again.
    auto_cache.unlink()
    monkeypatch.setattr(onednn, "_measure", lambda *a: 1 / 0)
    onednn._auto_choice.cache_clear()
    assert onednn.auto_choice("bfloat16") == {"onednn": False, "error": "ZeroDivisionError: division by zero"}
    assert not onednn.use_onednn("auto", jnp.bfloat16) and not onednn.use_onednn("auto", jnp.float32)
    assert not auto_cache.exists()


_ONE_DEVICE = textwrap.dedent(
    """
    import dataclasses, json
    import jax, jax.numpy as jnp, numpy as np
    from feynrl_jax.kernels import onednn
    from feynrl_jax.models import decoder
    from feynrl_jax.models import config as model_config
    from feynrl_jax.models.config import ModelConfig
    from feynrl_jax.models.logprobs import sequence_logprobs

    base = ModelConfig(vocab_size=384, hidden_size=128, intermediate_size=256, num_layers=2, num_heads=4,
                       num_kv_heads=2, head_dim=32, tie_word_embeddings=True)
    params = decoder.init_params(base, jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (2, 24), 0, 384)
    positions = jnp.broadcast_to(jnp.arange(24), (2, 24))

    def grads(config, params):
        def loss(p):
            return -sequence_logprobs(p, tokens, positions, config=config)[0][:, 1:].mean()
        return jax.jit(jax.value_and_grad(loss))(params)

    # The float64 reference as tests/test_shared_prefix.py makes it: the model's float32 parts lifted too.
    float32, model_config.DTYPES = jnp.float32, (*model_config.DTYPES, "float64")
    with jax.enable_x64(True):
        jnp.float32 = jnp.float64
        f64 = dataclasses.replace(base, param_dtype="float64", compute_dtype="float64")
        ref_loss, ref = grads(f64, jax.tree.map(lambda p: np.asarray(p, np.float64), params))
        ref_loss, ref = float(ref_loss), jax.tree.map(lambda r: np.asarray(r, np.float64), ref)
        jnp.float32 = float32
    from feynrl_jax.train import run_setup
    bf16_auto = dataclasses.replace(base, compute_dtype="bfloat16", cpu_matmul="auto")
    out = {"auto": onednn.use_onednn("auto", jnp.bfloat16), "units": list(onednn.cpu_bf16_units()),
           "choice": onednn.auto_choice("bfloat16"),
           "log": run_setup.log_compute(bf16_auto),
           "auto_f32": onednn.use_onednn("auto", jnp.float32), "choice_f32": onednn.auto_choice("float32"),
           "log_f32": run_setup.log_compute(dataclasses.replace(base, cpu_matmul="auto")),
           "auto_remat": base.__class__(remat="auto").resolved_remat()}
    # bfloat16 products in the kernel only where its oneDNN has them (not on an AVX2-only CPU).
    out["bf16_here"] = onednn.bf16_products_here()
    runs = [("bfloat16", "xla", "none"), ("bfloat16", "onednn", "none"), ("bfloat16", "onednn", "full"),
            ("bfloat16", "onednn", "dots")] * out["bf16_here"]
    runs += [("float32", "xla", "none"), ("float32", "onednn", "none"), ("float32", "onednn", "dots")]
    for dtype, backend, remat in runs:
        config = dataclasses.replace(base, compute_dtype=dtype, cpu_matmul=backend, remat=remat)
        text = jax.jit(lambda p: sequence_logprobs(p, tokens, positions, config=config)[0]).lower(params).as_text()
        grad_text = jax.jit(jax.grad(
            lambda p: sequence_logprobs(p, tokens, positions, config=config)[0].sum())).lower(params).as_text()
        loss, g = grads(config, params)
        # How many of the layers' projection-kernel gradients a bfloat16 number holds exactly: all of them where the
        # products' weight gradients are rounded to bfloat16 (XLA's), few where oneDNN writes them in float32
        # (`onednn.dot_cast`).
        leaves = jax.tree_util.tree_leaves_with_path(g["layers"])
        kernel_grads = np.concatenate([np.asarray(v, np.float32).ravel() for path, v in leaves
                                       if getattr(path[-1], "key", None) == "kernel"])
        exact = np.asarray(jnp.asarray(kernel_grads).astype(jnp.bfloat16).astype(jnp.float32)) == kernel_grads
        errors = [float(np.abs(np.asarray(a, np.float64) - r).max() / np.abs(r).max())
                  for a, r in zip(jax.tree.leaves(g), jax.tree.leaves(ref))]
        name = backend if remat == "none" else f"{backend}-{remat}"
        out[name if dtype == "bfloat16" else f"{name}-float32"] = {
                        "calls": text.count(onednn.TARGET), "grad_calls": grad_text.count(onednn.TARGET),
                        "loss_error": abs(float(loss) - ref_loss),
                        "grad_error": max(errors), "kernel_grads_in_bf16": float(exact.mean())}
    # Through a gradient sink (several micro-batches' accumulator) the kernels are cast once per layer, before their
    # products: their gradients come out rounded to bfloat16 (`forward` leaves `onednn.dot_cast` out there).
    if out["bf16_here"]:
        sinking = dataclasses.replace(base, compute_dtype="bfloat16", cpu_matmul="onednn", remat="full")
        sink = jax.tree.map(jnp.zeros_like, params["layers"])
        hidden_sum = lambda p: decoder.forward(p, tokens, positions, config=sinking, grad_sink=sink)[0].astype(
            jnp.float32).sum()
        sunk = jax.tree_util.tree_leaves_with_path(jax.jit(jax.grad(hidden_sum))(params)["layers"])
        sunk = np.concatenate([np.asarray(v, np.float32).ravel() for path, v in sunk
                               if getattr(path[-1], "key", None) == "kernel"])
        out["sink_kernel_grads_in_bf16"] = float(
            (np.asarray(jnp.asarray(sunk).astype(jnp.bfloat16).astype(jnp.float32)) == sunk).mean())
    # Packed rows of short segments: attention in blocks (block_attention) sends its products to oneDNN too.
    from feynrl_jax.models.block_attention import SegmentBounds
    ids = jnp.asarray(np.repeat(np.arange(1, 7), 8)[None].repeat(2, 0), jnp.int32)
    segment_positions = jnp.asarray(np.tile(np.arange(8), 6)[None].repeat(2, 0), jnp.int32)
    bounds = SegmentBounds(segment=8, prefix=8)
    bounds.check(np.asarray(segment_positions), np.asarray(ids))
    assert bounds.pays(48, base.num_kv_heads / base.num_heads)
    blocked_dtype = "bfloat16" if out["bf16_here"] else "float32"
    blocked = dataclasses.replace(base, compute_dtype=blocked_dtype, cpu_matmul="onednn")
    # A float32 decode step (one token per row): under "auto" the decode measurement decides, oneDNN when forced.
    from feynrl_jax.models import KVCache, init_cache
    cache = init_cache(base, 2, 32)
    step = lambda config: jax.jit(lambda p, c: decoder.logits(p, decoder.forward(
        p, tokens[:, :1], positions[:, :1], config=config, cache=c)[0], config=config)).lower(params, cache)
    out["decode_f32_calls"] = step(dataclasses.replace(base, cpu_matmul="auto")).as_text().count(onednn.TARGET)
    out["choice_decode_f32"] = onednn.auto_choice("float32", one_token=True)
    forced = step(dataclasses.replace(base, cpu_matmul="onednn")).as_text().count(onednn.TARGET)
    assert forced == 10, forced
    # Attending to the cache's first 16 of 32 positions (the engine's `attend_len`): attention's two products read
    # that prefix in place (`onednn.cache_dot`); with per-layer params and cache, as the engine decodes, in each layer.
    from feynrl_jax.models import unstack_layers
    forced = dataclasses.replace(base, cpu_matmul="onednn")
    prefix_step = jax.jit(lambda p, c: decoder.logits(p, decoder.forward(
        p, tokens[:, :1], positions[:, :1], config=forced, cache=c, attend_len=16)[0], config=forced))
    text = prefix_step.lower(unstack_layers(params), cache.unstack()).as_text()
    out["prefix_calls"] = [text.count(onednn.TARGET), text.count(onednn.CACHE_MATMUL_TARGET)]
    out["blocked_calls"] = jax.jit(lambda p: decoder.forward(
        p, jnp.tile(tokens, (1, 2)), segment_positions,
        config=blocked, segment_ids=ids, segment_bounds=bounds)[0]).lower(params).as_text().count(onednn.TARGET)
    print("RESULT " + json.dumps(out))
    """
)


_BF16_CACHE = textwrap.dedent(
    """
    import dataclasses, json
    import jax, jax.numpy as jnp, numpy as np
    from feynrl_jax.models import cache_dtype, forward, init_cache, unstack_layers
    from feynrl_jax.models import decoder
    from feynrl_jax.models.config import ModelConfig

    base = ModelConfig(vocab_size=384, hidden_size=128, intermediate_size=256, num_layers=2, num_heads=4,
                       num_kv_heads=2, head_dim=32, tie_word_embeddings=True)
    model = dataclasses.replace(base, param_dtype="bfloat16", compute_dtype="bfloat16", cpu_matmul="onednn")
    params = decoder.init_params(model, jax.random.key(0))
    wide = jax.tree.map(lambda a: a.astype(jnp.float32), params)  # the same bfloat16 values
    prompt = jax.random.randint(jax.random.key(1), (2, 6), 0, 384)
    segments = jnp.asarray([[1] * 6, [1] * 4 + [0] * 2])  # row 1 ends in two padding tokens: never written
    positions = jnp.broadcast_to(jnp.arange(6), (2, 6))
    step = jax.random.randint(jax.random.key(2), (2, 1), 0, 384)
    run = jax.jit(forward, static_argnames=("config",))
    out = {"dtypes": [cache_dtype(model).name, cache_dtype(dataclasses.replace(model, cpu_matmul="xla")).name]}
    for name, config, p, held in (
        ("bfloat16 cache", model, params, jnp.bfloat16),
        ("float32 cache", model, params, jnp.float32),
        ("float32 model", base, wide, jnp.float32),
    ):
        for layout in ("stacked", "per-layer"):
            cache = jax.tree.map(lambda a: a.astype(held), init_cache(config, 2, 8))
            q = p
            if layout == "per-layer":
                cache, q = cache.unstack(), unstack_layers(p)
            text = run.lower(q, prompt, positions, config=config, segment_ids=segments, cache=cache).as_text()
            hidden, cache = run(q, prompt, positions, config=config, segment_ids=segments, cache=cache)
            last, cache = run(q, step, jnp.asarray([[6], [4]]), config=config, cache=cache)
            ks = cache.k if layout == "per-layer" else list(cache.k)
            vs = cache.v if layout == "per-layer" else list(cache.v)
            out[f"{name}, {layout}"] = {
                "writes": text.count("feynrl_cache_write"),
                "held": str(ks[0].dtype),
                "k0": np.asarray(ks[0], np.float32).tolist(),
                "v0": np.asarray(vs[0], np.float32).tolist(),
                "outputs": [np.asarray(x, np.float64).tolist() for x in (hidden, last)],
            }
    # The engine's slot insert (`insert_prefix`): a prompt's prefilled keys and values into one slot, the bfloat16
    # cache by `write_cache` (the kernel), the float32 one by XLA's dynamic-update-slice as before.
    from feynrl_jax.models import KVCache
    from feynrl_jax.rollout.slots import insert_prefix
    rng = np.random.default_rng(0)
    prefix = KVCache(k=jnp.asarray(rng.normal(size=(2, 3, 2, 32, 8)), jnp.bfloat16),
                     v=jnp.asarray(rng.normal(size=(2, 3, 2, 8, 32)), jnp.bfloat16))
    slots_k = jnp.asarray(rng.normal(size=(4, 2, 32, 16)), jnp.bfloat16)
    slots_v = jnp.asarray(rng.normal(size=(4, 2, 16, 32)), jnp.bfloat16)
    insert = jax.jit(lambda k, v, *a: insert_prefix(k, v, *a, config=model), donate_argnums=(0, 1))
    where = (prefix, jnp.int32(1), jnp.int32(2), jnp.int32(1))  # layer 1, slot 2, the prefix's row 1
    inserted = {}
    for dtype in (jnp.bfloat16, jnp.float32):
        k, v = jnp.copy(slots_k).astype(dtype), jnp.copy(slots_v).astype(dtype)  # the insert donates them
        text = insert.lower(k, v, *where).as_text()
        k, v = insert(k, v, *where)
        changed = (np.asarray(k, np.float32) != np.asarray(slots_k, np.float32)).any(axis=(1, 2, 3))
        k, v = np.asarray(k, np.float32).tolist(), np.asarray(v, np.float32).tolist()
        rows = np.flatnonzero(changed).tolist()
        inserted[jnp.dtype(dtype).name] = {"writes": text.count("feynrl_cache_write"), "rows": rows, "k": k, "v": v}
    out["insert"] = inserted
    print("RESULT " + json.dumps(out))
    """
)


@needs_bf16_products
def test_bfloat16_cache_on_onednn_is_written_in_place_and_as_accurate(kernel, tmp_path):
    """Where decode products run on oneDNN, a bfloat16 model keeps a bfloat16 KV cache on a CPU (`cache_dtype`),
    written by the kernel (`onednn.cache_write`: XLA:CPU widened a bfloat16 scatter's whole cache) and read by
    attention's oneDNN products, in one layer's and in the stacked cache. It holds the keys and values the float32
    cache holds (layer 0, whose input both share: bit for bit, padding positions never written), and prefill then a
    decode step through it are as close to the same model computed in float32 as through the float32 cache: both
    multiply the same bfloat16 values and accumulate in float32, in other orders, so a rounding to bfloat16 may fall
    the other way; hence at most twice the float32 cache's error (here the two errors are 1.0-1.2x each other, about
    half a bfloat16 unit of the largest value; a cache written at wrong positions is off by whole values)."""
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=1", JAX_PLATFORMS="cpu")
    env["FEYNRL_JAX_CACHE"] = str(tmp_path)
    proc = subprocess.run([sys.executable, "-c", _BF16_CACHE], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("RESULT "))[7:])
    assert result["dtypes"] == ["bfloat16", "float32"]
    for layout in ("stacked", "per-layer"):
        names = ("bfloat16 cache", "float32 cache", "float32 model")
        narrow, wide, ref = (result[f"{name}, {layout}"] for name in names)
        # keys and values of both layers, in one scan body (stacked) or per layer
        assert narrow["writes"] == (2 if layout == "stacked" else 4) and wide["writes"] == 0, (layout, narrow)
        assert narrow["held"] == "bfloat16" and wide["held"] == "float32"
        for held in ("k0", "v0"):
            np.testing.assert_array_equal(np.asarray(narrow[held]), np.asarray(wide[held]))
        # row 1's padding (positions 4 and 5 of the prompt) was dropped; the decode step wrote position 4
        values = np.asarray(narrow["v0"])  # [B, K, S, Dh]
        assert (values[1, :, 5:] == 0).all() and (values[1, :, 4] != 0).any() and (values[0, :, 7:] == 0).all()
        for got, other, want in zip(narrow["outputs"], wide["outputs"], ref["outputs"]):
            got, other, want = np.asarray(got), np.asarray(other), np.asarray(want)
            error, other_error = np.abs(got - want).max(), np.abs(other - want).max()
            assert 0 < error <= 2 * other_error, (layout, error, other_error)
    # the slot insert: the same values written, into slot 2 alone, by the kernel for the bfloat16 cache
    insert = result["insert"]
    assert insert["bfloat16"]["writes"] == 2 and insert["float32"]["writes"] == 0
    for held in ("k", "v"):
        np.testing.assert_array_equal(np.asarray(insert["bfloat16"][held]), np.asarray(insert["float32"][held]))
    assert insert["bfloat16"]["rows"] == insert["float32"]["rows"] == [2]


def test_model_in_one_device_process_uses_the_kernel_and_matches_float64(kernel, tmp_path):
    # The process measures "auto" into a cache root of the test's own, never the user's.
    env = dict(
        os.environ,
        XLA_FLAGS="--xla_force_host_platform_device_count=1",
        JAX_PLATFORMS="cpu",
        FEYNRL_JAX_CACHE=str(tmp_path),
    )
    proc = subprocess.run([sys.executable, "-c", _ONE_DEVICE], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("RESULT "))[7:])
    # The switch reaches the compiled pass: 7 projections and attention's 2 batched products per layer are scanned
    # once + the tied output projection.
    assert result["bf16_here"] == BF16_HERE
    assert result["blocked_calls"] == 9  # no output projection in `forward`
    # "auto" takes oneDNN exactly where the CPU has bf16 matrix instructions (one device, kernel built) and oneDNN
    # was measured faster here; the trainer's log says which and the measured ratio.
    assert result["auto"] == (bool(result["units"]) and result["choice"]["onednn"])
    assert ("matrix products by oneDNN" in result["log"]) == result["auto"]
    assert ("x XLA's speed here" in result["log"]) == bool(result["units"])
    assert result["auto_remat"] == "dots"  # float32 on a CPU (ModelConfig.resolved_remat)
    # float32 follows its own measurement, whatever the CPU's bf16 instructions.
    assert result["auto_f32"] == result["choice_f32"]["onednn"]
    assert ("matrix products by oneDNN" in result["log_f32"]) == result["auto_f32"]
    assert "x XLA's speed here" in result["log_f32"] and "compute in float32" in result["log_f32"]
    # and so does its decode steps' measurement (logged apart)
    decode_backend = "oneDNN" if result["choice_decode_f32"]["onednn"] else "XLA"
    assert f"decode steps' products by {decode_backend} (oneDNN measured at" in result["log_f32"], result["log_f32"]
    # A float32 decode step follows the decode measurement: all 10 products in oneDNN or none.
    assert result["decode_f32_calls"] == (10 if result["choice_decode_f32"]["onednn"] else 0), result
    # Per layer (2 here): 7 projections and 2 products reading the cache's first positions in place, + the output
    # projection.
    assert result["prefix_calls"] == [2 * 7 + 1, 2 * 2], result
    # float32: the same calls. Both backends multiply float32 operands and accumulate in float32, in different
    # orders, so oneDNN's distance to float64 is held to XLA's own, doubled, plus a margin of K U with K = 384,
    # the longest contraction here (the tied output projection's input gradient sums over the vocabulary): one
    # product's first-order bound relative to |a| @ |b|. The loss and the relative gradient errors are of order
    # 1e-7 to 1e-6 (a few U) either way; the margin is 2.3e-5.
    assert result["xla-float32"]["calls"] == 0 and result["onednn-float32"]["calls"] == 10
    for key in ("loss_error", "grad_error"):
        assert result["onednn-float32"][key] <= 2 * result["xla-float32"][key] + 384 * U_F32, result
    # "dots", float32's "auto" on a CPU: oneDNN's products are kept by name, so the backward pass recomputes only
    # attention's two batched products (in the scanned layer's body, once in the program), with the same bound.
    dots = result["onednn-dots-float32"]
    assert dots["calls"] == 10 and dots["grad_calls"] == result["onednn-float32"]["grad_calls"] + 2, result
    for key in ("loss_error", "grad_error"):
        assert dots[key] <= 2 * result["xla-float32"][key] + 384 * U_F32, result
    # The bfloat16 runs below need the kernel's bf16 products (test_an_avx2_cpu_gets_no_bf16_products).
    if not BF16_HERE:
        return
    assert result["xla"]["calls"] == 0
    assert result["onednn"]["calls"] == 10
    # Both bf16 passes differ from float64 by bf16 roundings of the same products; oneDNN rounds at most as often as
    # XLA (both accumulate in float32), so its error is bounded by XLA's own plus a few U.
    # With recomputation ("full", the CPU's "auto", and "dots", which keeps oneDNN's outputs by name) the same.
    # "full" recomputes in the backward pass the 6 projections whose outputs it reads (all but down_proj, whose output
    # only joins the residual sum) and both attention products; "dots" keeps the projections' outputs by name, as
    # "none" does, and recomputes attention's batched products (XLA's "dots" policy keeps no batched dot either).
    calls = {run: result[run]["grad_calls"] for run in ("onednn", "onednn-full", "onednn-dots")}
    assert calls["onednn-full"] == calls["onednn"] + 8 and calls["onednn-dots"] == calls["onednn"] + 2, calls
    for run in ("onednn", "onednn-full", "onednn-dots"):
        assert result[run]["calls"] == 10, run
        for key in ("loss_error", "grad_error"):
            assert result[run][key] <= 2 * result["xla"][key] + 4 * U_BF16, (run, result)
        # float32 weights, bf16 products on oneDNN: the weight gradients come out in float32 (`onednn.dot_cast`),
        # not rounded to bfloat16 as XLA's are (a random float32 value is a bf16 one with probability 2^-16).
        assert result[run]["kernel_grads_in_bf16"] < 0.01, (run, result[run])
    assert result["xla"]["kernel_grads_in_bf16"] == 1.0
    assert result["sink_kernel_grads_in_bf16"] == 1.0
