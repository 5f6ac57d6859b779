"""`benchmarks/scratch.py`: a benchmark's own temporary folder (its runs' checkpoints, GiBs) is removed when it
succeeds and kept, with its path printed, when it fails; a folder the user named is never removed."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
from scratch import scratch_folder  # noqa: E402


def test_a_temporary_folder_is_removed_when_the_benchmark_succeeds():
    with scratch_folder(None, prefix="feynrl_scratch_test_") as folder:
        os.makedirs(os.path.join(folder, "run", "checkpoints"))
        assert os.path.basename(folder).startswith("feynrl_scratch_test_")
    assert not os.path.exists(folder)


def test_a_temporary_folder_is_kept_and_named_when_the_benchmark_fails(capsys):
    with pytest.raises(SystemExit, match="ours failed"):
        with scratch_folder(None, prefix="feynrl_scratch_test_") as folder:
            open(os.path.join(folder, "ours.log"), "w").close()
            raise SystemExit("ours failed")
    try:
        assert os.path.exists(os.path.join(folder, "ours.log"))
        assert folder in capsys.readouterr().err
    finally:
        os.remove(os.path.join(folder, "ours.log"))
        os.rmdir(folder)


def test_a_folder_the_user_named_is_kept(tmp_path):
    with scratch_folder(str(tmp_path / "mine"), prefix="unused_") as folder:
        os.makedirs(folder)
    assert folder == str(tmp_path / "mine") and os.path.isdir(folder)
