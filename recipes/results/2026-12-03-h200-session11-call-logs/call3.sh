#!/bin/bash
# call 3 (2026-12-03, eleventh session; ~570 s of device time left): the 3B plain HF default again (the choice now
# leaves the host AdamW a 10 % margin: update_on_device=8, not 4) side by side with everything on the GPU; then
# issue 18 on the whole model: GPT-OSS-20B shape cut to 4 layers at the planner's 34 x 2048 tokens, profiled
# (compute-stream busy/idle, top kernels, longest gaps); the same 4 layers all on the GPU (Lightning's
# single-device strategy) and streamed at 8 x 2048; the Qwen3-30B-A3B shape cut to 6 layers at 28 x 2048
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | tail -1
export PYTHONPATH=/tmp/site:$PWD:$PWD/recipes PYTHONUNBUFFERED=1 MACHINE=nvidia-h200
PROF="+trainer.callbacks.profile._target_=profile_breakdown.StepProfiler +trainer.callbacks.profile.first_step=5 +trainer.callbacks.profile.steps=1 +trainer.callbacks.profile.out_dir=/tmp/profile +trainer.callbacks.profile.top=12 +trainer.callbacks.profile.gaps=6"
RUN="trainer=sweep trainer.log_every_n_steps=1 +trainer.callbacks.throughput.window=1 data=synthetic data.seq_len=2048 hardware=auto"
OSS="model=gpt_oss_20b model.config.num_hidden_layers=4"
T0=$SECONDS
timeout 110 python3 recipes/defaults_vs_baselines.py --model qwen2_5_3b --micro-batch 8 --warmup 3 --steps 3 --modes megatrain-default all-on-gpu --timeout 55 --out $OUT/throughput > $OUT/compare3b.log 2>&1; echo "3b side by side rc=$? $((SECONDS-T0)) s"
grep -v "Warning\|warn(" $OUT/compare3b.log | grep '^{' | cut -c1-700
T0=$SECONDS
timeout 130 python3 recipes/bench.py --timeout 125 --out $OUT/throughput --run "$OSS $RUN data.batch_size=34 trainer.max_steps=7 $PROF" > $OUT/moe_profiled.log 2>&1; echo "gpt-oss 4 layers 34x2048 profiled rc=$? $((SECONDS-T0)) s"
T0=$SECONDS
timeout 75 python3 recipes/bench.py --timeout 70 --out $OUT/throughput --run "$OSS $RUN data.batch_size=8 trainer.max_steps=6 strategy=single_device" > $OUT/moe_resident.log 2>&1; echo "gpt-oss 4 layers all on the GPU 8x2048 rc=$? $((SECONDS-T0)) s"
T0=$SECONDS
timeout 65 python3 recipes/bench.py --timeout 60 --out $OUT/throughput --run "$OSS $RUN data.batch_size=8 trainer.max_steps=6" > $OUT/moe_8.log 2>&1; echo "gpt-oss 4 layers streamed 8x2048 rc=$? $((SECONDS-T0)) s"
T0=$SECONDS
LEFT=$((445 - SECONDS)); [ $LEFT -gt 100 ] && LEFT=100
[ $LEFT -gt 40 ] && timeout $LEFT python3 recipes/bench.py --timeout $((LEFT - 5)) --out $OUT/throughput --run "model=qwen3_30b_a3b model.config.num_hidden_layers=6 $RUN data.batch_size=28 trainer.max_steps=6" > $OUT/qwen3moe.log 2>&1; echo "qwen3-30b-a3b 6 layers 28x2048 rc=$? $((SECONDS-T0)) s"
for d in outputs/bench/*/; do echo "== $d"; grep -h "placement chosen\|profile steps\|ms/step\|  gap \|mixture\|Error" $d/output.log | cut -c1-260 | tail -22; cut -d, -f2,6,8,9 $d/logs/metrics.csv 2>/dev/null | grep -v "^,,," | tail -4 | tr '\n' ' '; echo; done
cat $OUT/throughput.md 2>/dev/null | grep "^| 20" | cut -d'|' -f5,7,9-13 | cut -c1-200
cp -r outputs/bench $OUT/bench_runs 2>/dev/null; rm -f $OUT/bench_runs/*/trace*; cd $OUT && tar czf /tmp/all.tgz . && rm -rf $OUT/* && mv /tmp/all.tgz $OUT/call3.tgz
