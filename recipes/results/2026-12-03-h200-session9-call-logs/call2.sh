#!/bin/bash
# call 2 (2026-12-03, ninth session): with the planner weighing the embedding's device update against a kept
# block (fastest_fit), the 7B CausalLM with nothing placed again (profile: where the GPU waits now), then the
# 3B plain HF module with nothing placed side by side with everything on the GPU and DeepSpeed ZeRO-3 offload
# (pin_memory=True), issue 15's ratios
set -u
rm -rf ~/.cache/torch_extensions
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | tail -1
python3 -m pip install -q --no-index --no-deps --no-build-isolation --target /tmp/site .whl/deepspeed-*.tar.gz 2>&1 | tail -1
export PYTHONPATH=/tmp/site:$PWD:$PWD/recipes PYTHONUNBUFFERED=1 MACHINE=nvidia-h200
T0=$SECONDS
NULLS="strategy.engine.slots=null strategy.engine.keep_activations=null strategy.engine.kept_saves=null strategy.engine.cache_weights=null strategy.engine.grad_buffers=null"
PROF="+trainer.callbacks.profile._target_=profile_breakdown.StepProfiler +trainer.callbacks.profile.first_step=6 +trainer.callbacks.profile.steps=1 +trainer.callbacks.profile.out_dir=/tmp/profile7b +trainer.callbacks.profile.top=4 +trainer.callbacks.profile.gaps=6"
timeout 200 python3 recipes/bench.py --timeout 190 --out $OUT/throughput --run "experiment=bench_7b hardware=auto trainer.max_steps=8 trainer.log_every_n_steps=1 +trainer.callbacks.throughput.window=1 $NULLS $PROF" > $OUT/causallm7b.log 2>&1; echo "7b causallm default rc=$? $((SECONDS-T0)) s"
grep -h "placement\|profile steps\|ms/step\|  gap " outputs/bench/*/output.log 2>/dev/null | cut -c1-330 | tail -16
cut -d, -f1-9 outputs/bench/*/logs/metrics.csv 2>/dev/null | grep -v "^,,,," | cut -c1-120
T0=$SECONDS
LEFT=$((580 - SECONDS))
timeout $LEFT python3 recipes/defaults_vs_baselines.py --model qwen2_5_3b --micro-batch 8 --timeout $(( (LEFT - 10) / 3 )) --out $OUT/throughput > $OUT/compare3b.log 2>&1; echo "3b side by side rc=$? $((SECONDS-T0)) s"
grep -v "Warning\|warn(" $OUT/compare3b.log | grep "mode\|ratio\|placement" | cut -c1-420 | tail -8
cp -r outputs/bench $OUT/bench_runs 2>/dev/null; rm -f $OUT/bench_runs/*/trace*; cd $OUT && tar czf /tmp/all.tgz . && rm -rf $OUT/* && mv /tmp/all.tgz $OUT/call2.tgz
