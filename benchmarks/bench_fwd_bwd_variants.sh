#!/usr/bin/env bash
# Our bf16 forward+backward (SmolLM2-135M shapes, 8 x 256 tokens, oneDNN products) under each rematerialisation
# policy and layer layout, one after the other, with PyTorch bf16 autocast timed at both ends of the script (the
# spread between its two runs shows how much the machine drifted meanwhile).
#   bash benchmarks/bench_fwd_bwd_variants.sh            # STEPS=6 by default; PYTHON=.venv/bin/python to choose
set -euo pipefail
cd "$(dirname "$0")/.."
run="${PYTHON:-python} benchmarks/bench_model_fwd_bwd.py --precision bfloat16 --steps ${STEPS:-6} --backends onednn"
echo "== remat auto (full on a CPU in bf16), scanned layers, with PyTorch"; $run
echo "== remat none"; $run --remat none --skip-torch
echo "== remat dots"; $run --remat dots --skip-torch
echo "== unrolled layers, remat auto"; $run --unrolled --skip-torch
echo "== unrolled layers, remat none"; $run --unrolled --remat none --skip-torch
echo "== remat auto again, with PyTorch"; $run
