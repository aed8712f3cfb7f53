#!/bin/bash
# call 2 (2026-12-03, twelfth session): issue 18 with experts_implementation="grouped_mm_gather" (models/expert_routing.py:
# transformers' grouped_mm with a backward of gathers and GEMMs, no index_put). Two GPT-OSS-20B layers at 16 x 2048
# for grouped_mm against grouped_mm_gather (ms per layer, errors against fp64 eager, costliest kernels); the whole model
# cut to 4 layers at the planner's 34 x 2048, profiled (now the CausalLM default); Qwen3-30B-A3B cut to 6 layers at
# 28 x 2048; the resident baseline (4 GPT-OSS layers all on the GPU, Lightning's single-device strategy, 8 x 2048)
# First: call 1's auto-placement test (b) 32-true diverged after an out-of-memory back-off with update_on_device=2;
# the same scenario with every device update logged (debug_device_update.py)
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | tail -1
export PYTHONPATH=/tmp/site:$PWD:$PWD/recipes PYTHONUNBUFFERED=1 MACHINE=nvidia-h200
PROF="+trainer.callbacks.profile._target_=profile_breakdown.StepProfiler +trainer.callbacks.profile.first_step=5 +trainer.callbacks.profile.steps=1 +trainer.callbacks.profile.out_dir=/tmp/profile +trainer.callbacks.profile.top=12 +trainer.callbacks.profile.gaps=6"
RUN="trainer=sweep trainer.log_every_n_steps=1 +trainer.callbacks.throughput.window=1 data=synthetic data.seq_len=2048 hardware=auto"
OSS="model=gpt_oss_20b model.config.num_hidden_layers=4"
T0=$SECONDS
timeout 100 python3 recipes/results/2026-12-03-h200-session12-call-logs/debug_device_update.py 32-true > $OUT/debug_device_update.log 2>&1; echo "debug device update rc=$? $((SECONDS-T0)) s"
grep -E "DEVICE UPDATE|SAME TRAINING|placement|Error" $OUT/debug_device_update.log | cut -c1-700 | head -24
T0=$SECONDS
timeout 110 python3 recipes/moe_layer.py --micro-batch 16 --seq-len 2048 --layers 2 --reps 3 --attn fused_sinks --experts grouped_mm,grouped_mm_gather --profile > $OUT/moe_layer.log 2>&1; echo "moe layer rc=$? $((SECONDS-T0)) s"
grep -v "Warning\|warn(" $OUT/moe_layer.log | tail -30 | cut -c1-260
T0=$SECONDS
timeout 130 python3 recipes/bench.py --timeout 125 --out $OUT/throughput --run "$OSS $RUN data.batch_size=34 trainer.max_steps=7 $PROF" > $OUT/moe_profiled.log 2>&1; echo "gpt-oss 4 layers 34x2048 profiled rc=$? $((SECONDS-T0)) s"
T0=$SECONDS
timeout 110 python3 recipes/bench.py --timeout 105 --out $OUT/throughput --run "model=qwen3_30b_a3b model.config.num_hidden_layers=6 $RUN data.batch_size=28 trainer.max_steps=6" > $OUT/qwen3moe.log 2>&1; echo "qwen3-30b-a3b 6 layers 28x2048 rc=$? $((SECONDS-T0)) s"
T0=$SECONDS
LEFT=$((575 - SECONDS)); [ $LEFT -gt 170 ] && LEFT=170
[ $LEFT -gt 60 ] && timeout $LEFT python3 recipes/bench.py --timeout $((LEFT - 5)) --out $OUT/throughput --run "$OSS $RUN data.batch_size=8 trainer.max_steps=6 strategy=single_device" > $OUT/moe_resident.log 2>&1; echo "gpt-oss 4 layers all on the GPU 8x2048 rc=$? $((SECONDS-T0)) s"
for d in outputs/bench/*/; do echo "== $d"; grep -h "placement chosen\|profile steps\|ms/step\|  gap \|mixture\|Error" $d/output.log | cut -c1-260 | tail -22; cut -d, -f2,6,8,9 $d/logs/metrics.csv 2>/dev/null | grep -v "^,,," | tail -4 | tr '\n' ' '; echo; done
cat $OUT/throughput.md 2>/dev/null | grep "^| 20" | cut -d'|' -f5,7,9-13 | cut -c1-200
cp -r outputs/bench $OUT/bench_runs 2>/dev/null; rm -f $OUT/bench_runs/*/trace*; cd $OUT && tar czf /tmp/all.tgz . && rm -rf $OUT/* && mv /tmp/all.tgz $OUT/call2.tgz
