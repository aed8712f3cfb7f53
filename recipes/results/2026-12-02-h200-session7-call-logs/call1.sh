#!/bin/bash
# call 1 (2026-12-02, seventh session): GPT-OSS layer kernels (eager / flex / fused_sinks attention), the GPU
# tests (the store's single gradient buffer, 2bea461), a GPT-OSS-20B-shaped 8-layer run with fused_sinks at 64 K tokens/step
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | tail -1
export PYTHONPATH=/tmp/site:$PWD:$PWD/recipes PYTHONUNBUFFERED=1 MACHINE=nvidia-h200
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; python3 -c "import torch,transformers;print(torch.__version__, transformers.__version__)"
T0=$SECONDS
timeout 150 python3 recipes/moe_layer.py --micro-batch 16 --seq-len 2048 --attn eager,flex_attention,fused_sinks --experts grouped_mm > $OUT/moe_layer.log 2>&1; echo "moe layer rc=$? $((SECONDS-T0)) s"
grep "^|\|GPT-OSS\|Error" $OUT/moe_layer.log | cut -c1-300
T0=$SECONDS
timeout 170 python3 -m pytest -q -p no:cacheprovider tests/test_auto_placement_cuda.py tests/test_long_context_cuda.py tests/test_parity_cuda.py > $OUT/cuda_tests.log 2>&1; echo "cuda tests rc=$? $((SECONDS-T0)) s"
grep -E "passed|failed|FAIL|Error" $OUT/cuda_tests.log | cut -c1-300 | tail -8
T0=$SECONDS
LEFT=$((580 - SECONDS))
timeout $LEFT python3 train.py model=gpt_oss_20b model.config.num_hidden_layers=8 data=synthetic hardware=auto trainer=sweep data.batch_size=32 data.seq_len=2048 trainer.max_steps=5 +trainer.callbacks.profile._target_=profile_breakdown.StepProfiler +trainer.callbacks.profile.first_step=3 +trainer.callbacks.profile.steps=2 +trainer.callbacks.profile.out_dir=/tmp/profile hydra.run.dir=$OUT/moe_run > $OUT/moe_run.log 2>&1; echo "gpt-oss 8L rc=$? $((SECONDS-T0)) s"
grep -v "Warning\|warn(" $OUT/moe_run.log | grep -i "placement\|busy\|idle\|wall\|tflops\|error\|plan\|bottleneck\|s/step" | tail -30 | cut -c1-400
cat $OUT/moe_run/metrics.json 2>/dev/null | head -c 1500; echo
cd $OUT && tar czf /tmp/all.tgz --exclude='*.json.gz' --exclude='*trace*' . && rm -rf $OUT/* && mv /tmp/all.tgz $OUT/call1.tgz
