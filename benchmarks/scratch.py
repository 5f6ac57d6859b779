"""The working folder of a benchmark that runs training jobs (their checkpoints can take GiBs)."""

from __future__ import annotations

import contextlib
import shutil
import sys
import tempfile
from collections.abc import Iterator


@contextlib.contextmanager
def scratch_folder(path: str | None, prefix: str) -> Iterator[str]:
    """`path` when the user named one (always kept); else a new temporary folder, removed when the benchmark ends
    without an error and kept when it fails, with its path printed, for its logs and run folders."""
    if path is not None:
        yield path
        return
    folder = tempfile.mkdtemp(prefix=prefix)
    try:
        yield folder
    except BaseException:
        print(f"the benchmark failed: its working folder {folder} is kept", file=sys.stderr, flush=True)
        raise
    shutil.rmtree(folder, ignore_errors=True)
