#!/bin/bash
# call 2 (prepared 2026-12-05, fifteenth session; not run: no device was lent), transformers 5.25.0 (the newest release, carried in .whl-tf): the 3B plain HF
# default side by side with everything on the GPU and DeepSpeed ZeRO-3 offload (pin_memory=True), the re-fit planner's
# prediction logged; then two GPT-OSS-20B layers at 16 x 2048, eager against compiled (experts eager / compiled too).
set -u
rm -rf ~/.cache/torch_extensions
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site-tf .whl-tf/*.whl 2>&1 | tail -1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | tail -1
python3 -m pip install -q --no-index --no-deps --no-build-isolation --target /tmp/site .whl/deepspeed-*.tar.gz 2>&1 | tail -1
export PYTHONPATH=/tmp/site-tf:/tmp/site:$PWD:$PWD/recipes PYTHONUNBUFFERED=1 MACHINE=nvidia-h200
python3 -c "import torch, transformers; print(torch.__version__, transformers.__version__)"
T0=$SECONDS
timeout 320 python3 recipes/defaults_vs_baselines.py --model qwen2_5_3b --micro-batch 8 --warmup 3 --steps 5 --modes megatrain-default all-on-gpu deepspeed --timeout 150 --out $OUT/throughput > $OUT/compare3b.log 2>&1; echo "3b side by side rc=$? $((SECONDS-T0)) s"
grep -v "Warning\|warn(" $OUT/compare3b.log | grep '^{\|Error\|error\|placement chosen' | cut -c1-1200
T0=$SECONDS
LEFT=$((570 - SECONDS))
timeout $LEFT python3 recipes/moe_layer.py --micro-batch 16 --seq-len 2048 --layers 2 --reps 3 --attn fused_sinks --experts grouped_mm_gather --compile --profile > $OUT/moe_layer.log 2>&1; echo "moe layer rc=$? $((SECONDS-T0)) s"
grep -v "Warning\|warn(" $OUT/moe_layer.log | tail -36 | cut -c1-260
cat $OUT/throughput.md 2>/dev/null | grep "^| 20" | cut -d'|' -f5,7,9-13 | cut -c1-200
cd $OUT && tar czf /tmp/all.tgz . && rm -rf $OUT/* && mv /tmp/all.tgz $OUT/call2.tgz
