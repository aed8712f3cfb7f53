#!/bin/bash
# session 24, call 2 (BUDGET=560; carry .whl and .ab, .ab/old being `git archive` of f2cad8e, the code before the
# change): EngineConfig.fixed_blocks side by side with the layout it replaces, on Qwen3-30B-A3B cut to 10 layers at
# the placement the strategy chose on an H100 at the planner's pick in this session's first call (22 x 2048,
# keep_activations=0, cache_weights=4, update_on_device=8: the GPU idle 40 % of the step), new then old; then
# GPT-OSS-20B cut to 7 layers at its pick (21 x 2048) with block 1 cached and updated on the device (cache 2,
# update 3: the host updates blocks 2-5) against the placement the strategy chose (cache 1, update 2: blocks 1-5),
# both on the new code. Steps 4-7 timed, step 8 profiled. Call 3 was `ONLY=qwen3 QCAP=190 TGZ=call3 BUDGET=380`: the
# Qwen3 pair alone, each allowed 190 s (in call 2 both ran past their 130 s on a machine ~10 % slower than call 1's).
set -u
B=${BUDGET:-480}
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | grep -v "already exists" | tail -1
export PYTHONUNBUFFERED=1 MACHINE=$(nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200 && echo nvidia-h200 || echo nvidia-h100); echo $MACHINE
ROOT=$PWD
rm -rf outputs/bench .ab/old/outputs/bench
nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu --format=csv,noheader,nounits -lms 250 > $OUT/smi.csv 2>&1 &
SMI=$!
RUN="trainer=sweep trainer.log_every_n_steps=1 +trainer.callbacks.throughput.skip_first=3 +trainer.callbacks.throughput.window=4 data=synthetic data.seq_len=2048 hardware=auto trainer.max_steps=9"
PROF="+trainer.callbacks.profile._target_=profile_breakdown.StepProfiler +trainer.callbacks.profile.first_step=8 +trainer.callbacks.profile.steps=1 +trainer.callbacks.profile.out_dir=/tmp/profile +trainer.callbacks.profile.top=8 +trainer.callbacks.profile.ops=4 +trainer.callbacks.profile.gaps=6 +trainer.callbacks.profile.host_busy=megatrain"
bench() {  # name, tree, seconds at most, overrides...
  local name=$1 tree=$2 cap=$3; shift 3; local T0=$SECONDS LEFT=$((B - SECONDS))
  [ $LEFT -gt 100 ] && (cd $tree && PYTHONPATH=/tmp/site:$PWD:$PWD/recipes timeout $((LEFT < cap ? LEFT : cap)) python3 recipes/bench.py --timeout $((LEFT < cap ? LEFT - 5 : cap - 5)) --out $OUT/throughput_$name --run "$*") > $OUT/$name.log 2>&1
  echo "$name rc=$? $((SECONDS-T0)) s"
}
Q="model=qwen3_30b_a3b model.config.num_hidden_layers=10 data.batch_size=22 strategy.engine.keep_activations=0 strategy.engine.kept_saves=all strategy.engine.cache_weights=4 strategy.engine.update_on_device=8"
G="model=gpt_oss_20b model.config.num_hidden_layers=7 data.batch_size=21 strategy.engine.keep_activations=1 strategy.engine.kept_saves=matmuls"
bench qwen3_new $ROOT ${QCAP:-130} "$Q $RUN $PROF"
bench qwen3_old $ROOT/.ab/old ${QCAP:-130} "$Q $RUN $PROF"
[ "${ONLY:-}" = qwen3 ] || bench gpt_oss_c2 $ROOT 150 "$G strategy.engine.cache_weights=2 strategy.engine.update_on_device=3 $RUN $PROF"
[ "${ONLY:-}" = qwen3 ] || bench gpt_oss_c1 $ROOT 150 "$G strategy.engine.cache_weights=1 strategy.engine.update_on_device=2 $RUN $PROF"
kill $SMI 2>/dev/null; wait $SMI 2>/dev/null
echo "smi: $(wc -l < $OUT/smi.csv) samples; under load, lowest SM MHz (count): $(awk -F', *' '$4 > 200 {print $2}' $OUT/smi.csv | sort -n | uniq -c | head -3 | tr '\n' ' '); hottest C: $(awk -F', *' '{print $5}' $OUT/smi.csv | sort -n | tail -1)"
for d in outputs/bench/*/ .ab/old/outputs/bench/*/; do echo "== $d"; grep -h "planner's pick\|placement chosen\|Error" $d/output.log | cut -c1-330 | tail -3; grep -h "profile steps" $d/output.log | cut -c1-300; grep -h "  gap" $d/output.log | cut -c1-150 | head -6; python3 -c "import csv,sys; rows=list(csv.DictReader(open(sys.argv[1]))); print(' | '.join(f\"{r['step']} {float(r['TFLOPS']):.1f} {float(r['tokens/s']):.0f}\" for r in rows if r.get('TFLOPS')))" $d/logs/metrics.csv 2>&1 | tail -1; done
cat $OUT/throughput_*.md 2>/dev/null | grep "^| 20" | cut -d'|' -f5,7,9-16 | cut -c1-300
mkdir -p $OUT/runs && cp -r outputs/bench $OUT/runs/new && cp -r .ab/old/outputs/bench $OUT/runs/old; rm -f $OUT/runs/*/*/trace*
cd $OUT && tar czf /tmp/all.tgz . && rm -rf $OUT/* && mv /tmp/all.tgz $OUT/${TGZ:-call2}.tgz
