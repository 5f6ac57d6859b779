"""The XLA:CPU code generation of the suite's processes: LLVM's optimisation passes off. Not a test module:
tests/conftest.py, tests_vllm/conftest.py and the helpers that build a subprocess's `XLA_FLAGS` import it.

On this project's 2-core CI machine, compiling dominates the suite: a tiny model's programs run in milliseconds but
compile in seconds, and most of a compile is LLVM optimising the code XLA emits for it. The suite therefore runs XLA
at backend optimisation level 0 (`--xla_backend_optimization_level=0`): the same HLO, the same HLO passes (fusion,
layout, SPMD partitioning) and the same library calls for matrix products; only the machine code of the fused loops
is left unoptimised. Measured on the 2-core AMD EPYC (AVX-512) of 2026-12-02: the LoRA target and sharded-step
tests 62.8 s -> 36.9 s wall, 98 -> 50 busy core-seconds; SmolLM2's engine parity and weights tests 75.0 -> 68.4 s.

What a check proves at level 0 holds at XLA's default level: XLA:CPU compiles without fast-math by default, so
LLVM may not reassociate or approximate floating-point operations at any level, and the two levels can differ only
in the rounding of fused multiply-adds and of vectorised reduction order, float32 rounding that every tolerance of
the suite already covers (bitwise checks compare two runs at the same level). tests/test_xla_codegen.py checks
exactly that on the model's forward and backward pass and the engine's decoding: the default level, in a
subprocess, against this session's level. `make demo`, the notebooks, the launch-script tests, the benchmarks and
every user's run compile at XLA's default. `XLA_FLAGS=--xla_backend_optimization_level=N make test` runs the suite,
subprocesses included, at N, except the unit tests whose jits pass level 0 as their own compiler options (they did
so before the whole suite did: `test_train_step.FAST_COMPILE` and its like).
"""

from __future__ import annotations

import os
import re

FLAG = "--xla_backend_optimization_level"
SUITE_LEVEL = 0
_LEVEL = re.compile(r"(?:^|\s)--?xla_backend_optimization_level=(\S+)")


def session_level(environ=os.environ) -> str:
    """The backend optimisation level of `environ["XLA_FLAGS"]` (its last one), else the suite's (0)."""
    levels = _LEVEL.findall(environ.get("XLA_FLAGS", ""))
    return levels[-1] if levels else str(SUITE_LEVEL)


def with_suite_codegen(xla_flags: str, environ=os.environ) -> str:
    """`xla_flags` with this session's backend optimisation level appended, unless `xla_flags` names a level."""
    if _LEVEL.search(xla_flags):
        return xla_flags
    return f"{xla_flags} {FLAG}={session_level(environ)}".strip()


def for_rl_run(xla_flags: str) -> str:
    """`xla_flags` without any backend optimisation level: XLA's default level, where users compile and where the
    suite's RL runs (their Ray actors and their CLI processes) compile (module docstring)."""
    return " ".join(f for f in xla_flags.split() if not _LEVEL.match(f))
