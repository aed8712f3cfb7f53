#!/bin/bash
# call 2 (2026-12-03, eleventh session): the strategy now chooses update_on_device=N itself (the planner's
# block rate by hidden size and its in-step host AdamW rate set from call 1 and the 2026-11-30 profile): the 3B
# plain HF module with nothing placed side by side with everything on the GPU and DeepSpeed ZeRO-3 offload
# (pin_memory=True), issue 15's ratios; then the 7B CausalLM default, profiled by compute-stream gap
set -u
rm -rf ~/.cache/torch_extensions
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | tail -1
python3 -m pip install -q --no-index --no-deps --no-build-isolation --target /tmp/site .whl/deepspeed-*.tar.gz 2>&1 | tail -1
export PYTHONPATH=/tmp/site:$PWD:$PWD/recipes PYTHONUNBUFFERED=1 MACHINE=nvidia-h200
NULLS="strategy.engine.slots=null strategy.engine.keep_activations=null strategy.engine.kept_saves=null strategy.engine.cache_weights=null strategy.engine.grad_buffers=null"
PROF="+trainer.callbacks.profile._target_=profile_breakdown.StepProfiler +trainer.callbacks.profile.first_step=6 +trainer.callbacks.profile.steps=1 +trainer.callbacks.profile.out_dir=/tmp/profile +trainer.callbacks.profile.top=3 +trainer.callbacks.profile.gaps=6"
T0=$SECONDS
timeout 300 python3 recipes/defaults_vs_baselines.py --model qwen2_5_3b --micro-batch 8 --warmup 3 --steps 3 --modes megatrain-default all-on-gpu deepspeed --timeout 140 --out $OUT/throughput > $OUT/compare3b.log 2>&1; echo "3b side by side rc=$? $((SECONDS-T0)) s"
grep -v "Warning\|warn(" $OUT/compare3b.log | grep '^{' | cut -c1-900
T0=$SECONDS
LEFT=$((585 - SECONDS)); [ $LEFT -gt 190 ] && LEFT=190
timeout $LEFT python3 recipes/bench.py --timeout $((LEFT - 5)) --out $OUT/throughput --run "experiment=bench_7b hardware=auto trainer.max_steps=8 trainer.log_every_n_steps=1 +trainer.callbacks.throughput.window=1 $NULLS $PROF" > $OUT/causallm7b.log 2>&1; echo "7b causallm default + gaps rc=$? $((SECONDS-T0)) s"
for d in outputs/bench/*/; do echo "== $d"; grep -h "placement\|profile steps\|ms/step\|  gap " $d/output.log | cut -c1-330 | tail -14; cut -d, -f1-9 $d/logs/metrics.csv | grep -v "^,,,," | cut -c1-120; done
cat $OUT/throughput.md 2>/dev/null | grep "^| 20" | cut -c1-500
cp -r outputs/bench $OUT/bench_runs 2>/dev/null; rm -f $OUT/bench_runs/*/trace*; cd $OUT && tar czf /tmp/all.tgz . && rm -rf $OUT/* && mv /tmp/all.tgz $OUT/call2.tgz
