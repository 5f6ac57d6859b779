"""Import rules of the rollout package (../shared/DESIGN.md): no losses, ray or torch; types without JAX."""

import subprocess
import sys


def _loaded_after(statement: str) -> set[str]:
    code = f"import sys; {statement}; print(' '.join(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    return set(out.stdout.split())


def test_engine_modules_import_no_losses_ray_or_torch():
    modules = ["feynrl_jax.rollout.native_engine", "feynrl_jax.rollout.sampling", "feynrl_jax.rollout.decode"]
    loaded = _loaded_after("; ".join(f"import {m}" for m in modules))
    assert set(modules) <= loaded
    for banned in ("feynrl_jax.losses", "ray", "torch", "vllm"):
        assert banned not in loaded, f"importing the native engine imports {banned}"


def test_rollout_types_import_without_jax():
    loaded = _loaded_after("import feynrl_jax.rollout as r; r.SamplingParams(); r.Rollouts")
    assert "jax" not in loaded and "feynrl_jax.rollout.types" in loaded
