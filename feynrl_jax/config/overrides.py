"""Checks `--config.a.b=value` command-line overrides against the config before absl applies them.

`ml_collections.config_flags` applies overrides to a locked config, but its errors for a misspelt key or an
unparsable value name neither the closest valid key nor the expected type in a stable way. `check_overrides`
runs first, on the same config file, and raises a `ConfigError` that does: "unknown key optim.lrr (did you
mean optim.lr?)", "optim.lr expects float, got 'fast'".
"""

from __future__ import annotations

import dataclasses
import re

from absl import flags
from ml_collections import ConfigDict
from ml_collections.config_flags import config_path

from feynrl_jax.config.errors import ConfigError, Problem, suggestion
from feynrl_jax.config.validation import flatten

# The parsers config_flags itself uses for each field type; tuples are left to config_flags.
_PARSERS = {
    float: flags.FloatParser(),
    int: flags.IntegerParser(),
    bool: flags.BooleanParser(),
}


@dataclasses.dataclass(frozen=True)
class Override:
    """One `--config.<path>=<raw>` argument.

    Attributes:
        path: the dotted key, e.g. "optim.lr".
        raw: the value as typed, or None for a bare `--config.x` / `--noconfig.x` boolean.
        negated: the `--noconfig.x` form.
        separate: the value was the next argument (`--config.x value`); absl does not do that for booleans.
    """

    path: str
    raw: str | None
    negated: bool = False
    separate: bool = False


def parse_argv(argv: list[str], flag: str = "config") -> tuple[str | None, list[Override]]:
    """Finds the config file argument and the overrides in a command line.

    Args:
        argv: the arguments, program name included or not.
        flag: the config flag's name.

    Returns:
        `(spec, overrides)`: the value of `--<flag>` ("configs/x.py:runlocal") or None, and the overrides in
        order. A value given as the next argument (`--config.optim.lr 3e-6`) is taken when it does not start
        with "-".
    """
    spec = None
    overrides = []
    pattern = re.compile(rf"^--?(no)?{re.escape(flag)}(\.[^=]+)?(=(.*))?$", re.DOTALL)
    i = 0
    while i < len(argv):
        arg = argv[i]
        i += 1
        if arg == "--":
            break
        match = pattern.match(arg)
        if not match:
            continue
        negated, path, has_value, value = match.group(1), match.group(2), match.group(3), match.group(4)
        separate = not has_value and not negated and i < len(argv) and not argv[i].startswith("-")
        if separate:
            value = argv[i]
            i += 1
        if path is None:
            spec = value
        else:
            overrides.append(Override(path[1:], value, negated=bool(negated), separate=separate))
    return spec, overrides


def check_overrides(config: ConfigDict, overrides: list[Override]) -> None:
    """Raises `ConfigError` naming every override whose key is unknown or whose value does not parse.

    Args:
        config: the config the overrides apply to (as `get_config(arg)` returned it).
        overrides: from `parse_argv`.
    """
    known = [path for path, _ in flatten(config)]
    problems = []
    for override in overrides:
        key = override.path
        if key not in known:
            problems.append(Problem(key, f"unknown key {key}{suggestion(key, known)}."))
            continue
        field_type = config_path.get_type(key, config)
        if override.negated and field_type is not bool:
            problems.append(Problem(key, f"--no{key} only applies to bool keys; {key} expects {field_type.__name__}."))
            continue
        if field_type is bool and override.separate:
            continue  # `--config.flag next_arg`: absl reads a bare boolean and leaves next_arg alone.
        if override.raw is None:
            if field_type is not bool:
                problems.append(Problem(key, f"{key} expects {field_type.__name__} but was given no value."))
            continue
        parser = _PARSERS.get(field_type)
        if parser is None:
            continue  # str accepts anything; tuples and sections are parsed by config_flags.
        try:
            parser.parse(override.raw)
        except ValueError:
            problems.append(Problem(key, f"{key} expects {field_type.__name__}, got {override.raw!r}."))
    if problems:
        raise ConfigError(problems)
