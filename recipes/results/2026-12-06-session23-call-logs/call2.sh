#!/bin/bash
# session 23, call 2 (BUDGET=560; carry .whl; asked as nvidia-h200; ONLY=gpt_oss runs GPT-OSS alone): issue 18's shapes at the size its targets name,
# whatever card comes: Qwen3-30B-A3B cut to 10 layers and GPT-OSS-20B cut to 7 (as many as fp32 state fits in the
# host's 126-128 GiB), GPT-OSS first (the closer to the target), nothing set but hardware=auto (the planner picks the
# micro-batch), steps 4-7 timed (window 4), step 8 under the step profiler (GPU compute, copies each way, GPU idle, the
# host optimizer: the breakdown, and how busy the link is, which bounds what skipping idle experts' gradient copies
# could gain). SM clock, power, temperature beside them.
set -u
B=${BUDGET:-560}
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | grep -v "already exists" | tail -1
export PYTHONUNBUFFERED=1 MACHINE=$(nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200 && echo nvidia-h200 || echo nvidia-h100); echo $MACHINE
export PYTHONPATH=/tmp/site:$PWD:$PWD/recipes
rm -rf outputs/bench
nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu --format=csv,noheader,nounits -lms 250 > $OUT/smi.csv 2>&1 &
SMI=$!
free -g | head -2
RUN="trainer=sweep trainer.log_every_n_steps=1 +trainer.callbacks.throughput.skip_first=3 +trainer.callbacks.throughput.window=4 data=synthetic data.seq_len=2048 hardware=auto trainer.max_steps=9"
PROF="+trainer.callbacks.profile._target_=profile_breakdown.StepProfiler +trainer.callbacks.profile.first_step=8 +trainer.callbacks.profile.steps=1 +trainer.callbacks.profile.out_dir=/tmp/profile +trainer.callbacks.profile.top=12 +trainer.callbacks.profile.ops=12 +trainer.callbacks.profile.gaps=4 +trainer.callbacks.profile.host_busy=megatrain"
bench() {  # name, seconds at most, overrides...
  local name=$1 cap=$2; shift 2; local T0=$SECONDS LEFT=$((B - SECONDS))
  [ $LEFT -gt 100 ] && timeout $((LEFT < cap ? LEFT : cap)) python3 recipes/bench.py --timeout $((LEFT < cap ? LEFT - 5 : cap - 5)) --out $OUT/throughput --run "$*" > $OUT/$name.log 2>&1
  echo "$name rc=$? $((SECONDS-T0)) s"
}
bench gpt_oss_7_picked 290 "model=gpt_oss_20b model.config.num_hidden_layers=7 $RUN $PROF"
[ "${ONLY:-}" = gpt_oss ] || bench qwen3_10_picked 260 "model=qwen3_30b_a3b model.config.num_hidden_layers=10 $RUN $PROF"
kill $SMI 2>/dev/null; wait $SMI 2>/dev/null
echo "smi: $(wc -l < $OUT/smi.csv) samples; under load, lowest SM MHz (count): $(awk -F', *' '$4 > 200 {print $2}' $OUT/smi.csv | sort -n | uniq -c | head -3 | tr '\n' ' '); hottest C: $(awk -F', *' '{print $5}' $OUT/smi.csv | sort -n | tail -1)"
for d in outputs/bench/*/; do echo "== $d"; grep -o "model=[a-z0-9_]*" $d/.hydra/overrides.yaml 2>/dev/null | head -1; grep -h "planner's pick\|placement chosen\|Error\|compile failed\|warn" $d/output.log | cut -c1-330 | tail -4; grep -h "profile steps\|_s \|_frac\|busy\|idle" $d/output.log | cut -c1-170 | head -24; python3 -c "import csv,sys; rows=list(csv.DictReader(open(sys.argv[1]))); print(' | '.join(f\"{r['step']} {float(r['TFLOPS']):.1f} {float(r['tokens/s']):.0f} {r.get('gpu_alloc_retries') or 0}\" for r in rows if r.get('TFLOPS')))" $d/logs/metrics.csv 2>&1 | tail -1; done
cat $OUT/throughput.md 2>/dev/null | grep "^| 20" | cut -d'|' -f5,7,9-16 | cut -c1-300
cp -r outputs/bench $OUT/bench_runs 2>/dev/null; rm -f $OUT/bench_runs/*/trace*; cd $OUT && tar czf /tmp/all.tgz . && rm -rf $OUT/* && mv /tmp/all.tgz $OUT/call2.tgz
