"""The `feynrl-jax` command: train, eval, convert, export and plot.

    feynrl-jax train --config=configs/grpo_demo.py[:variants] [--config.optim.lr=3e-6 ...] [--[no]resume]
    feynrl-jax eval --config=configs/eval_smollm2.py [--config.eval.n_samples=16 ...]
    feynrl-jax convert --gguf=smollm2 --out=checkpoints/smollm2
    feynrl-jax export RUN_DIR --out=DIR
    feynrl-jax plot RUN_DIR

The config is loaded, its command-line overrides checked and the whole config validated before anything heavy
is imported: a misspelt key fails in well under a second, naming the key and the closest valid one. The
subcommands' implementations are imported only when they run.

Errors. A run that stops on purpose prints one line, `feynrl-jax: error: <what to fix>`, and exits with
2 for bad input (config, data file, checkpoint, tokenizer, reward output, full disk: `errors.InputError`,
`OSError`) or 1 for a run that cannot go on (diverged, an actor lost for good: `errors.RunFailed`). `train` and
`eval` keep a log of the run in `<run_dir>/run.log` (appended to by every attempt), where the traceback of such an
error goes; anything else is a bug and prints its traceback.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import logging
import os
import sys
import threading
import traceback
from collections.abc import Callable

from absl import app, flags
from ml_collections import ConfigDict, config_flags

from feynrl_jax.config.errors import ConfigError
from feynrl_jax.config.overrides import check_overrides, parse_argv
from feynrl_jax.config.validation import validate
from feynrl_jax.errors import EXIT_BAD_INPUT, InputError, RunFailed, unwrap

USAGE = __doc__.split("\n\n")[1]
EXIT_USAGE = 2  # Bad command line or config.
RUN_LOG = "run.log"

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "Experiment config: configs/<name>.py, optionally with variants: configs/<name>.py:runlocal."
)
_RESUME = flags.DEFINE_boolean(
    "resume", None, "train: continue from the latest checkpoint in run_dir (overrides config.checkpoint.resume)."
)
_GGUF = flags.DEFINE_string("gguf", None, "convert: a GGUF file, or 'smollm2' for the shipped SmolLM2-135M-Instruct.")
_OUT = flags.DEFINE_string("out", None, "convert/export: the output folder.")


class CommandError(Exception):
    """A command that cannot run; the message is printed and the process exits with `exit_code`."""

    def __init__(self, message: str, exit_code: int = EXIT_USAGE):
        super().__init__(message)
        self.exit_code = exit_code


@dataclasses.dataclass(frozen=True)
class Entry:
    """A function of another package that a subcommand calls, imported only when the subcommand runs."""

    module: str
    function: str

    def load(self) -> Callable:
        """Imports the module and returns the function."""
        return getattr(importlib.import_module(self.module), self.function)


LOOPS = {
    "sft": Entry("feynrl_jax.train.sft_loop", "run"),
    "dpo": Entry("feynrl_jax.train.dpo_loop", "run"),
    "rl": Entry("feynrl_jax.orchestration.rl_loop", "run"),
}
EVALUATE = Entry("feynrl_jax.eval.evaluate", "run")
CONVERT_GGUF = Entry("feynrl_jax.checkpoints", "convert_gguf")
FIND_SMOLLM2 = Entry("feynrl_jax.checkpoints", "find_smollm2_gguf")
EXPORT = Entry("feynrl_jax.train.export", "export_run")
PLOT = Entry("feynrl_jax.tracking.plots", "plot_run")


def load_config(spec: str) -> ConfigDict:
    """Runs `get_config(arg)` of the file in `spec` ("path.py" or "path.py:variants").

    Raises:
        CommandError: naming the file when it is missing, has no `get_config`, or `get_config` fails.
    """
    path, _, arg = spec.partition(":")
    if not os.path.isfile(path):
        raise CommandError(f"config file {path!r} does not exist.")
    module_spec = importlib.util.spec_from_file_location("feynrl_jax_user_config", path)
    module = importlib.util.module_from_spec(module_spec)
    try:
        module_spec.loader.exec_module(module)
    except Exception as e:
        raise CommandError(f"config file {path!r} failed to import: {type(e).__name__}: {e}") from e
    if not hasattr(module, "get_config"):
        raise CommandError(f"config file {path!r} defines no get_config().")
    try:
        config = module.get_config(arg) if arg else module.get_config()
    except ConfigError:
        raise
    except (AttributeError, KeyError, TypeError, ValueError) as e:
        raise CommandError(f"{path}: get_config({arg!r}) failed: {type(e).__name__}: {e}") from e
    if not isinstance(config, ConfigDict):
        raise CommandError(f"{path}: get_config() returned {type(config).__name__}, not a ConfigDict.")
    return config


def parse_flags(argv: list[str]) -> list[str]:
    """absl's flag parsing, preceded by our override check; exits with a one-line reason on bad input.

    Returns:
        The positional arguments (program name, subcommand, operands).
    """
    try:
        spec, overrides = parse_argv(argv[1:])
        if spec:
            check_overrides(load_config(spec), overrides)
        elif overrides:
            raise CommandError(f"--config.{overrides[0].path} given without --config=<file>.")
        return flags.FLAGS(argv)
    except (ConfigError, CommandError) as e:
        _exit(str(e), getattr(e, "exit_code", EXIT_USAGE))
    except flags.Error as e:
        _exit(str(e), EXIT_USAGE)


def _exit(message: str, code: int) -> None:
    print(f"feynrl-jax: error: {message}", file=sys.stderr)
    sys.exit(code)


def _validated_config(command: str) -> ConfigDict:
    config = _CONFIG.value
    if config is None:
        raise CommandError(f"`feynrl-jax {command}` needs --config=configs/<name>.py.")
    validate(config)
    process, coordinator = _join_job(config)
    _log_to(os.path.join(config.run_dir, RUN_LOG), process)
    if process:
        import jax

        logging.getLogger("feynrl_jax.cli").info(
            "joined the job as process %d of %d (coordinator %s): %s",
            jax.process_index(),
            jax.process_count(),
            coordinator,
            _launch_text(),
        )
    return config


def _join_job(config: ConfigDict) -> tuple[str, str]:
    """Joins a multi-process job (`jax.distributed`) when the environment says this is one, before any device
    is touched; returns the tag of this process for the run log ("" for a single process) and the coordinator's
    address (as given or derived from SLURM's variables; the TPU runtime's own is not known here)."""
    from feynrl_jax.sharding.multihost import DistributedConfigError, initialize_distributed

    try:
        spec = initialize_distributed(
            initialization_timeout=config.distributed.initialization_timeout_s,
            heartbeat_timeout=config.distributed.heartbeat_timeout_s,
        )
    except DistributedConfigError as e:
        raise CommandError(f"multi-process launch: {e}") from e
    except Exception as e:  # jax.distributed's own errors: the coordinator unreachable, a process missing
        raise RunFailed(
            f"could not join the job ({_launch_text()}) within distributed.initialization_timeout_s="
            f"{config.distributed.initialization_timeout_s}: {type(e).__name__}: {str(e).splitlines()[0]}"
        ) from e
    if not spec.is_multiprocess:
        return "", ""
    import jax

    return f"p{jax.process_index()} ", spec.coordinator_address or "from the TPU runtime"


def _launch_text() -> str:
    """Who this process says it is, from the launch variables (for the run log and error messages)."""
    names = ("FEYNRL_COORDINATOR_ADDRESS", "FEYNRL_NUM_PROCESSES", "FEYNRL_PROCESS_ID", "SLURM_PROCID", "SLURM_NTASKS")
    return ", ".join(f"{n}={os.environ[n]}" for n in names if os.environ.get(n)) or "the TPU runtime's variables"


_run_log: str | None = None


def _log_to(path: str, process: str = "") -> None:
    """Appends this process's log records (INFO and above) to `path`, the run's log file; `process` ("p1 ") tags
    each line in a multi-process job, whose processes share the file."""
    global _run_log
    try:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        handler = logging.FileHandler(path)
    except OSError as e:
        raise CommandError(f"cannot write the run log {path}: {e.strerror or e}") from e
    handler.setFormatter(logging.Formatter(f"%(asctime)s {process}%(levelname)s %(name)s: %(message)s"))
    handler.addFilter(_ours_or_warnings)
    logging.getLogger().addHandler(handler)
    # The console shows one line per error: libraries' tracebacks (orbax's background writers report a full disk
    # dozens of times) go to the run log only.
    from absl import logging as absl_logging

    absl_logging.get_absl_handler().addFilter(_no_library_tracebacks)
    logging.raiseExceptions = False  # a log line that cannot be written (a full disk) must not print a traceback
    # Errors in libraries' background threads and callbacks (orbax's writers after a failed save) likewise.
    library_log = logging.getLogger("background")  # not ours: its tracebacks stay off the console
    sys.unraisablehook = lambda u: library_log.warning(
        "unraisable exception in %r: %s", u.object, u.exc_value, exc_info=(u.exc_type, u.exc_value, u.exc_traceback)
    )
    threading.excepthook = lambda a: library_log.warning(
        "exception in thread %s: %s",
        a.thread and a.thread.name,
        a.exc_value,
        exc_info=(a.exc_type, a.exc_value, a.exc_traceback),
    )
    ours = logging.getLogger("feynrl_jax")
    if ours.getEffectiveLevel() > logging.INFO:
        ours.setLevel(logging.INFO)
    _run_log = path


def _no_library_tracebacks(record: logging.LogRecord) -> bool:
    """Console filter: drops other libraries' records that carry a traceback (they are in the run log)."""
    if record.name.startswith("feynrl_jax"):
        return True
    return not (record.exc_info or record.exc_text or "Traceback (most recent call last)" in str(record.msg))


