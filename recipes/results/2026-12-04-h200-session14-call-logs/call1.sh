#!/bin/bash
# call 1 (2026-12-04, fourteenth session): the cuda tests the thirteenth session left unrun on the GPU (the hold flag,
# the mid-run optimizer-state load, the single home() in the engine's send); Liger Kernel 0.8.5 and torch.compile
# against Hugging Face's eager code on one 7B / 3B layer and on the head + loss (recipes/fused_kernels.py); the 3B
# plain HF module with Liger applied by the module itself, under the default strategy and all on the GPU.
set -u
rm -rf ~/.cache/torch_extensions
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl .whl-liger/*.whl 2>&1 | tail -1
export PYTHONPATH=/tmp/site:$PWD:$PWD/recipes PYTHONUNBUFFERED=1 MACHINE=nvidia-h200
python3 -c "import triton, liger_kernel, torch, transformers; print('triton', triton.__version__, 'torch', torch.__version__, 'transformers', transformers.__version__)"
T0=$SECONDS
timeout 150 python3 -m pytest -q -s -p no:cacheprovider tests/test_parity_cuda.py tests/test_auto_placement_cuda.py -k "three_slots or no_hidden_sync or keep_cache_offload or home_on_demand or measures or backs_off" > $OUT/cuda_tests.log 2>&1; echo "cuda tests rc=$? $((SECONDS-T0)) s"
grep -E "passed|failed|^\(a\)|^\(d\)|^\(e\)|^\(h\)|worst|Error|assert|placement chosen" $OUT/cuda_tests.log | cut -c1-300 | tail -20
T0=$SECONDS
timeout 230 python3 recipes/fused_kernels.py --repeats 5 > $OUT/fused_kernels.log 2>&1; echo "fused kernels rc=$? $((SECONDS-T0)) s"
grep "^|\|torch\|Error" $OUT/fused_kernels.log | cut -c1-300
T0=$SECONDS
LEFT=$((580 - SECONDS))
timeout $LEFT python3 recipes/defaults_vs_baselines.py --liger --model qwen2_5_3b --micro-batch 8 --warmup 3 --steps 5 --modes megatrain-default all-on-gpu --timeout $(( (LEFT - 10) / 2 )) --out $OUT/throughput > $OUT/compare3b_liger.log 2>&1; echo "3b liger rc=$? $((SECONDS-T0)) s"
grep -v "Warning\|warn(" $OUT/compare3b_liger.log | grep '^{\|Error' | cut -c1-900
cd $OUT && tar czf /tmp/all.tgz . && rm -rf $OUT/* && mv /tmp/all.tgz $OUT/call1.tgz
