"""The fake CPU devices of the Ray actors that a test's in-process RL run starts, in both tiers (tests/ and
tests_vllm/). Not a test module: tests/conftest.py and tests_vllm/test_rl_vllm.py import it.

The actors take the environment of the `ray.init` that starts them, so a test asks for their devices by setting
`XLA_FLAGS` around that call (`ask_for_actor_devices`; `local_ray` starts a Ray instance so, for both tiers'
`ray_session` fixtures). The flags are the ones a `feynrl-jax` process with that many devices runs with (the
device count and `feynrl_jax/cli/xla_flags.py`'s scheduler flag), so the actors compile the same programs as the
suite's CLI runs and share their entries in the persistent compilation cache, whichever tier, or both, the session
runs.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import pytest
from xla_codegen import for_rl_run

from feynrl_jax.cli.xla_flags import set_cpu_collective_flags

RAY_ACTOR_DEVICES = 2
"""Fake CPU devices of the actors. The trainer still trains on a mesh (data 2), so the loop's sharded paths run;
8 devices' collectives on a 2-core machine made each train step of the tiny RL config 3-4x slower (2.9-4.5 s
against 0.6-1.2 s) for nothing these tests check. The driver (the pytest process: 8 devices in tests/, 1 in
tests_vllm/ alone) still validates the config against its own count, so a test that sets a mesh needing more than
2 devices can pass that check and fail in the trainer actor. The RL runs on 8 devices are
tests/test_rl_multiprocess.py's (1 process x 8 against 2 processes x 4)."""


def with_fake_devices(xla_flags: str, count: int) -> str:
    """`xla_flags` with every `--xla_force_host_platform_device_count=` removed and one for `count` appended; the
    other flags are kept in order."""
    kept = [f for f in xla_flags.split() if not f.startswith("--xla_force_host_platform_device_count=")]
    return " ".join([*kept, f"--xla_force_host_platform_device_count={count}"])


def actor_xla_flags(xla_flags: str) -> str:
    """The actors' `XLA_FLAGS`: `xla_flags` with `RAY_ACTOR_DEVICES` fake devices, XLA's default backend
    optimisation level (an RL run's processes compile at it: tests/xla_codegen.py) and, as `feynrl-jax` adds it for
    several CPU devices, the concurrency-optimised scheduler off (a value already set is kept)."""
    environ = {"XLA_FLAGS": with_fake_devices(for_rl_run(xla_flags), RAY_ACTOR_DEVICES)}
    set_cpu_collective_flags(environ)
    return environ["XLA_FLAGS"]


def ask_for_actor_devices(patch: pytest.MonkeyPatch) -> None:
    """Sets, through `patch`, the environment that the actors of a Ray instance started next inherit."""
    patch.setenv("XLA_FLAGS", actor_xla_flags(os.environ.get("XLA_FLAGS", "")))
    patch.delenv("JAX_NUM_CPU_DEVICES", raising=False)  # it would override the flag


@contextlib.contextmanager
def local_ray(ray_config) -> Iterator[None]:
    """A local Ray instance started with `ray_config` (a config's `ray` settings) whose actors see
    `RAY_ACTOR_DEVICES` fake CPU devices; this process keeps its own. Stopped on exit."""
    from feynrl_jax.orchestration.runtime import start_ray, stop_ray

    with pytest.MonkeyPatch.context() as patch:
        ask_for_actor_devices(patch)
        assert start_ray(ray_config)
    try:
        yield
    finally:
        stop_ray()
