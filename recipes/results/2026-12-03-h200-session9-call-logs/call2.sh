#!/bin/bash
# call 2 (2026-12-03, ninth session): the 3B plain HF module with nothing placed (the strategy now also
# chooses to update the embedding on the device) side by side with everything on the GPU and DeepSpeed ZeRO-3
# offload (pin_memory=True): issue 15's ratios
set -u
rm -rf ~/.cache/torch_extensions
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | tail -1
python3 -m pip install -q --no-index --no-deps --no-build-isolation --target /tmp/site .whl/deepspeed-*.tar.gz 2>&1 | tail -1
export PYTHONPATH=/tmp/site:$PWD:$PWD/recipes PYTHONUNBUFFERED=1 MACHINE=nvidia-h200
T0=$SECONDS
LEFT=$((580 - SECONDS))
timeout $LEFT python3 recipes/defaults_vs_baselines.py --model qwen2_5_3b --micro-batch 8 --timeout 180 --out $OUT/throughput > $OUT/compare3b.log 2>&1; echo "3b side by side rc=$? $((SECONDS-T0)) s"
grep -v "Warning\|warn(" $OUT/compare3b.log | cut -c1-600 | tail -12
cat $OUT/throughput.md 2>/dev/null | grep "^| 20" | cut -c1-700
cp -r outputs/bench $OUT/bench_runs 2>/dev/null; rm -f $OUT/bench_runs/*/trace*; cd $OUT && tar czf /tmp/all.tgz . && rm -rf $OUT/* && mv /tmp/all.tgz $OUT/call2.tgz
