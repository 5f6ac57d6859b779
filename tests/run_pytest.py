"""`make test` runs pytest through this script: pytest's result, without the interpreter's native teardown.

Once, after a whole session had passed, the pytest process died at exit (a segmentation fault in libstdc++ on a
thread of a native library that was still running while the interpreter tore the modules down) and `make` reported
the passing run as failed. Here pytest runs as usual, then the atexit handlers (one removes the session's
compilation cache, tests/conftest.py), and the process ends with pytest's exit status, skipping that teardown.

    python tests/run_pytest.py [pytest arguments]
"""

import atexit
import os
import sys

import pytest

if __name__ == "__main__":
    status = int(pytest.main(sys.argv[1:]))
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
