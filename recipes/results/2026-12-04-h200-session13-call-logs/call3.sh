#!/bin/bash
# call 3 (2026-12-04, thirteenth session), after "home on demand": the 7B CausalLM default (chunked loss, 16 x 2048);
# GPT-OSS-20B cut to 7 layers at 14 x 2048 profiled (step 5); Qwen3-30B-A3B cut to 10 layers (the most whose fp32
# state fits) at 8 x 2048; the 3B plain HF default on the newest transformers (5.25.0, carried); the 7B plain HF
# default if time is left
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | tail -1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site-tf .whl-tf/*.whl 2>&1 | tail -1
export PYTHONPATH=/tmp/site:$PWD:$PWD/recipes PYTHONUNBUFFERED=1 MACHINE=nvidia-h200
RUN="trainer=sweep trainer.log_every_n_steps=1 +trainer.callbacks.throughput.skip_first=3 +trainer.callbacks.throughput.window=5 data=synthetic data.seq_len=2048 hardware=auto"
NULLS="strategy.engine.slots=null strategy.engine.keep_activations=null strategy.engine.kept_saves=null strategy.engine.cache_weights=null strategy.engine.grad_buffers=null"
PROF="+trainer.callbacks.profile._target_=profile_breakdown.StepProfiler +trainer.callbacks.profile.first_step=6 +trainer.callbacks.profile.steps=1 +trainer.callbacks.profile.out_dir=/tmp/profile +trainer.callbacks.profile.top=14 +trainer.callbacks.profile.gaps=6"
T0=$SECONDS
timeout 200 python3 recipes/bench.py --timeout 195 --out $OUT/throughput --run "experiment=bench_7b hardware=auto trainer.max_steps=8 trainer.log_every_n_steps=1 +trainer.callbacks.throughput.skip_first=3 +trainer.callbacks.throughput.window=5 $NULLS" > $OUT/causallm7b.log 2>&1; echo "7b causallm default rc=$? $((SECONDS-T0)) s"
T0=$SECONDS
timeout 110 python3 recipes/bench.py --timeout 105 --out $OUT/throughput --run "model=gpt_oss_20b model.config.num_hidden_layers=7 $RUN data.batch_size=14 trainer.max_steps=7 $PROF" > $OUT/moe7_profiled.log 2>&1; echo "gpt-oss 7 layers 14x2048 profiled rc=$? $((SECONDS-T0)) s"
T0=$SECONDS
timeout 110 python3 recipes/bench.py --timeout 105 --out $OUT/throughput --run "model=qwen3_30b_a3b model.config.num_hidden_layers=10 $RUN data.batch_size=8 trainer.max_steps=8" > $OUT/qwen3.log 2>&1; echo "qwen3-30b-a3b 10 layers 8x2048 rc=$? $((SECONDS-T0)) s"
T0=$SECONDS
PYTHONPATH=/tmp/site-tf:$PYTHONPATH timeout 80 python3 recipes/defaults_vs_baselines.py --model qwen2_5_3b --micro-batch 8 --warmup 3 --steps 3 --modes megatrain-default --timeout 75 --out $OUT/throughput > $OUT/tf_newest.log 2>&1; echo "3b default on the newest transformers rc=$? $((SECONDS-T0)) s"
grep -v "Warning\|warn(" $OUT/tf_newest.log | grep '^{' | cut -c1-500
T0=$SECONDS
LEFT=$((590 - SECONDS)); [ $LEFT -gt 170 ] && LEFT=170
[ $LEFT -gt 100 ] && timeout $LEFT python3 recipes/defaults_vs_baselines.py --model qwen2_5_7b --micro-batch 16 --warmup 3 --steps 3 --modes megatrain-default --timeout $((LEFT - 5)) --out $OUT/throughput > $OUT/plain7b.log 2>&1; echo "7b plain default rc=$? $((SECONDS-T0)) s"
grep -v "Warning\|warn(" $OUT/plain7b.log 2>/dev/null | grep '^{' | cut -c1-700
for d in outputs/bench/*/; do echo "== $d"; grep -h "placement chosen\|profile steps\|ms/step\|  gap \|Error" $d/output.log | cut -c1-300 | tail -24; done
cat $OUT/throughput.md 2>/dev/null | grep "^| 20" | cut -d'|' -f3,5,7,9-13 | cut -c1-260
cp -r outputs/bench $OUT/bench_runs 2>/dev/null; rm -f $OUT/bench_runs/*/trace*; cd $OUT && tar czf /tmp/all.tgz . && rm -rf $OUT/* && mv /tmp/all.tgz $OUT/call3.tgz
