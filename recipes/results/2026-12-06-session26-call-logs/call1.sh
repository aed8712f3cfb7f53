#!/bin/bash
# session 26, call 1 (copy of session 25 call1.sh, ROUTER=1) (carry .whl; asked as nvidia-h200; BUDGET seconds in all): issue 18 at the planner's pick, with
# the code since session 24 (blocks the device updates cached from block 1; the planner's host-chain wait).
# On an H200: GPT-OSS-20B cut to 7 layers and Qwen3-30B-A3B cut to 10, nothing set but hardware=auto, steps 4-7
# timed, step 8 profiled (GPU compute, copies each way, GPU idle, host AdamW); then the resident baseline side by side:
# GPT-OSS-20B cut to 4 layers all on the GPU (Lightning's SingleDeviceStrategy) and streamed, both at 8 x 2048.
# Last, the GPU parity tests of the device-updated blocks (EngineConfig.device_updated, one rule for engine and planner).
# ROUTER=1 (added after call 1, for the next H200): then GPT-OSS-20B at 7 layers with its router loss on.
# On an H100 (no resident baseline fits its 80 GB): the two shapes at the H100 picks, then tests/test_compiled_blocks_cuda.py
# (session 26: the code of accca21, CompiledBlocks._fullgraph, not yet run on a GPU).
set -u
B=${BUDGET:-570}
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | grep -v "already exists" | tail -1
export PYTHONUNBUFFERED=1 MACHINE=$(nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200 && echo nvidia-h200 || echo nvidia-h100); echo $MACHINE
export PYTHONPATH=/tmp/site:$PWD:$PWD/recipes
rm -rf outputs/bench
nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu --format=csv,noheader,nounits -lms 250 > $OUT/smi.csv 2>&1 &
SMI=$!
free -g | head -2; nproc
RUN="trainer=sweep trainer.log_every_n_steps=1 +trainer.callbacks.throughput.skip_first=3 +trainer.callbacks.throughput.window=4 data=synthetic data.seq_len=2048 hardware=auto trainer.max_steps=9"
PROF="+trainer.callbacks.profile._target_=profile_breakdown.StepProfiler +trainer.callbacks.profile.first_step=8 +trainer.callbacks.profile.steps=1 +trainer.callbacks.profile.out_dir=/tmp/profile +trainer.callbacks.profile.top=12 +trainer.callbacks.profile.ops=12 +trainer.callbacks.profile.gaps=4 +trainer.callbacks.profile.host_busy=megatrain"
bench() {  # name, seconds at most, overrides...
  local name=$1 cap=$2; shift 2; local T0=$SECONDS LEFT=$((B - SECONDS))
  [ $LEFT -gt 90 ] && timeout $((LEFT < cap ? LEFT : cap)) python3 recipes/bench.py --timeout $((LEFT < cap ? LEFT - 5 : cap - 5)) --out $OUT/throughput --run "$*" > $OUT/$name.log 2>&1
  echo "$name rc=$? $((SECONDS-T0)) s"
}
bench gpt_oss_7_picked 220 "model=gpt_oss_20b model.config.num_hidden_layers=7 $RUN $PROF"
bench qwen3_10_picked 210 "model=qwen3_30b_a3b model.config.num_hidden_layers=10 $RUN $PROF"
if [ $MACHINE = nvidia-h200 ]; then
  bench gpt_oss_4_resident_8 140 "model=gpt_oss_20b model.config.num_hidden_layers=4 $RUN data.batch_size=8 strategy=single_device"
  bench gpt_oss_4_megatrain_8 120 "model=gpt_oss_20b model.config.num_hidden_layers=4 $RUN data.batch_size=8"
  [ -n "${ROUTER:-}" ] && bench gpt_oss_7_router_loss 150 "model=gpt_oss_20b model.config.num_hidden_layers=7 $RUN model.config.output_router_logits=true"
else
  LEFT=$((B - SECONDS - 60)); [ $LEFT -gt 60 ] && timeout $LEFT python3 -m pytest -q -x -s tests/test_compiled_blocks_cuda.py > $OUT/compiled_blocks.log 2>&1; echo "compiled_blocks rc=$?"; grep -h "worst\|compiled\|passed\|failed\|Error" $OUT/compiled_blocks.log | tail -25
fi
LEFT=$((B - SECONDS - 8)); [ $LEFT -gt 45 ] && timeout $LEFT python3 -m pytest -q -x -s tests/test_parity_cuda.py -k "three_slots or home_on_demand" > $OUT/parity.log 2>&1; echo "parity rc=$?"; grep -h "worst\|passed\|failed\|Error" $OUT/parity.log | tail -12
kill $SMI 2>/dev/null; wait $SMI 2>/dev/null
echo "smi: $(wc -l < $OUT/smi.csv) samples; under load, lowest SM MHz (count): $(awk -F', *' '$4 > 200 {print $2}' $OUT/smi.csv | sort -n | uniq -c | head -3 | tr '\n' ' '); hottest C: $(awk -F', *' '{print $5}' $OUT/smi.csv | sort -n | tail -1)"
for d in outputs/bench/*/; do echo "== $d"; grep -o "model=[a-z0-9_]*\|strategy=[a-z_]*\|num_hidden_layers=[0-9]*" $d/.hydra/overrides.yaml 2>/dev/null | tr '\n' ' '; echo; grep -h "planner's pick\|placement chosen\|Error\|compile failed\|warn" $d/output.log | cut -c1-330 | tail -4; grep -h "profile steps\|_s \|_frac\|busy\|idle" $d/output.log | cut -c1-170 | head -24; python3 -c "import csv,sys; rows=list(csv.DictReader(open(sys.argv[1]))); print(' | '.join(f\"{r['step']} {float(r['TFLOPS']):.1f} {float(r['tokens/s']):.0f} {r.get('gpu_alloc_retries') or 0}\" for r in rows if r.get('TFLOPS')))" $d/logs/metrics.csv 2>&1 | tail -1; done
cat $OUT/throughput.md 2>/dev/null | grep "^| 20" | cut -d'|' -f5,7,9-16 | cut -c1-300
cp -r outputs/bench $OUT/bench_runs 2>/dev/null; rm -f $OUT/bench_runs/*/trace*; cd $OUT && tar czf /tmp/all.tgz . && rm -rf $OUT/* && mv /tmp/all.tgz $OUT/call1.tgz
