"""Test set-up shared by every tier.

Eight fake CPU devices are requested before JAX is imported anywhere, so sharding tests run real
partitioned programs on any machine. Tests that need one device simply use the default device. The actors of the
Ray RL runs that pytest starts in `tests/` get fewer (`tests/actor_devices.py`).
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in flags:
    flags = (flags + " --xla_force_host_platform_device_count=8").strip()
# XLA:CPU without LLVM's optimisation passes in this process and the processes it starts, but for the RL runs'
# (Ray actors, RL CLI runs: XLA's default level). Compiling dominates the suite; what that does and does not change:
# tests/xla_codegen.py. A level the environment names is kept.
from xla_codegen import with_suite_codegen  # noqa: E402  (tests/xla_codegen.py)

os.environ["XLA_FLAGS"] = with_suite_codegen(flags)
# The XLA flag `feynrl-jax` itself sets with several CPU devices (`feynrl_jax/cli/xla_flags.py`: collectives in
# program order, no deadlock with more devices than cores), here for this process and the processes it starts with
# its environment (a test that sets XLA_FLAGS for a subprocess sets its own). The in-process runs and their Ray
# actors then compile exactly the programs of the CLI runs of their kind (the same flags: the same backend
# optimisation level too), and XLA_FLAGS is part of the persistent cache's key, so each program is compiled once
# per session, not once per kind of run.
from feynrl_jax.cli.xla_flags import set_cpu_collective_flags  # noqa: E402

set_cpu_collective_flags(os.environ)
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

# One persistent compilation cache for the session, set before JAX is imported: the test process, the CLI
# subprocesses and Ray's actors all inherit it, so a program compiled once (the tiny model's train step, its
# rollout engine) is loaded, not compiled again, by every later run that builds the same program. The key covers
# the program, its shardings, the XLA flags and the backend, so a hit is the executable a compile would produce.
# Programs that compile in under 0.2 s are not written (unit tests compile hundreds of those). `make test` gives its
# two passes one cache of its own (Makefile), which this keeps.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    import atexit
    import shutil
    import tempfile

    _cache_dir = tempfile.mkdtemp(prefix="feynrl_jax_test_compile_cache_")
    atexit.register(shutil.rmtree, _cache_dir, ignore_errors=True)
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache_dir
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.2")

# Hypothesis: the default profile is derandomized, so CI and every local run see the same examples and a
# failure reproduces exactly. `HYPOTHESIS_PROFILE=explore` draws fresh random examples on every run.
from hypothesis import settings  # noqa: E402

settings.register_profile("default", derandomize=True, print_blob=True)
settings.register_profile("explore", derandomize=False, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))


import pytest  # noqa: E402
from actor_devices import ask_for_actor_devices, local_ray  # noqa: E402  (tests/actor_devices.py)


@pytest.fixture(scope="module")
def ray_session():
    """A local Ray instance (2 CPUs, the tiny RL config's `ray` settings) for one test module; its actors inherit the
    session's persistent compilation cache (above) and see `actor_devices.RAY_ACTOR_DEVICES` fake CPU devices."""
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "configs"))
    import tiny_rl

    with local_ray(tiny_rl.get_config().ray):
        yield


@pytest.fixture
def ray_actor_devices(monkeypatch):
    """For a test whose run starts Ray itself: the actors see `actor_devices.RAY_ACTOR_DEVICES` fake CPU devices.
    JAX's backend in this process is started first, so it keeps its 8 devices for the tests after this one."""
    import jax

    jax.devices()
    ask_for_actor_devices(monkeypatch)


@pytest.fixture
def algorithm_registry():
    """The algorithm registry, restored after the test (registrations and "module:function" references)."""
    from feynrl_jax.losses import registry

    before = dict(registry.ALGORITHMS)
    yield registry
    registry.ALGORITHMS.clear()
    registry.ALGORITHMS.update(before)
    registry._REFERENCES.clear()


@pytest.hookimpl(tryfirst=True)
def pytest_xdist_make_scheduler(config, log):
    """`make test`'s first pass: each file a unit of work, the vLLM tier's files one together (tests/xdist_units.py)."""
    from xdist_units import make_scheduler

    return make_scheduler(config, log)


@pytest.hookimpl(trylast=True)  # after `-m` has deselected
def pytest_collection_modifyitems(config, items):
    """A pytest-xdist worker reports its tests in the queue order of tests/xdist_units.py (the first pass of `make
    test` keeps that order: `--no-loadscope-reorder`)."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        from xdist_units import in_queue_order

        items[:] = in_queue_order(items)