def _ours_or_warnings(record: logging.LogRecord) -> bool:
    """The run log keeps this package's INFO records and every library's warnings (not orbax's INFO chatter)."""
    return record.levelno >= logging.WARNING or record.name.startswith("feynrl_jax")


def train(operands: list[str]) -> None:
    """Runs the loop of `config.paradigm` (sft, dpo or rl)."""
    _no_operands("train", operands)
    config = _validated_config("train")
    if config.paradigm not in LOOPS:
        raise CommandError(
            f"paradigm={config.paradigm!r} is not trainable; run it with `feynrl-jax {config.paradigm}`."
        )
    if _RESUME.value is not None:
        config.checkpoint.resume = _RESUME.value
    LOOPS[config.paradigm].load()(config)


def evaluate(operands: list[str]) -> None:
    """Evaluates the config's model on its eval split (pass@k, mean reward, lengths)."""
    _no_operands("eval", operands)
    config = _validated_config("eval")
    EVALUATE.load()(config)


def convert(operands: list[str]) -> None:
    """Converts a GGUF file to a Hugging Face folder (config.json + safetensors + tokenizer)."""
    _no_operands("convert", operands)
    if not _GGUF.value or not _OUT.value:
        raise CommandError("usage: feynrl-jax convert --gguf=FILE|smollm2 --out=DIR")
    gguf = FIND_SMOLLM2.load()() if _GGUF.value == "smollm2" else _GGUF.value
    if not os.path.isfile(gguf):
        raise CommandError(f"--gguf={gguf!r} is not a file.")
    out = CONVERT_GGUF.load()(gguf, _OUT.value)
    print(f"converted {gguf} -> {out or _OUT.value}")


