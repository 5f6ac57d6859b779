"""`make test` runs the suite in two passes (Makefile): the tests not marked `serial` two at a time, then the `serial`
ones alone. Every test marked `ray` or `multiprocess` belongs to the second pass (tests/conftest.py marks them), the
vLLM tier's included, and so do the modules that time themselves."""

import importlib.util
import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
TEST_ID = re.compile(r"^tests(_vllm)?/\S+\.py::\S")


def collected(expression: str) -> list[str]:
    """The test ids `make test`'s pytest would select with `-m expression` (both tiers, as configured)."""
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "-m", expression],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode in (0, 5), result.stdout[-2000:] + result.stderr[-2000:]
    return [line for line in result.stdout.splitlines() if TEST_ID.match(line)]


def test_ray_multiprocess_and_self_timed_tests_run_in_the_serial_pass():
    serial = collected("serial")
    modules = {test.partition("::")[0] for test in serial}
    # Marked `ray` (the hook), `multiprocess` (the hook), or `serial` as a module or a test.
    assert {"tests/test_rl_algorithms.py", "tests/test_multiprocess_cli.py", "tests/test_bad_inputs.py"} <= modules
    assert "tests/test_rl_pipeline.py::test_async_generation_overlaps_training" in serial
    if importlib.util.find_spec("vllm") is not None:  # without vLLM the tier's modules are skipped at import
        assert "tests_vllm/test_rl_vllm.py" in modules
    assert len(serial) < len(collected("not serial"))  # the first pass keeps most of the suite
