"""Test set-up shared by every tier.

Eight fake CPU devices are requested before JAX is imported anywhere, so sharding tests run real
partitioned programs on any machine. Tests that need one device simply use the default device.
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in flags:
    os.environ["XLA_FLAGS"] = (flags + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

# Hypothesis: the default profile is derandomized, so CI and every local run see the same examples and a
# failure reproduces exactly. `HYPOTHESIS_PROFILE=explore` draws fresh random examples on every run.
from hypothesis import settings  # noqa: E402

settings.register_profile("default", derandomize=True, print_blob=True)
settings.register_profile("explore", derandomize=False, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))


import pytest  # noqa: E402


@pytest.fixture(scope="module")
def ray_session(tmp_path_factory):
    """A local Ray instance (2 CPUs, the tiny RL config's `ray` settings) for one test module, with a persistent JAX
    compilation cache shared by the module's actors (their processes compile the same tiny programs)."""
    import sys

    from feynrl_jax.orchestration.runtime import start_ray, stop_ray

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "configs"))
    import tiny_rl

    os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(tmp_path_factory.mktemp("jax_cache")))
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    assert start_ray(tiny_rl.get_config().ray)
    yield
    stop_ray()


@pytest.fixture
def algorithm_registry():
    """The algorithm registry, restored after the test (registrations and "module:function" references)."""
    from feynrl_jax.losses import registry

    before = dict(registry.ALGORITHMS)
    yield registry
    registry.ALGORITHMS.clear()
    registry.ALGORITHMS.update(before)
    registry._REFERENCES.clear()
