#!/bin/bash
# session 19, call 3, image's transformers. (1) depth_memory.py: why the depth test's peak reserved grew (which of
# compiled blocks and the first forward's check). (2) Qwen3-30B-A3B with nothing set, after the experts' rows are
# repeated in bf16 (models/expert_routing.py), 8 x 2048, steps timed one by one, step 6 profiled; then the same with
# the experts compiled whole (whole/sitecustomize.py, compile_blocks=true), not profiled. 10 layers on an H200 (the
# issue's shape), 5 on an H100 (the same regime: every block kept, cached and updated on the device). BUDGET s.
set -u
B=${BUDGET:-570}
D=recipes/results/2026-12-05-h100-session19-call-logs
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | grep -v "already exists" | tail -1
export PYTHONUNBUFFERED=1 MACHINE=$(nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200 && echo nvidia-h200 || echo nvidia-h100); echo $MACHINE
export PYTHONPATH=/tmp/site:$PWD:$PWD/recipes
L=$([ $MACHINE = nvidia-h200 ] && echo 10 || echo 5)
rm -rf outputs/bench
T0=$SECONDS
timeout 150 python3 $D/depth_memory.py > $OUT/depth_memory.log 2>&1; echo "depth memory rc=$? $((SECONDS-T0)) s"
grep -E "step [123]:|Error" $OUT/depth_memory.log | cut -c1-250
RUN="trainer=sweep trainer.log_every_n_steps=1 +trainer.callbacks.throughput.window=1 data=synthetic data.seq_len=2048 hardware=auto model=qwen3_30b_a3b model.config.num_hidden_layers=$L data.batch_size=8 trainer.max_steps=7"
PROF="+trainer.callbacks.profile._target_=profile_breakdown.StepProfiler +trainer.callbacks.profile.first_step=6 +trainer.callbacks.profile.steps=1 +trainer.callbacks.profile.out_dir=/tmp/profile +trainer.callbacks.profile.top=16 +trainer.callbacks.profile.ops=30 +trainer.callbacks.profile.gaps=8"
T0=$SECONDS; LEFT=$((B - SECONDS))
[ $LEFT -gt 100 ] && timeout $((LEFT < 200 ? LEFT : 200)) python3 recipes/bench.py --timeout 195 --out $OUT/throughput --run "$RUN $PROF" > $OUT/qwen3_default.log 2>&1; echo "qwen3 $L layers, nothing set (step 6 profiled) rc=$? $((SECONDS-T0)) s"
T0=$SECONDS; LEFT=$((B - SECONDS))
[ $LEFT -gt 100 ] && PYTHONPATH=$PWD/$D/whole:$PYTHONPATH timeout $((LEFT < 200 ? LEFT : 200)) python3 recipes/bench.py --timeout 195 --out $OUT/throughput --run "$RUN strategy.engine.compile_blocks=true" > $OUT/qwen3_whole.log 2>&1; echo "qwen3 $L layers, experts compiled whole rc=$? $((SECONDS-T0)) s"
for d in outputs/bench/*/; do echo "== $d"; grep -h "placement chosen\|Error\|compile failed\|warn" $d/output.log | cut -c1-400 | tail -3; grep -h "profile steps\|ms/step\|  gap " $d/output.log | cut -c1-200 | head -60; echo "per step (step, TFLOPS, tokens/s):"; cut -d, -f2,8,9 $d/logs/metrics.csv 2>/dev/null | grep -v "^,,," | grep -v "^," | tr '\n' ' '; echo; done
cat $OUT/throughput.md 2>/dev/null | grep "^| 20" | cut -d'|' -f5,7,9-13 | cut -c1-200
cp -r outputs/bench $OUT/bench_runs 2>/dev/null; rm -f $OUT/bench_runs/*/trace*; cd $OUT && tar czf /tmp/all.tgz . && rm -rf $OUT/* && mv /tmp/all.tgz $OUT/call3.tgz
for t in /tmp/profile/*.json; do [ -f "$t" ] && gzip -c "$t" > $OUT/$(basename "$t").gz; done; ls -la $OUT
