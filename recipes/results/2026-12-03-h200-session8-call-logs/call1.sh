#!/bin/bash
# call 1 (2026-12-03, eighth session): the GPU tests (fused_sinks on CUDA, the single gradient buffer of 2bea461),
# the 7B CausalLM with nothing placed (issue 15, never measured: killed by the host before 2bea461) with a profile
# of two steps, and the plain HF 7B with nothing placed at 16 x 2048 tokens in one micro-batch
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | tail -1
export PYTHONPATH=/tmp/site:$PWD:$PWD/recipes PYTHONUNBUFFERED=1 MACHINE=nvidia-h200
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; python3 -c "import torch,transformers;print(torch.__version__, transformers.__version__)"; free -g | head -2
T0=$SECONDS
timeout 200 python3 -m pytest -q -s -p no:cacheprovider tests/test_sink_attention.py -m cuda tests/test_auto_placement_cuda.py tests/test_long_context_cuda.py tests/test_parity_cuda.py > $OUT/cuda_tests.log 2>&1; echo "cuda tests rc=$? $((SECONDS-T0)) s"
grep -E "passed|failed|FAIL|Error|fused_sinks on" $OUT/cuda_tests.log | cut -c1-300 | tail -12
T0=$SECONDS
NULLS="strategy.engine.slots=null strategy.engine.keep_activations=null strategy.engine.kept_saves=null strategy.engine.cache_weights=null strategy.engine.grad_buffers=null"
PROF="+trainer.callbacks.profile._target_=profile_breakdown.StepProfiler +trainer.callbacks.profile.first_step=6 +trainer.callbacks.profile.steps=2 +trainer.callbacks.profile.out_dir=/tmp/profile7b +trainer.callbacks.profile.top=15"
timeout 250 python3 recipes/bench.py --timeout 240 --out $OUT/throughput --run "experiment=bench_7b hardware=auto trainer.max_steps=8 $NULLS $PROF" > $OUT/causallm7b.log 2>&1; echo "7b causallm default rc=$? $((SECONDS-T0)) s"
grep -v "Warning\|warn(" $OUT/causallm7b.log | tail -4 | cut -c1-700
grep -h "placement\|profile steps\|ms/step" outputs/bench/*/output.log $OUT/causallm7b.log 2>/dev/null | cut -c1-260 | tail -24
T0=$SECONDS
LEFT=$((585 - SECONDS))
timeout $LEFT python3 recipes/defaults_vs_baselines.py --model qwen2_5_7b --micro-batch 16 --accumulate 1 --warmup 3 --steps 3 --modes megatrain-default --timeout $((LEFT - 10)) --out $OUT/throughput > $OUT/plain7b.log 2>&1; echo "7b plain default 16x2048 rc=$? $((SECONDS-T0)) s"
grep -v "Warning\|warn(" $OUT/plain7b.log | tail -8 | cut -c1-500
cat $OUT/throughput.md 2>/dev/null | grep "^| 20" | cut -c1-900
cp -r outputs/bench $OUT/bench_runs 2>/dev/null; rm -f $OUT/bench_runs/*/trace*; cd $OUT && tar czf /tmp/all.tgz . && rm -rf $OUT/* && mv /tmp/all.tgz $OUT/call1.tgz
