"""`make test` runs the suite in two passes (Makefile): the tests not marked `serial` three at a time, Ray and
multi-process runs included, then the `serial` ones alone: the tests that time themselves or wait on short timeouts,
and the vLLM tier's RL runs and the two-trainer-process RL run (memory)."""

import importlib.util
import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
TEST_ID = re.compile(r"^tests(_vllm)?/\S+\.py::\S")


COLLECT = """
import sys

import pytest


class Passes:
    def pytest_collection_finish(self, session):
        for item in session.items:
            # `-m serial` selects an item that carries the marker itself or through its module or class.
            group = item.get_closest_marker("xdist_group")
            unit = group.args[0] if group else "-"
            print(("serial " if item.get_closest_marker("serial") else "first ") + unit + " " + item.nodeid)


sys.exit(pytest.main(["--collect-only", "-q", "-p", "no:cacheprovider", *sys.argv[1:]], plugins=[Passes()]))
"""


def collected(*args: str) -> dict[str, list[tuple[str, str]]]:
    """`(xdist group or "-", test id)` of each test of each pass of `make test` (both tiers, as configured), in
    collection order, from one collection with the options `args`: "serial" for `-m serial`, "first" for `-m "not
    serial"`."""
    result = subprocess.run(
        [sys.executable, "-c", COLLECT, *args], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert result.returncode in (0, 5), result.stdout[-2000:] + result.stderr[-2000:]
    passes = {"serial": [], "first": []}
    for line in result.stdout.splitlines():
        name, _, rest = line.partition(" ")
        unit, _, test = rest.partition(" ")
        if name in passes and TEST_ID.match(test):
            passes[name].append((unit, test))
    return passes


def test_the_first_pass_runs_each_file_as_one_unit_and_the_vllm_tier_as_one_first():
    # `make test`'s first pass: --dist loadgroup --no-loadscope-reorder, the units tests/conftest.py gives.
    passes = collected("--dist", "loadgroup")
    first, every = passes["first"], passes["first"] + passes["serial"]
    assert all(unit == ("vllm" if test.startswith("tests_vllm/") else test.partition("::")[0]) for unit, test in every)
    units = list(dict.fromkeys(unit for unit, _ in first))
    assert len(units) == len({unit for unit, _ in first}) > 50  # each unit's tests together
    if importlib.util.find_spec("vllm") is not None:
        assert units[0] == "vllm"
    # Then by number of tests (the ordering is made before `-m` deselects the serial ones).
    sizes = [sum(1 for u, _ in every if u == unit) for unit in units if unit != "vllm"]
    assert sizes == sorted(sizes, reverse=True)
    # Without --dist loadgroup, collection is as pytest orders it.
    assert {unit for unit, _ in collected()["first"]} == {"-"}


def test_self_timed_and_short_timeout_tests_run_in_the_serial_pass_and_ray_runs_share_the_cores():
    passes = {name: [test for _, test in tests] for name, tests in collected().items()}
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
