#!/bin/bash
# call 3: who holds a failed attempt's graphs; the full 7B at 128 K (3 steps) and at 256 K (one step)
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | tail -1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 MACHINE=nvidia-h200
T0=$SECONDS
timeout 70 python3 .gpu/probe_oom.py > $OUT/probe_oom.log 2>&1; echo "probe rc=$? $((SECONDS-T0)) s"
grep -v "Warning\|warn" $OUT/probe_oom.log | grep -E "^==|^   |FAILED|summary" | head -70
T0=$SECONDS
timeout 310 python3 recipes/bench.py --timeout 300 --out $OUT/long_context --run "experiment=long_context data=synthetic hardware=auto trainer.max_steps=1" > $OUT/lc256.log 2>&1; echo "256k rc=$? $((SECONDS-T0)) s"
tail -4 $OUT/lc256.log
T0=$SECONDS
timeout 200 python3 recipes/bench.py --timeout 195 --out $OUT/long_context --run "experiment=long_context data=synthetic hardware=auto data.seq_len=131072 trainer.max_steps=3" > $OUT/lc128.log 2>&1; echo "128k rc=$? $((SECONDS-T0)) s"
tail -4 $OUT/lc128.log; cat $OUT/long_context.md 2>/dev/null | grep "^| 20"
cp -r outputs/bench $OUT/bench_runs 2>/dev/null; cd $OUT && tar czf /tmp/all.tgz . && rm -rf $OUT/* && mv /tmp/all.tgz $OUT/call3.tgz