def export(operands: list[str]) -> None:
    """Writes the latest checkpoint of RUN_DIR as a Hugging Face folder."""
    run_dir = _one_run_dir("export", operands)
    if not _OUT.value:
        raise CommandError("usage: feynrl-jax export RUN_DIR --out=DIR")
    out = EXPORT.load()(run_dir, _OUT.value)
    print(f"exported {run_dir} -> {out or _OUT.value}")


def plot(operands: list[str]) -> None:
    """Writes PNG curves of RUN_DIR's metrics."""
    run_dir = _one_run_dir("plot", operands)
    written = PLOT.load()(run_dir)
    if written:
        print("\n".join(str(path) for path in written))


def _no_operands(command: str, operands: list[str]) -> None:
    if operands:
        raise CommandError(f"`feynrl-jax {command}` takes no positional arguments, got {' '.join(operands)}.")


def _one_run_dir(command: str, operands: list[str]) -> str:
    if len(operands) != 1:
        raise CommandError(f"usage: feynrl-jax {command} RUN_DIR" + (" --out=DIR" if command == "export" else ""))
    if not os.path.isdir(operands[0]):
        raise CommandError(f"run folder {operands[0]!r} does not exist.")
    return operands[0]


COMMANDS: dict[str, Callable[[list[str]], None]] = {
    "train": train,
    "eval": evaluate,
    "convert": convert,
    "export": export,
    "plot": plot,
}


