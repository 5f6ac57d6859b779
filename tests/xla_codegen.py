"""The XLA:CPU code generation of the suite's processes: LLVM's optimisation passes off, but in RL runs. Not a test
module: tests/conftest.py, tests_vllm/conftest.py and the helpers that build a subprocess's `XLA_FLAGS` import it.

On this project's 2-core CI machine, compiling dominates most of the suite: a tiny model's programs run in
milliseconds but compile in seconds, and most of a compile is LLVM optimising the code XLA emits. The pytest
processes and the SFT, DPO and evaluation runs they start therefore compile at backend optimisation level 0
(`--xla_backend_optimization_level=0`): the same HLO, the same HLO passes (fusion, layout, SPMD partitioning) and
the same library calls for matrix products; only the machine code of the fused loops is left unoptimised. Measured
on the 2-core AMD EPYC (AVX-512) of 2026-12-02: the LoRA target and sharded-step tests 62.8 -> 36.9 s, 98 -> 50
busy core-seconds; in a whole `make test`, `test_lora.py` 0.71x its time, `test_engine.py` 0.70x, `test_models.py`
0.58x, the two-process SFT and DPO runs of `test_multiprocess_cli.py` 0.60x and 0.63x.

RL runs (the Ray actors of the in-process runs, every process of an RL CLI run) compile at XLA's default level, as
users do: they run their programs many times (decode steps and updates over the tiny model's 49,152-column
vocabulary) and load most of them from the session's compilation cache, so unoptimised code cost them more than it
saved. With every process at level 0 the RL test files took 1.13-1.27x their time in the same `make test`, and one
tiny RL update 2.5-3.1 s against 0.9-1.3 s.

What a check proves at level 0 holds at the default level: XLA:CPU compiles without fast-math by default, so LLVM
may not reassociate or approximate floating-point operations at either level, and the two levels differ at float32
rounding only, which the suite's tolerances cover (its bitwise checks compare runs at one level).
tests/test_xla_codegen.py checks that on the model's log-probabilities and gradients, GRPO train steps and the
engine's decoding, the default level in one subprocess against level 0 in another (measured: at most 9.5e-7 on
log-probabilities of about -5, 2.2e-8 on gradient entries of scale 0.04, the same tokens). `make demo`, the
notebooks, the launch-script tests, the benchmarks and every user's run compile at XLA's default.
`XLA_FLAGS=--xla_backend_optimization_level=N make test` compiles at N where the suite would use 0, except in the
unit tests whose jits pass level 0 as their own compiler options (they did so before the whole suite did:
`test_train_step.FAST_COMPILE` and its like).
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
