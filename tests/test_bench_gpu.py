"""benchmarks/bench_gpu.py: it runs with only what a plain jax[cuda] image has, and its FLOP and byte counts.

The smoke runs start the script in a subprocess whose ``sitecustomize`` (on ``PYTHONPATH``) puts an import blocker
first on ``sys.meta_path``, drops the editable install's finder (so the script must find the source tree itself)
and records every module the script loaded. The blocker refuses the project's other dependencies (``FORBIDDEN``)
and every module of an installed distribution that jax, jaxlib, optax and numpy do not require (their
optional imports then fail, as on a plain image); no import of a ``FORBIDDEN`` package may even be attempted.
XLA's backend optimisation level 0 keeps the tiny model's compilation short on CPU.
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import json
import math
import os
import re
import subprocess
import sys
import textwrap

import jax
import pytest

from feynrl_jax.models import init_params

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO_ROOT, "benchmarks", "bench_gpu.py")
FORBIDDEN = (
    "ml_collections",
    "ray",
    "grain",
    "wandb",
    "vllm",
    "tensorflow_datasets",
    "transformers",
    "torch",
    "math_verify",
    "orbax",
)
PLAIN_IMAGE = ("jax", "jaxlib", "optax", "numpy")  # what the script may use of a plain jax[cuda] image

SITECUSTOMIZE = textwrap.dedent(
    """
    import atexit, importlib.abc, json, os, sys

    BLOCKED = set({blocked!r})
    attempts = []


    class Blocker(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.partition(".")[0] in BLOCKED:
                attempts.append(name)
                raise ImportError(f"{{name}} is not on a plain jax[cuda] image (test_bench_gpu's blocker)")
            return None


    # A plain image has no editable install of this repository either.
    sys.meta_path[:] = [Blocker()] + [
        f for f in sys.meta_path if not getattr(f, "__module__", "").startswith("__editable__")
    ]
    preloaded = set(sys.modules)


    def report():
        losses = sys.modules.get("feynrl_jax.losses")
        with open(os.environ["BENCH_GPU_IMPORT_REPORT"], "w") as f:
            json.dump(
                {{
                    "loaded": sorted(set(sys.modules) - preloaded),
                    "blocked": attempts,
                    "losses_file": getattr(losses, "__file__", None),
                }},
                f,
            )


    atexit.register(report)
    """
)


def _normalise(distribution: str) -> str:
    return re.sub(r"[-_.]+", "-", distribution).lower()


def _distributions_required_by(roots) -> set[str]:
    """The installed distributions ``roots`` need, transitively (extras left out), by normalised name."""
    seen, todo = set(), list(roots)
    while todo:
        name = _normalise(todo.pop())
        if name in seen:
            continue
        try:
            requires = importlib.metadata.distribution(name).requires or []
        except importlib.metadata.PackageNotFoundError:
            continue
        seen.add(name)
        todo += [re.match(r"[A-Za-z0-9._-]+", r).group() for r in requires if "extra ==" not in r]
    return seen


@functools.cache
def _blocked_modules() -> frozenset[str]:
    """``FORBIDDEN``, and every top-level module of an installed distribution that a plain image would not have."""
    allowed = _distributions_required_by(PLAIN_IMAGE)
    outside = {
        name
        for name, owners in importlib.metadata.packages_distributions().items()
        if not any(_normalise(d) in allowed for d in owners)
    }
    return frozenset((outside | set(FORBIDDEN)) - {"feynrl_jax"})


def _load_bench():
    spec = importlib.util.spec_from_file_location("bench_gpu", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


bench = _load_bench()


def _run_bench(tmp_path, *flags: str) -> tuple[dict, dict, str]:
    """Runs ``bench_gpu.py --tiny --json ...`` under the blocker; returns (its JSON, the import report, stdout)."""
    site_dir = tmp_path / "site"
    site_dir.mkdir()
    (site_dir / "sitecustomize.py").write_text(SITECUSTOMIZE.format(blocked=sorted(_blocked_modules())))
    out, report = tmp_path / "bench_gpu.json", tmp_path / "imports.json"
    env = dict(os.environ)
    env.update(
        JAX_PLATFORMS="cpu",
        XLA_FLAGS="--xla_backend_optimization_level=0",  # also one CPU device (conftest asks for 8)
        PYTHONPATH=os.pathsep.join(filter(None, [str(site_dir), env.get("PYTHONPATH")])),
        BENCH_GPU_IMPORT_REPORT=str(report),
    )
    proc = subprocess.run(
        [sys.executable, SCRIPT, "--tiny", "--json", str(out), *flags],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(out.read_text()), json.loads(report.read_text()), proc.stdout


def _assert_plain_image_imports(report: dict):
    loaded = set(report["loaded"])
    assert not {name.partition(".")[0] for name in loaded} & _blocked_modules()
    assert not {name.partition(".")[0] for name in report["blocked"]} & set(FORBIDDEN)
    assert {"jax", "optax", "feynrl_jax.train.step", "feynrl_jax.rollout.decode"} <= loaded
    # Found through the source tree (the editable install's finder is gone): losses/ is feynrl_jax.losses.
    assert report["losses_file"] == os.path.join(REPO_ROOT, "losses", "__init__.py")


def _expected_flops_per_token(config, seq_len: int) -> int:
    """6 N + 12 L T H Dh with N from the shapes of ``init_params`` (nothing allocated): untied, all but the table."""
    shapes = jax.eval_shape(functools.partial(init_params, config), jax.random.key(0))
    assert "lm_head" in shapes  # untied: the output projection is its own matrix
    n = sum(math.prod(x.shape) for x in jax.tree.leaves(shapes)) - math.prod(shapes["embed"]["embedding"].shape)
    return 6 * n + 12 * config.num_layers * seq_len * config.num_heads * config.head_dim


def _positive_finite(x) -> bool:
    return isinstance(x, int | float) and math.isfinite(x) and x > 0


def test_tiny_run_imports_only_a_plain_jax_image_and_reports_null_mfu_on_cpu(tmp_path):
    result, report, stdout = _run_bench(tmp_path)
    _assert_plain_image_imports(report)
    train, decode = result["train"], result["decode"]
    for value in (train["step_time_s"], train["tokens_per_s"], decode["step_time_s"], decode["tokens_per_s"]):
        assert _positive_finite(value)
    assert all(_positive_finite(t) for t in train["step_times_s"] + decode["step_times_s"])
    assert math.isfinite(train["loss"])
    assert result["device_kind"] == "cpu"
    assert result["peaks"]["flops_source"] is None and result["peaks"]["hbm_source"] is None
    assert train["mfu"] is None and decode["bandwidth_fraction"] is None
    assert result["goals"]["mfu"]["met"] is None and result["goals"]["decode_bandwidth_fraction"]["met"] is None
    config = bench.model_config("tiny")
    assert train["flops_per_token"] == _expected_flops_per_token(config, train["seq"])
    assert train["flops_per_step"] == train["flops_per_token"] * train["batch"] * train["seq"]
    assert result["model"]["params"] == bench.param_count(config)
    assert "MFU null" in stdout and "not in DEVICE_PEAKS" in stdout


def test_peak_flags_give_mfu_and_bandwidth_fraction(tmp_path):
    result, report, _ = _run_bench(tmp_path, "--peak-tflops", "0.5", "--hbm-gbps", "20")
    _assert_plain_image_imports(report)
    train, decode = result["train"], result["decode"]
    peaks = result["peaks"]
    assert (peaks["flops_per_s"], peaks["flops_source"]) == (0.5e12, "--peak-tflops")
    assert (peaks["hbm_bytes_per_s"], peaks["hbm_source"]) == (20e9, "--hbm-gbps")
    assert _positive_finite(train["mfu"]) and _positive_finite(decode["bandwidth_fraction"])
    assert train["mfu"] == pytest.approx(train["achieved_flops_per_s"] / (0.5e12 * train["devices"]))
    assert decode["bandwidth_fraction"] == pytest.approx(decode["bytes_per_step"] / decode["step_time_s"] / 20e9)
    assert result["goals"]["mfu"]["met"] == (train["mfu"] >= bench.GOAL_MFU)
    assert isinstance(result["goals"]["decode_bandwidth_fraction"]["met"], bool)


@pytest.mark.parametrize("preset, low, high", [("0.5b", 0.4e9, 0.6e9), ("1b", 0.9e9, 1.2e9)])
def test_flops_per_token_is_6n_plus_attention_from_the_param_shapes(preset, low, high):
    config = bench.model_config(preset)
    shapes = jax.eval_shape(functools.partial(init_params, config), jax.random.key(0))
    params = sum(math.prod(x.shape) for x in jax.tree.leaves(shapes))
    assert bench.param_count(config) == params == config.num_params
    assert low < params < high
    for seq_len in (1, 2048):
        assert bench.train_flops_per_token(config, seq_len) == _expected_flops_per_token(config, seq_len)


def test_decode_bytes_count_weights_once_and_the_whole_cache():
    config = bench.model_config("1b")
    batch, cache_len = 64, 1040
    read = bench.decode_bytes_per_step(config, batch, cache_len)
    table = config.vocab_size * config.hidden_size
    assert read["weights"] == 2 * (config.num_params - table + batch * config.hidden_size)  # bfloat16
    kv = 2 * config.num_layers * batch * config.num_kv_heads * config.head_dim * cache_len
    # The cache is bfloat16 on an accelerator, float32 (bfloat16 values) on a CPU, where this test runs.
    cache_bytes = 2 if jax.default_backend() != "cpu" else 4
    assert read["kv_cache"] == cache_bytes * kv and read["total"] == read["weights"] + read["kv_cache"]


def test_device_table_and_flags():
    h100 = bench.device_peaks("NVIDIA H100 80GB HBM3", peak_tflops=None, hbm_gbps=None)
    assert (h100["name"], h100["flops_per_s"], h100["hbm_bytes_per_s"]) == ("H100 SXM", 989.4e12, 3.35e12)
    assert h100["flops_source"] == h100["hbm_source"] == "table"
    cpu = bench.device_peaks("cpu", peak_tflops=None, hbm_gbps=None)
    assert cpu["flops_per_s"] is None and cpu["hbm_bytes_per_s"] is None
    v5e = bench.device_peaks("TPU v5 lite", peak_tflops=None, hbm_gbps=2000.0)
    assert (v5e["flops_per_s"], v5e["flops_source"]) == (197e12, "table")
    assert (v5e["hbm_bytes_per_s"], v5e["hbm_source"]) == (2e12, "--hbm-gbps")
