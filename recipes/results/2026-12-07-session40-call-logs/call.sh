#!/bin/bash
# session 40 (carry .whl; BUDGET seconds in all). Issue 18's GPT-OSS-20B cut to 7 layers at the planner's pick
# (session 28's PART=h200 run, as session 29's call.sh runs it: nothing set but hardware=auto, steps 4-7 timed, step 8
# profiled), the shipped gpt_oss config fixed for transformers 5.17 in session 39; its first calls run session 40's
# probe of the weights whose dtype matters under bf16-mixed (engine/wide_weights.py) on a real MoE block. Then, BUDGET
# left, the cuda-marked tests of tests/test_parity_cuda.py and tests/test_auto_placement_cuda.py.
set -u
B=${BUDGET:-430}
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | grep -v "already exists" | tail -1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD:$PWD/recipes
nvidia-smi --query-gpu=name --format=csv,noheader; free -g | head -2 | tail -1
rm -rf outputs/bench
RUN="trainer=sweep trainer.log_every_n_steps=1 +trainer.callbacks.throughput.skip_first=3 +trainer.callbacks.throughput.window=4 data=synthetic data.seq_len=2048 hardware=auto trainer.max_steps=9"
PROF="+trainer.callbacks.profile._target_=profile_breakdown.StepProfiler +trainer.callbacks.profile.first_step=8 +trainer.callbacks.profile.steps=1 +trainer.callbacks.profile.out_dir=/tmp/profile +trainer.callbacks.profile.top=8 +trainer.callbacks.profile.ops=8 +trainer.callbacks.profile.gaps=2 +trainer.callbacks.profile.host_busy=megatrain"
CAP=${CAP:-210}; T0=$SECONDS
timeout $CAP python3 recipes/bench.py --timeout $((CAP - 5)) --out $OUT/throughput --run "model=gpt_oss_20b model.config.num_hidden_layers=7 $RUN $PROF" > $OUT/gpt_oss_7_picked.bench.log 2>&1
echo "gpt_oss_7_picked rc=$? $((SECONDS-T0)) s"
for d in outputs/bench/*/; do cp $d/output.log $OUT/gpt_oss_7_picked.output.log 2>/dev/null; cp $d/logs/metrics.csv $OUT/gpt_oss_7_picked.metrics.csv 2>/dev/null
  grep -h "planner's pick\|placement chosen\|Error\|TFLOPS:\|\[profile\|outside autocast" $d/output.log | cut -c1-300 | tail -6; done
tail -3 $OUT/gpt_oss_7_picked.bench.log | cut -c1-300
LEFT=$((B - SECONDS - 5)); [ $LEFT -gt 40 ] && { timeout $LEFT python3 -m pytest -q -m cuda -rfE -p no:cacheprovider -s tests/test_parity_cuda.py tests/test_auto_placement_cuda.py > $OUT/cuda_tests.log 2>&1; echo "cuda tests rc=$?"; grep -h "^(\|passed\|failed\|^FAILED\|^E " $OUT/cuda_tests.log | cut -c1-300 | tail -12; }
