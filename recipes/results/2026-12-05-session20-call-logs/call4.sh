#!/bin/bash
# session 20, call 4, image's transformers: issue 18's Qwen3 shape with nothing set after the chunked loss's
# compiled cross-entropy (H200: 10 layers; H100: 5 layers), 8 x 2048, steps 4-7 timed as session 18 did (window 4),
# step 8 under the step profiler. BUDGET s.
set -u
B=${BUDGET:-400}
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | grep -v "already exists" | tail -1
export PYTHONUNBUFFERED=1 MACHINE=$(nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200 && echo nvidia-h200 || echo nvidia-h100); echo $MACHINE
export PYTHONPATH=/tmp/site:$PWD:$PWD/recipes
Q=$([ $MACHINE = nvidia-h200 ] && echo "model.config.num_hidden_layers=10" || echo "model.config.num_hidden_layers=5")
rm -rf outputs/bench
RUN="trainer=sweep trainer.log_every_n_steps=1 +trainer.callbacks.throughput.skip_first=3 +trainer.callbacks.throughput.window=4 data=synthetic data.seq_len=2048 hardware=auto trainer.max_steps=9"
PROF="+trainer.callbacks.profile._target_=profile_breakdown.StepProfiler +trainer.callbacks.profile.first_step=8 +trainer.callbacks.profile.steps=1 +trainer.callbacks.profile.out_dir=/tmp/profile +trainer.callbacks.profile.top=20 +trainer.callbacks.profile.ops=24 +trainer.callbacks.profile.gaps=8"
T0=$SECONDS; LEFT=$((B - SECONDS))
timeout $((LEFT < 300 ? LEFT : 300)) python3 recipes/bench.py --timeout 295 --out $OUT/throughput --run "model=qwen3_30b_a3b $Q data.batch_size=8 $RUN $PROF" > $OUT/qwen3_now.log 2>&1; echo "qwen3_now rc=$? $((SECONDS-T0)) s"
for d in outputs/bench/*/; do echo "== $d"; grep -h "placement chosen\|Error\|compile failed\|warn" $d/output.log | cut -c1-400 | tail -4; grep -h "profile steps\|  gap \|ms/step" $d/output.log | cut -c1-170 | head -50; echo "per window (step TFLOPS tokens/s allocator-retries; peak GPU GiB):"; python3 -c "import csv,sys; rows=list(csv.DictReader(open(sys.argv[1]))); print(' | '.join(f\"{r['step']} {float(r['TFLOPS']):.1f} {float(r['tokens/s']):.0f} {r.get('gpu_alloc_retries') or 0}\" for r in rows if r.get('TFLOPS')), '; peak', max((r['peak_gpu_mem_GiB'] for r in rows if r.get('peak_gpu_mem_GiB')), key=float, default=None))" $d/logs/metrics.csv 2>&1 | tail -1; done
cat $OUT/throughput.md 2>/dev/null | grep "^| 20" | cut -d'|' -f5,7,9-16 | cut -c1-300
cp -r outputs/bench $OUT/bench_runs 2>/dev/null; rm -f $OUT/bench_runs/*/trace*; cd $OUT && tar czf /tmp/all.tgz . && rm -rf $OUT/* && mv /tmp/all.tgz $OUT/call4.tgz
