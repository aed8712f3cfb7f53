#!/bin/bash
# bash recipes/results/2026-12-05-session22-call-logs/call_h200.sh   (BUDGET=585; carry .whl; nvidia-h200)
# Session 22: session 21's call1.sh PART=1 and PART=2 benches in one call (the idle-expert runs moved to
# call_h100.sh): Qwen3-30B-A3B cut to 10 layers and GPT-OSS-20B cut to 7 with nothing set but hardware=auto (the
# planner picks the micro-batch; train.py logs "data.batch_size=N: the planner's pick ..."), then both at the
# profile's 4 x 2048 (data.batch_size=4): what the pick gains. Steps 4-7 timed (window 4), model TFLOPS on the
# active parameters; the SM clock, power and temperature logged (smi.csv). Before the last bench, this session's new
# GPU tests (call_h100.sh runs them with the rest of test_auto_placement_cuda.py; SKIP_TESTS=1 leaves them out).
set -u
B=${BUDGET:-585}
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | grep -v "already exists" | tail -1
export PYTHONUNBUFFERED=1 MACHINE=$(nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200 && echo nvidia-h200 || echo nvidia-h100); echo $MACHINE
export PYTHONPATH=/tmp/site:$PWD:$PWD/recipes
Q=$([ $MACHINE = nvidia-h200 ] && echo "model.config.num_hidden_layers=10" || echo "model.config.num_hidden_layers=5")
G=$([ $MACHINE = nvidia-h200 ] && echo "model.config.num_hidden_layers=7" || echo "model.config.num_hidden_layers=4")
rm -rf outputs/bench
# SM clock, power and temperature every 250 ms beside the runs: whether the H100's slower steps after step 3
# (session 20, unexplained; no allocator retries) are the GPU clocking down under sustained load
nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu --format=csv,noheader,nounits -lms 250 > $OUT/smi.csv 2>&1 &
SMI=$!
RUN="trainer=sweep trainer.log_every_n_steps=1 +trainer.callbacks.throughput.skip_first=3 +trainer.callbacks.throughput.window=4 data=synthetic data.seq_len=2048 hardware=auto trainer.max_steps=7"
bench() {  # name, overrides...
  local name=$1; shift; local T0=$SECONDS LEFT=$((B - SECONDS))
  [ $LEFT -gt 100 ] && timeout $((LEFT < 170 ? LEFT : 170)) python3 recipes/bench.py --timeout $((LEFT < 170 ? LEFT - 5 : 165)) --out $OUT/throughput --run "$*" > $OUT/$name.log 2>&1
  echo "$name rc=$? $((SECONDS-T0)) s"
}
bench qwen3_picked "model=qwen3_30b_a3b $Q $RUN"
bench gpt_oss_picked "model=gpt_oss_20b $G $RUN"
bench qwen3_profile_batch "model=qwen3_30b_a3b $Q data.batch_size=4 $RUN"
# the GPU tests of this session (what time is left, before the last bench): (d) of test_auto_placement_cuda.py, (g)
# of test_compiled_blocks_cuda.py
T0=$SECONDS; LEFT=$((B - SECONDS - 5))
[ $LEFT -gt 60 ] && [ -z "${SKIP_TESTS:-}" ] && timeout $LEFT python3 -m pytest -q -s -p no:cacheprovider tests/test_auto_placement_cuda.py tests/test_compiled_blocks_cuda.py -k "host_bound or router_loss" > $OUT/cuda_tests.log 2>&1
echo "cuda tests rc=$? $((SECONDS-T0)) s"; grep -E "passed|failed|^\([a-g]\)|Error|assert|warning:|mixture" $OUT/cuda_tests.log | cut -c1-500 | tail -20
bench gpt_oss_profile_batch "model=gpt_oss_20b $G data.batch_size=4 $RUN"
kill $SMI 2>/dev/null; wait $SMI 2>/dev/null
# under load (above 200 W): the lowest SM clocks seen, and the hottest sample; then what the driver says throttled
echo "smi: $(wc -l < $OUT/smi.csv) samples; under load, lowest SM MHz (count): $(awk -F', *' '$4 > 200 {print $2}' $OUT/smi.csv | sort -n | uniq -c | head -3 | tr '\n' ' '); hottest C: $(awk -F', *' '{print $5}' $OUT/smi.csv | sort -n | tail -1)"
nvidia-smi -q -d PERFORMANCE > $OUT/smi_performance.txt 2>&1
for d in outputs/bench/*/; do echo "== $d"; grep -o "model=[a-z0-9_]*" $d/.hydra/overrides.yaml 2>/dev/null | head -1; grep -h "planner's pick\|placement chosen\|Error\|compile failed" $d/output.log | cut -c1-400 | tail -3; python3 -c "import csv,sys; rows=list(csv.DictReader(open(sys.argv[1]))); print(' | '.join(f\"{r['step']} {float(r['TFLOPS']):.1f} {float(r['tokens/s']):.0f} {r.get('gpu_alloc_retries') or 0}\" for r in rows if r.get('TFLOPS')))" $d/logs/metrics.csv 2>&1 | tail -1; done
cat $OUT/throughput.md 2>/dev/null | grep "^| 20" | cut -d'|' -f5,7,9-16 | cut -c1-300
cp -r outputs/bench $OUT/bench_runs 2>/dev/null; rm -f $OUT/bench_runs/*/trace*; cd $OUT && tar czf /tmp/all.tgz . && rm -rf $OUT/* && mv /tmp/all.tgz $OUT/call_h200.tgz
