#!/bin/bash
# call 1 (2026-12-03, twelfth session): the cuda-marked tests after session 11's update_on_device=N choice
# (fp32 parity with three slots and N blocks, no hidden syncs, the automatic placement and its back-off); the 3B
# plain HF default (the strategy now chooses update_on_device=8, keep 33) side by side with everything on the GPU and
# DeepSpeed ZeRO-3 offload (pin_memory=True) in one call, 5 timed steps each; the plain HF 7B default at 16 x 2048
set -u
rm -rf ~/.cache/torch_extensions
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | tail -1
python3 -m pip install -q --no-index --no-deps --no-build-isolation --target /tmp/site .whl/deepspeed-*.tar.gz 2>&1 | tail -1
export PYTHONPATH=/tmp/site:$PWD:$PWD/recipes PYTHONUNBUFFERED=1 MACHINE=nvidia-h200
T0=$SECONDS
timeout 170 python3 -m pytest -q -s -p no:cacheprovider tests/test_parity_cuda.py tests/test_auto_placement_cuda.py -k "three_slots or no_hidden_sync or auto_placement or placement" > $OUT/cuda_tests.log 2>&1; echo "cuda tests rc=$? $((SECONDS-T0)) s"
grep -E "passed|failed|PASS|FAIL|^\(a\)|^\(e\)|worst|Error|assert|placement chosen" $OUT/cuda_tests.log | cut -c1-300 | tail -16
T0=$SECONDS
timeout 260 python3 recipes/defaults_vs_baselines.py --model qwen2_5_3b --micro-batch 8 --warmup 3 --steps 5 --modes megatrain-default all-on-gpu deepspeed --timeout 140 --out $OUT/throughput > $OUT/compare3b.log 2>&1; echo "3b side by side rc=$? $((SECONDS-T0)) s"
grep -v "Warning\|warn(" $OUT/compare3b.log | grep '^{' | cut -c1-900
T0=$SECONDS
LEFT=$((580 - SECONDS)); [ $LEFT -gt 170 ] && LEFT=170
[ $LEFT -gt 60 ] && timeout $LEFT python3 recipes/defaults_vs_baselines.py --model qwen2_5_7b --micro-batch 16 --accumulate 1 --warmup 3 --steps 3 --modes megatrain-default --timeout $((LEFT - 10)) --out $OUT/throughput > $OUT/plain7b.log 2>&1; echo "7b plain default 16x2048 rc=$? $((SECONDS-T0)) s"
grep -v "Warning\|warn(" $OUT/plain7b.log | grep '^{' | cut -c1-900
cd $OUT && tar czf /tmp/all.tgz . && rm -rf $OUT/* && mv /tmp/all.tgz $OUT/call1.tgz
