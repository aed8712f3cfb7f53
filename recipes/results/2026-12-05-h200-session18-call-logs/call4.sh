#!/bin/bash
# session 18, call 4, image's transformers, issue 18: what stands between the MoE steps and 250 TFLOPS. One
# Qwen3-30B-A3B layer pair at 8 x 2048 eager, compiled around the experts and compiled whole, with its costliest
# kernels; GPT-OSS-20B cut to 7 layers at 14 x 2048, compiled around the experts, one step under the step profiler.
set -u
B=${BUDGET:-380}
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | tail -1
export PYTHONUNBUFFERED=1 MACHINE=$(nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200 && echo nvidia-h200 || echo nvidia-h100); echo $MACHINE
export PYTHONPATH=/tmp/site:$PWD:$PWD/recipes
rm -rf outputs/bench
T0=$SECONDS
timeout 170 python3 recipes/moe_layer.py --shape qwen3 --micro-batch 8 --seq-len 2048 --layers 2 --reps 3 --experts grouped_mm_gather --compile --profile > $OUT/qwen3_layer.log 2>&1; echo "qwen3 layer rc=$? $((SECONDS-T0)) s"
grep -v "Warning\|warn(" $OUT/qwen3_layer.log | tail -40 | cut -c1-260
RUN="trainer=sweep trainer.log_every_n_steps=1 +trainer.callbacks.throughput.window=1 data=synthetic data.seq_len=2048 hardware=auto"
PROF="+trainer.callbacks.profile._target_=profile_breakdown.StepProfiler +trainer.callbacks.profile.first_step=5 +trainer.callbacks.profile.steps=1 +trainer.callbacks.profile.out_dir=/tmp/profile +trainer.callbacks.profile.top=12 +trainer.callbacks.profile.ops=25 +trainer.callbacks.profile.gaps=6"
T0=$SECONDS; LEFT=$((B - SECONDS))
[ $LEFT -gt 90 ] && timeout $LEFT python3 recipes/bench.py --timeout $((LEFT - 5)) --out $OUT/throughput --run "model=gpt_oss_20b model.config.num_hidden_layers=7 $RUN data.batch_size=14 trainer.max_steps=7 strategy.engine.compile_blocks=true $PROF" > $OUT/gptoss7_profile.log 2>&1; echo "gpt-oss 7 layers compiled, profiled rc=$? $((SECONDS-T0)) s"
for d in outputs/bench/*/; do echo "== $d"; grep -h "placement chosen\|Error" $d/output.log | cut -c1-400 | tail -2; grep -h "profile steps\|ms/step\|  gap " $d/output.log | cut -c1-200 | head -50; done
cp -r outputs/bench $OUT/bench_runs 2>/dev/null; rm -f $OUT/bench_runs/*/trace*; cd $OUT && tar czf /tmp/all.tgz . && rm -rf $OUT/* && mv /tmp/all.tgz $OUT/call4.tgz
