#!/bin/bash
# call 1 (2026-12-03, ninth session): the embedding updated on the device (resident_on_device) on CUDA (fp32
# parity both ways, no hidden sync), the back-off test in fp32, then the 7B CausalLM with nothing placed
# (the strategy now also chooses resident_on_device), profiled by operator and by compute-stream gap
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | tail -1
export PYTHONPATH=/tmp/site:$PWD:$PWD/recipes PYTHONUNBUFFERED=1 MACHINE=nvidia-h200
T0=$SECONDS
timeout 120 python3 -m pytest -q -s -p no:cacheprovider tests/test_parity_cuda.py -k "three_slots or no_hidden_sync" > $OUT/cuda_tests.log 2>&1; echo "cuda parity/sync tests rc=$? $((SECONDS-T0)) s"
timeout 100 python3 -m pytest -q -s -p no:cacheprovider "tests/test_auto_placement_cuda.py::test_a_tried_placement_that_runs_out_of_memory_backs_off_and_runs_the_step_again[32-true]" >> $OUT/cuda_tests.log 2>&1; echo "fp32 back-off rc=$? $((SECONDS-T0)) s"
grep -E "passed|failed|^\(a\)|^\(e\)|worst|Error|assert|spread" $OUT/cuda_tests.log | cut -c1-300 | tail -14
T0=$SECONDS
NULLS="strategy.engine.slots=null strategy.engine.keep_activations=null strategy.engine.kept_saves=null strategy.engine.cache_weights=null strategy.engine.grad_buffers=null"
PROF="+trainer.callbacks.profile._target_=profile_breakdown.StepProfiler +trainer.callbacks.profile.first_step=6 +trainer.callbacks.profile.steps=1 +trainer.callbacks.profile.out_dir=/tmp/profile7b +trainer.callbacks.profile.top=6 +trainer.callbacks.profile.ops=25 +trainer.callbacks.profile.gaps=12"
LEFT=$((575 - SECONDS))
timeout $LEFT python3 recipes/bench.py --timeout $((LEFT - 8)) --out $OUT/throughput --run "experiment=bench_7b hardware=auto trainer.max_steps=8 trainer.log_every_n_steps=1 +trainer.callbacks.throughput.window=1 $NULLS $PROF" > $OUT/causallm7b.log 2>&1; echo "7b causallm default + op profile rc=$? $((SECONDS-T0)) s"
grep -v "Warning\|warn(" $OUT/causallm7b.log | tail -3 | cut -c1-600
grep -h "placement\|profile steps\|ms/step\|  gap " outputs/bench/*/output.log 2>/dev/null | cut -c1-330 | tail -50
cut -d, -f1-40 outputs/bench/*/logs/metrics.csv 2>/dev/null | head -12 | cut -c1-300
cp -r outputs/bench $OUT/bench_runs 2>/dev/null; rm -f $OUT/bench_runs/*/trace*; cd $OUT && tar czf /tmp/all.tgz . && rm -rf $OUT/* && mv /tmp/all.tgz $OUT/call1.tgz
