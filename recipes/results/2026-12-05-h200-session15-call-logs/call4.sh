#!/bin/bash
# call 4 (prepared 2026-12-05, sixteenth session; not run: no device was lent), transformers 5.17 (the image's), issue 18:
# what the GPT-OSS and Qwen3 steps spend beyond the planner's model. One Qwen3-30B-A3B layer pair at 8 x 2048 (the
# whole-model run's micro-batch), eager against compiled around the experts and compiled whole, with its costliest
# kernels; Qwen3-30B-A3B cut to 4 layers, everything on the GPU side by side with the strategy's default (the resident
# baseline the issue asks for); GPT-OSS-20B cut to 7 layers at 14 x 2048 profiled (1.266 s measured, 0.986 planned).
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | tail -1
export PYTHONPATH=/tmp/site:$PWD:$PWD/recipes PYTHONUNBUFFERED=1 MACHINE=nvidia-h200
python3 -c "import torch, transformers; print(torch.__version__, transformers.__version__)"
T0=$SECONDS
timeout 200 python3 recipes/moe_layer.py --shape qwen3 --micro-batch 8 --seq-len 2048 --layers 2 --reps 3 --experts grouped_mm_gather --compile --profile > $OUT/qwen3_layer.log 2>&1; echo "qwen3 layer rc=$? $((SECONDS-T0)) s"
grep -v "Warning\|warn(" $OUT/qwen3_layer.log | tail -36 | cut -c1-260
T0=$SECONDS
timeout 200 python3 recipes/defaults_vs_baselines.py --model qwen3_30b_a3b --layers 4 --micro-batch 8 --warmup 3 --steps 5 --modes all-on-gpu megatrain-default --timeout 95 --out $OUT/throughput > $OUT/qwen3_resident.log 2>&1; echo "qwen3 4 layers resident vs default rc=$? $((SECONDS-T0)) s"
grep -v "Warning\|warn(" $OUT/qwen3_resident.log | grep '^{\|Error\|error' | cut -c1-900
RUN="trainer=sweep trainer.log_every_n_steps=1 +trainer.callbacks.throughput.window=1 data=synthetic data.seq_len=2048 hardware=auto"
PROF="+trainer.callbacks.profile._target_=profile_breakdown.StepProfiler +trainer.callbacks.profile.first_step=5 +trainer.callbacks.profile.steps=1 +trainer.callbacks.profile.out_dir=/tmp/profile +trainer.callbacks.profile.top=12 +trainer.callbacks.profile.ops=25 +trainer.callbacks.profile.gaps=6"
T0=$SECONDS
LEFT=$((580 - SECONDS))
[ $LEFT -gt 90 ] && timeout $LEFT python3 recipes/bench.py --timeout $((LEFT - 5)) --out $OUT/throughput --run "model=gpt_oss_20b model.config.num_hidden_layers=7 $RUN data.batch_size=14 trainer.max_steps=7 $PROF" > $OUT/gptoss7_profile.log 2>&1; echo "gpt-oss 7 layers profiled rc=$? $((SECONDS-T0)) s"
for d in outputs/bench/*/; do echo "== $d"; grep -h "placement chosen\|Error" $d/output.log | cut -c1-400 | tail -2; grep -h "profile steps\|ms/step\|  gap " $d/output.log | cut -c1-200 | head -50; done
cat $OUT/throughput.md 2>/dev/null | grep "^| 20" | cut -d'|' -f5,7,9-13 | cut -c1-200
cp -r outputs/bench $OUT/bench_runs 2>/dev/null; rm -f $OUT/bench_runs/*/trace*; cd $OUT && tar czf /tmp/all.tgz . && rm -rf $OUT/* && mv /tmp/all.tgz $OUT/call4.tgz
