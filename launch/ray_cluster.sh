#!/usr/bin/env bash
# Submit a run to an existing Ray cluster (rollout workers and the trainer become Ray actors on it).
#
#   RAY_ADDRESS=http://head-node:8265 launch/ray_cluster.sh train --config=configs/grpo_demo.py \
#       --config.run_dir=/shared/runs/grpo_demo --config.rollout.num_workers=4
#
# The job runs `feynrl-jax` on the cluster with a copy of this folder as its working directory (files that
# .gitignore names, such as .venv/ and runs/, are left out) and `--config.ray.address=auto`, so the driver joins the
# cluster it was submitted to instead of starting its own. A relative run_dir lands in that copy on the head
# node: give an absolute --config.run_dir on storage the nodes share. Every node needs the same Python
# environment, with `feynrl-jax` on the PATH of the processes Ray starts (`pip install -e .` in the image, or the
# cluster started from an activated .venv); the cluster needs Ray's job server (`ray[default]`).
set -euo pipefail
cd "$(dirname "$0")/.."
: "${RAY_ADDRESS:?set RAY_ADDRESS to the dashboard address of the cluster, e.g. http://head-node:8265}"
command="${1:?usage: launch/ray_cluster.sh train|eval --config=... [overrides]}"
shift
ray=.venv/bin/ray
[[ -x "${ray}" ]] || ray=ray
exec "${ray}" job submit --address="${RAY_ADDRESS}" --working-dir=. \
  --runtime-env-json='{"env_vars": {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}}' \
  -- feynrl-jax "${command}" "$@" --config.ray.address=auto
