"""`make test` runs the suite in two passes (Makefile): the tests not marked `serial` two at a time, then the `serial`
ones alone. Every test that starts Ray or several processes belongs to the second pass (tests/conftest.py marks
them), the vLLM tier's included."""

import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


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
    return [line for line in result.stdout.splitlines() if "::" in line]


def test_every_ray_and_multiprocess_test_runs_in_the_serial_pass():
    serial = collected("serial")
    assert any(t.startswith("tests_vllm/test_rl_vllm.py::") for t in serial)
    assert any(t.startswith("tests/test_rl_algorithms.py::") for t in serial)
    assert "tests/test_rl_pipeline.py::test_async_generation_overlaps_training" in serial
    assert collected("(ray or multiprocess) and not serial") == []
