#!/bin/bash
# call 1 (2026-12-03, tenth session; 382 s of device time left): the first block updated on the device too
# (update_on_device): fp32 CUDA parity both ways and no hidden sync, then the 3B plain HF module with nothing
# placed side by side with everything on the GPU (issue 15's 1.15x)
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | tail -1
export PYTHONPATH=/tmp/site:$PWD:$PWD/recipes PYTHONUNBUFFERED=1 MACHINE=nvidia-h200
T0=$SECONDS
timeout 55 python3 -m pytest -q -s -p no:cacheprovider tests/test_parity_cuda.py -k "three_slots and True or no_hidden_sync" > $OUT/cuda_tests.log 2>&1; echo "cuda parity/sync tests rc=$? $((SECONDS-T0)) s"
grep -E "passed|failed|^\(a\)|^\(e\)|worst|Error|assert" $OUT/cuda_tests.log | cut -c1-300 | tail -10
T0=$SECONDS
timeout 170 python3 recipes/defaults_vs_baselines.py --model qwen2_5_3b --micro-batch 8 --warmup 3 --steps 3 --modes megatrain-default all-on-gpu --timeout 80 --out $OUT/throughput > $OUT/compare3b.log 2>&1; echo "3b side by side rc=$? $((SECONDS-T0)) s"
grep -v "Warning\|warn(" $OUT/compare3b.log | cut -c1-600 | tail -8
cat $OUT/throughput.md 2>/dev/null | grep "^| 20" | cut -c1-700
grep -h "placement\|chose" outputs/bench/*/output.log 2>/dev/null | cut -c1-400 | tail -6
