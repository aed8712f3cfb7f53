#!/bin/bash
# call 2 (2026-12-03, eighth session): the back-off test in bf16-mixed and fp32 (call 1's bf16 run held a bias
# 7x the streaming runs' spread: fp32 says whether the back-off is exact), then the whole 7B at 128 K tokens,
# 4 steps (the 3rd and 4th timed: the steady state, the first overlapped step's buffer switch now free)
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | tail -1
export PYTHONPATH=/tmp/site:$PWD:$PWD/recipes PYTHONUNBUFFERED=1 MACHINE=nvidia-h200
T0=$SECONDS
timeout 130 python3 -m pytest -q -s -p no:cacheprovider tests/test_auto_placement_cuda.py -k backs_off > $OUT/backoff_tests.log 2>&1; echo "back-off tests rc=$? $((SECONDS-T0)) s"
grep -E "passed|failed|^\(b\)|losses:|weights:|AssertionError" $OUT/backoff_tests.log | cut -c1-400 | tail -12
T0=$SECONDS
LEFT=$((590 - SECONDS))
timeout $LEFT python3 recipes/bench.py --timeout $((LEFT - 8)) --out $OUT/long_context --run "experiment=long_context data=synthetic hardware=auto data.seq_len=131072 trainer.max_steps=4 +trainer.callbacks.throughput.window=1" > $OUT/lc128.log 2>&1; echo "128k rc=$? $((SECONDS-T0)) s"
grep -v "Warning\|warn(" $OUT/lc128.log | tail -4 | cut -c1-700
grep -h "placement" outputs/bench/*/output.log | cut -c1-300
cat outputs/bench/*/logs/metrics.csv 2>/dev/null | cut -c1-300
cp -r outputs/bench $OUT/bench_runs 2>/dev/null; cd $OUT && tar czf /tmp/all.tgz . && rm -rf $OUT/* && mv /tmp/all.tgz $OUT/call2.tgz
