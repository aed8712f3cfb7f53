#!/bin/bash
# call 3 (2026-12-03, ninth session): the 7B CausalLM with nothing placed (now with the embedding's device
# update weighed in), profiled by compute-stream gap; the 3B CausalLM likewise (where a 3B step waits); the
# plain HF 7B with nothing placed at 16 x 2048 tokens
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | tail -1
export PYTHONPATH=/tmp/site:$PWD:$PWD/recipes PYTHONUNBUFFERED=1 MACHINE=nvidia-h200
NULLS="strategy.engine.slots=null strategy.engine.keep_activations=null strategy.engine.kept_saves=null strategy.engine.cache_weights=null strategy.engine.grad_buffers=null"
PROF="+trainer.callbacks.profile._target_=profile_breakdown.StepProfiler +trainer.callbacks.profile.first_step=6 +trainer.callbacks.profile.steps=1 +trainer.callbacks.profile.out_dir=/tmp/profile +trainer.callbacks.profile.top=3 +trainer.callbacks.profile.gaps=6"
T0=$SECONDS
timeout 175 python3 recipes/bench.py --timeout 170 --out $OUT/throughput --run "experiment=bench_7b hardware=auto trainer.max_steps=8 trainer.log_every_n_steps=1 +trainer.callbacks.throughput.window=1 $NULLS $PROF" > $OUT/causallm7b.log 2>&1; echo "7b causallm default rc=$? $((SECONDS-T0)) s"
T0=$SECONDS
timeout 110 python3 recipes/bench.py --timeout 105 --out $OUT/throughput --run "model=qwen2_5_3b data=synthetic data.batch_size=8 data.seq_len=2048 hardware=auto trainer=sweep trainer.max_steps=8 trainer.log_every_n_steps=1 +trainer.callbacks.throughput.window=1 $PROF" > $OUT/causallm3b.log 2>&1; echo "3b causallm default rc=$? $((SECONDS-T0)) s"
for d in outputs/bench/*/; do echo "== $d"; grep -h "placement\|profile steps\|ms/step\|  gap " $d/output.log | cut -c1-330 | tail -14; cut -d, -f1-9 $d/logs/metrics.csv | grep -v "^,,,," | cut -c1-120; done
T0=$SECONDS
LEFT=$((575 - SECONDS))
timeout $LEFT python3 recipes/defaults_vs_baselines.py --model qwen2_5_7b --micro-batch 16 --accumulate 1 --warmup 3 --steps 3 --modes megatrain-default --timeout $((LEFT - 10)) --out $OUT/throughput > $OUT/plain7b.log 2>&1; echo "7b plain default 16x2048 rc=$? $((SECONDS-T0)) s"
grep -v "Warning\|warn(" $OUT/plain7b.log | tail -3 | cut -c1-900
cp -r outputs/bench $OUT/bench_runs 2>/dev/null; rm -f $OUT/bench_runs/*/trace*; cd $OUT && tar czf /tmp/all.tgz . && rm -rf $OUT/* && mv /tmp/all.tgz $OUT/call3.tgz
