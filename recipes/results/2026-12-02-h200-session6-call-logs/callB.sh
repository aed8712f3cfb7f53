#!/bin/bash
# call B (2026-12-02, sixth session): the full 7B at 256 K tokens, two steps (the second timed); then the
# back-off test again with the budget bounded by what the device held when it ran out
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | tail -1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 MACHINE=nvidia-h200
T0=$SECONDS
timeout 470 python3 recipes/bench.py --timeout 460 --out $OUT/long_context --run "experiment=long_context data=synthetic hardware=auto trainer.max_steps=2 +trainer.callbacks.throughput.skip_first=1" > $OUT/lc256.log 2>&1; echo "256k rc=$? $((SECONDS-T0)) s"
grep -v "Warning\|warn(" $OUT/lc256.log | tail -4 | cut -c1-900; cat $OUT/long_context.md 2>/dev/null | grep "^| 20"
T0=$SECONDS
LEFT=$((585 - SECONDS))
[ $LEFT -gt 60 ] && timeout $LEFT python3 -m pytest -q -s -p no:cacheprovider tests/test_auto_placement_cuda.py -k "backs_off" > $OUT/backoff.log 2>&1; echo "back-off test rc=$? $((SECONDS-T0)) s"
grep -E "passed|failed|Error|placement|^\(b\)|allocate" $OUT/backoff.log | cut -c1-400 | tail -14
cp -r outputs/bench $OUT/bench_runs 2>/dev/null; cd $OUT && tar czf /tmp/all.tgz . && rm -rf $OUT/* && mv /tmp/all.tgz $OUT/callB.tgz
