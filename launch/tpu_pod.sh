#!/usr/bin/env bash
# Run on every host of a Cloud TPU pod slice (v4-32, v5e-64, ...): one process per host.
#
#   TPU_NAME=my-pod ZONE=us-central2-b launch/tpu_pod.sh train --config=configs/grpo_demo.py \
#       --config.mesh.fsdp=-1 --config.mesh.data=1 --config.mesh.rules=fsdp \
#       --config.model.param_dtype=bfloat16 --config.model.compute_dtype=bfloat16 --config.model.master_dtype=float32
#
# Every host runs the same command; feynrl_jax.sharding.multihost sees the TPU environment and calls
# jax.distributed.initialize() with no arguments (the TPU runtime supplies coordinator, process count and id).
# The repository must already be checked out on every host at REMOTE_DIR (default feynrl-jax, relative to the home
# directory; e.g. with a `--worker=all` git clone). Each host runs `make setup` and adds the TPU runtime (jax[tpu]
# at the installed jax version) to its .venv before the run.
set -euo pipefail
: "${TPU_NAME:?set TPU_NAME}" "${ZONE:?set ZONE}"
: "${1:?usage: launch/tpu_pod.sh train|eval --config=... [overrides]}"
REMOTE_DIR="${REMOTE_DIR:-feynrl-jax}"
remote_dir=$(printf '%q' "${REMOTE_DIR#\~/}")  # ssh starts in the home directory
args=$(printf ' %q' "$@")
setup='make setup >/dev/null &&
  .venv/bin/pip install --quiet "jax[tpu]==$(.venv/bin/python -c "import jax; print(jax.__version__)")"'
exec gcloud compute tpus tpu-vm ssh "${TPU_NAME}" --zone="${ZONE}" --worker=all --command="
  cd ${remote_dir} && ${setup} &&
  JAX_PLATFORMS=tpu HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 .venv/bin/feynrl-jax${args}"
