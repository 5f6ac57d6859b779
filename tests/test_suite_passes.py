"""`make test` runs the suite in two passes (Makefile): the tests not marked `serial` three at a time, Ray and
multi-process runs included, then the `serial` ones alone: the tests that time themselves or wait on short timeouts,
and the vLLM tier's RL runs and the two-trainer-process RL run (memory)."""

import functools
import importlib.util
import os
import pathlib
import re
import subprocess
import sys

import xdist_units

ROOT = pathlib.Path(__file__).resolve().parents[1]
TEST_ID = re.compile(r"^tests(_vllm)?/\S+\.py::\S")


COLLECT = """
import sys

import pytest


class Passes:
    def pytest_collection_finish(self, session):
        for item in session.items:
            # `-m serial` selects an item that carries the marker itself or through its module or class.
            print(("serial " if item.get_closest_marker("serial") else "first ") + item.nodeid)


sys.exit(pytest.main(["--collect-only", "-q", "-p", "no:cacheprovider"], plugins=[Passes()]))
"""


@functools.cache
def collected() -> dict[str, list[str]]:
    """The test ids of each pass of `make test` (both tiers, as configured) from one collection (30-50 s, so once), in
    the order a pytest-xdist worker reports them to the scheduler: "serial" for `-m serial`, "first" for `-m "not
    serial"`."""
    result = subprocess.run(
        [sys.executable, "-c", COLLECT],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTEST_XDIST_WORKER": "gw0"},
    )
    assert result.returncode in (0, 5), result.stdout[-2000:] + result.stderr[-2000:]
    passes = {"serial": [], "first": []}
    for line in result.stdout.splitlines():
        name, _, test = line.partition(" ")
        if name in passes and TEST_ID.match(test):
            passes[name].append(test)
    return passes


def test_the_first_pass_deals_each_file_as_one_unit_and_the_vllm_tier_as_one_first():
    # What a pytest-xdist worker reports to `make test`'s scheduler (tests/xdist_units.py), which keeps its order.
    every = collected()
    order = every["first"] + every["serial"]  # the units were ordered before `-m` deselected (here: nothing)
    assert {xdist_units.unit_of(t) for t in order if t.startswith("tests_vllm/")} <= {xdist_units.VLLM_UNIT}
    assert xdist_units.unit_of("tests/test_kl.py::test_a[x]") == "tests/test_kl.py"
    first = every["first"]
    units = [xdist_units.unit_of(test) for test in first]
    runs = [unit for i, unit in enumerate(units) if i == 0 or units[i - 1] != unit]
    assert len(runs) == len(set(runs)) > 50  # each unit's tests together
    if importlib.util.find_spec("vllm") is not None:
        assert runs[0] == xdist_units.VLLM_UNIT
    every_unit = [xdist_units.unit_of(test) for test in order]
    sizes = [every_unit.count(unit) for unit in runs if unit != xdist_units.VLLM_UNIT]
    assert sizes == sorted(sizes, reverse=True)


def test_self_timed_and_short_timeout_tests_run_in_the_serial_pass_and_ray_runs_share_the_cores():
    passes = collected()
    serial = passes["serial"]
    modules = {test.partition("::")[0] for test in serial}
    # Marked `serial` as a module or a test.
    assert {
        "tests/test_bad_inputs.py",
        "tests/test_rewards_pool.py",
        "tests/test_rl_fault_tolerance.py",
        "tests/test_multiprocess_cli.py",
        "tests/test_rl_multiprocess.py",  # memory: two trainer processes
    } <= modules
    assert "tests/test_rl_pipeline.py::test_async_generation_overlaps_training" in serial
    assert "tests/test_checkpoint_resume.py::test_sigkill_mid_save_never_leaves_a_loadable_partial_checkpoint" in serial
    assert "tests/test_launch_scripts.py::test_ray_cluster_sh_joins_the_cluster" in serial  # binds ports it picked
    if importlib.util.find_spec("vllm") is not None:  # without vLLM the tier's modules are skipped at import
        assert "tests_vllm/test_rl_vllm.py" in modules
    # Ray and multi-process runs that only wait on generous deadlines share the cores in the first pass.
    first = passes["first"]
    shared = {test.partition("::")[0] for test in first}
    assert {"tests/test_rl_algorithms.py", "tests/test_rl_resume.py", "tests/test_rl_async.py"} <= shared
    assert len(serial) < len(first)  # the first pass keeps most of the suite
