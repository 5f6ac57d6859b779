"""The two kinds of error a run ends with on purpose, and how the command line reports them.

The `feynrl-jax` command prints either as one line, `feynrl-jax: error: <message>`, writes the traceback to
the run's log file (`<run_dir>/run.log`) and exits with the error's code; anything else is a bug and keeps its
traceback. A message names what the user must fix: the config key, the file and row, the checkpoint step, the
reward.

* `InputError` (exit 2): the input cannot be used, whatever the run does: a data file, a checkpoint, a
  tokenizer, a reward's output, a full disk. `ConfigError` (config keys) is reported the same way.
* `RunFailed` (exit 1): the inputs were fine but the run cannot go on: it diverged, every step was skipped,
  an actor stopped responding and is out of restarts.

Both survive Ray: an exception raised inside an actor reaches the driver as a `RayTaskError` whose `cause` is
the original; `unwrap` finds it.
"""

from __future__ import annotations

EXIT_RUN_FAILED = 1
EXIT_BAD_INPUT = 2


class InputError(Exception):
    """An input (data, checkpoint, tokenizer, reward output, disk) that a run cannot use; exit code 2."""

    exit_code = EXIT_BAD_INPUT


class RunFailed(RuntimeError):
    """A run that cannot go on (diverged, all steps skipped, an actor lost for good); exit code 1."""

    exit_code = EXIT_RUN_FAILED


def unwrap(error: BaseException) -> BaseException:
    """The original exception behind Ray's wrappers (`RayTaskError.cause`, possibly nested), else `error`."""
    seen = set()
    while id(error) not in seen:
        seen.add(id(error))
        cause = getattr(error, "cause", None)
        if not isinstance(cause, BaseException):
            break
        error = cause
    return error
