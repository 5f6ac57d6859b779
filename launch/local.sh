#!/usr/bin/env bash
# One machine, one process: CPU, one GPU or one TPU VM host (JAX_PLATFORMS=cuda or tpu, with JAX's CUDA plugin or the
# TPU runtime installed in .venv: see launch/README.md). One process of a multi-host job started by hand, too.
#
#   launch/local.sh train --config=configs/grpo_demo.py:runlocal
#   launch/local.sh eval --config=configs/eval_smollm2.py --config.eval.n_samples=16
#   JAX_PLATFORMS=cuda launch/local.sh train --config=configs/grpo_demo.py --config.model.param_dtype=bfloat16 \
#       --config.model.compute_dtype=bfloat16 --config.model.master_dtype=float32   # bf16, float32 masters: docs/DTYPES.md
#
# Fake N CPU devices to debug sharding on a laptop: FAKE_CPU_DEVICES=8 launch/local.sh train ...
set -euo pipefail
cd "$(dirname "$0")/.."
[[ -x .venv/bin/feynrl-jax ]] || make setup
export JAX_PLATFORMS="${JAX_PLATFORMS:-cpu}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export RAY_AUTH_MODE="${RAY_AUTH_MODE:-disabled}" WANDB_MODE="${WANDB_MODE:-offline}"
if [[ -n "${FAKE_CPU_DEVICES:-}" ]]; then
  export XLA_FLAGS="${XLA_FLAGS:-} --xla_force_host_platform_device_count=${FAKE_CPU_DEVICES}"
fi
exec .venv/bin/feynrl-jax "$@"
