#!/bin/bash
# bash recipes/results/2026-12-05-session22-call-logs/call2.sh   (carry .whl; nvidia-h200)
# Session 22, second call: the GPU checks of the automatic placement (tests/test_auto_placement_cuda.py, its new
# (d): a host-bound GPT-OSS under Trainer(strategy="megatrain") is warned once, after the placement's line) and the
# router loss's fp32 parity on the GPU (tests/test_compiled_blocks_cuda.py (g)), then
# session 21's call1.sh PART=2 (Qwen3 and GPT-OSS at the profile's 4 x 2048: what the planner's pick gains).
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | grep -v "already exists" | tail -1
T0=$SECONDS
PYTHONPATH=/tmp/site:$PWD timeout 270 python3 -m pytest -q -s -p no:cacheprovider tests/test_auto_placement_cuda.py tests/test_compiled_blocks_cuda.py -k "auto_placement or router_loss" > $OUT/cuda_tests.log 2>&1
echo "cuda tests rc=$? $((SECONDS-T0)) s"
grep -E "passed|failed|^\([a-g]\)|worst|Error|assert|chosen|warning:|mixture" $OUT/cuda_tests.log | cut -c1-400 | tail -30
mkdir -p /tmp/keep && cp $OUT/cuda_tests.log /tmp/keep/
PART=2 BUDGET=$((590 - SECONDS)) bash recipes/results/2026-12-05-session21-call-logs/call1.sh
cp /tmp/keep/cuda_tests.log $OUT/