def _append_traceback(path: str, headline: str, error: BaseException) -> bool:
    """Appends `headline` and the traceback of `error` to the run log; False when the file cannot be written."""
    try:
        with open(path, "a") as f:
            f.write(f"{headline}\n{''.join(traceback.format_exception(error))}")
        return True
    except OSError:  # a full disk, e.g.: the one-line error is all the user gets
        return False


REPORTED = (ConfigError, CommandError, InputError, RunFailed, OSError)
"""Errors printed as one line (their traceback goes to the run log); anything else is a bug."""


def reported_error(error: BaseException) -> BaseException | None:
    """The error behind `error` to report as one line: through Ray's wrappers and `raise ... from` chains."""
    seen = set()
    todo = [error]
    while todo:
        e = unwrap(todo.pop(0))
        if id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, REPORTED):
            return e
        todo += [c for c in (e.__cause__, e.__context__) if c is not None]
    return None


def error_line(error: BaseException) -> str:
    """One line (or a config's problem list) saying what went wrong and what it concerns."""
    if isinstance(error, OSError) and not isinstance(error, InputError | RunFailed):
        what = error.strerror or str(error) or type(error).__name__
        where = " -> ".join(str(f) for f in (error.filename, error.filename2) if f)
        return f"{what}: {where}" if where else what
    return str(error)


def main(argv: list[str]) -> None:
    """Dispatches `argv[1]` (the subcommand) with the remaining positional arguments."""
    if len(argv) < 2 or argv[1] not in COMMANDS:
        given = f"unknown command {argv[1]!r}; " if len(argv) >= 2 else ""
        _exit(f"{given}commands: {', '.join(COMMANDS)}.\n{USAGE}", EXIT_USAGE)
    try:
        COMMANDS[argv[1]](argv[2:])
    except Exception as e:
        reported = reported_error(e)
        if reported is None:
            raise
        message = error_line(reported)
        if _run_log is not None and _append_traceback(_run_log, f"feynrl-jax {argv[1]} failed: {message}", e):
            message += f" (traceback: {_run_log})"
        _exit(message, getattr(reported, "exit_code", EXIT_BAD_INPUT))


def run() -> None:
    """The console-script entry point (re-executed once with the allocator tunables: see `feynrl_jax.host_memory`)."""
    # stdlib only; the CLI's top level stays light
    from feynrl_jax.host_memory import reexec_with_allocator_tunables

    reexec_with_allocator_tunables()
    # A console script imports from its own bin/ folder; "module:function" references to your code (`algo.name`,
    # `rollout.rewards`) are found in the working directory, as with `python -m`. Ray's local workers start there.
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    from feynrl_jax.cache_dirs import set_compile_cache_dir
    from feynrl_jax.cli import supervisor, xla_flags

    xla_flags.set_cpu_collective_flags(os.environ)  # before JAX starts (in this process or the child)
    set_compile_cache_dir(os.environ)  # JAX's persistent compilation cache, unless the user set or emptied it

    if supervisor.wanted(sys.argv, os.environ):  # a multi-process job: see feynrl_jax.cli.supervisor
        sys.exit(supervisor.supervise(sys.argv))
    app.run(main, flags_parser=parse_flags)


if __name__ == "__main__":
    run()
