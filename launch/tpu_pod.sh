#!/usr/bin/env bash
# Run on every host of a Cloud TPU pod slice (v4-32, v5e-64, ...): one process per host.
#
#   TPU_NAME=my-pod ZONE=us-central2-b launch/tpu_pod.sh train --config=configs/grpo_demo.py \
#       --config.mesh.fsdp=-1 --config.mesh.data=1 --config.mesh.rules=fsdp \
#       --config.model.param_dtype=bfloat16 --config.model.compute_dtype=bfloat16
#
# Every host runs the same command; feynrl_jax.sharding.multihost sees the TPU environment and calls
# jax.distributed.initialize() with no arguments (the TPU runtime supplies coordinator, process count and id).
# The repository must already be checked out at $REMOTE_DIR on every host (e.g. with `--worker=all` git clone).
set -euo pipefail
: "${TPU_NAME:?set TPU_NAME}" "${ZONE:?set ZONE}"
REMOTE_DIR="${REMOTE_DIR:-~/feynrl-jax}"
args=$(printf '%q ' "$@")
exec gcloud compute tpus tpu-vm ssh "${TPU_NAME}" --zone="${ZONE}" --worker=all --command="
  cd ${REMOTE_DIR} && make setup >/dev/null &&
  JAX_PLATFORMS=tpu HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 .venv/bin/feynrl-jax ${args}"
