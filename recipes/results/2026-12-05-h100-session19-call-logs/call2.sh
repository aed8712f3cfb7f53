#!/bin/bash
# session 19, call 2 (prepared in session 18 as call5.sh), image's transformers, issue 18, after compile_blocks=None compiles blocks around Hugging Face's
# experts: Qwen3-30B-A3B cut to 10 layers at 8 x 2048 with nothing set (now compiled around the experts), one step
# under the step profiler (its breakdown; 0.51 s measured against 0.19 s of its ten layers timed alone).
set -u
B=${BUDGET:-420}
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | tail -1
export PYTHONUNBUFFERED=1 MACHINE=$(nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200 && echo nvidia-h200 || echo nvidia-h100); echo $MACHINE
export PYTHONPATH=/tmp/site:$PWD:$PWD/recipes
rm -rf outputs/bench
RUN="trainer=sweep trainer.log_every_n_steps=1 +trainer.callbacks.throughput.window=1 data=synthetic data.seq_len=2048 hardware=auto"
PROF="+trainer.callbacks.profile._target_=profile_breakdown.StepProfiler +trainer.callbacks.profile.first_step=5 +trainer.callbacks.profile.steps=1 +trainer.callbacks.profile.out_dir=/tmp/profile +trainer.callbacks.profile.top=16 +trainer.callbacks.profile.ops=30 +trainer.callbacks.profile.gaps=8"
T0=$SECONDS; LEFT=$((B - SECONDS))
[ $LEFT -gt 90 ] && timeout $LEFT python3 recipes/bench.py --timeout $((LEFT - 5)) --out $OUT/throughput --run "model=qwen3_30b_a3b model.config.num_hidden_layers=10 $RUN data.batch_size=8 trainer.max_steps=7 $PROF" > $OUT/qwen3_profile.log 2>&1; echo "qwen3 10 layers, nothing set, profiled rc=$? $((SECONDS-T0)) s"
for d in outputs/bench/*/; do echo "== $d"; grep -h "placement chosen\|Error\|compile failed" $d/output.log | cut -c1-400 | tail -2; grep -h "profile steps\|ms/step\|  gap " $d/output.log | cut -c1-200 | head -70; cut -d, -f2,8,9 $d/logs/metrics.csv 2>/dev/null | grep -v "^,,," | tail -2 | tr '\n' ' '; echo; done
cat $OUT/throughput.md 2>/dev/null | grep "^| 20" | cut -d'|' -f5,7,9-13 | cut -c1-200
cp -r outputs/bench $OUT/bench_runs 2>/dev/null; rm -f $OUT/bench_runs/*/trace*; cd $OUT && tar czf /tmp/all.tgz . && rm -rf $OUT/* && mv /tmp/all.tgz $OUT/call2.tgz
# the profiled step's trace, apart (if it is too large to come back, the logs still do)
for t in /tmp/profile/*.json; do [ -f "$t" ] && gzip -c "$t" > $OUT/$(basename "$t").gz; done; ls -la $OUT
