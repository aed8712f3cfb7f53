#!/bin/bash
# call A (2026-12-02, sixth session): the GPU tests (the back-off's freed graphs, the new 8 K parity of the
# chunked MLP and bf16 saved inputs), then the full 7B at 128 K tokens (two steps, the second timed)
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | tail -1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 MACHINE=nvidia-h200
T0=$SECONDS
timeout 250 python3 -m pytest -q -s -p no:cacheprovider tests/test_auto_placement_cuda.py tests/test_long_context_cuda.py tests/test_parity_cuda.py > $OUT/cuda_tests.log 2>&1; echo "cuda tests rc=$? $((SECONDS-T0)) s"
grep -E "passed|failed|PASS|FAIL|Error|chose|placement|peak|diff|^\(" $OUT/cuda_tests.log | cut -c1-400 | tail -40
T0=$SECONDS
LEFT=$((575 - SECONDS))
timeout $LEFT python3 recipes/bench.py --timeout $((LEFT - 10)) --out $OUT/long_context --run "experiment=long_context data=synthetic hardware=auto data.seq_len=131072 trainer.max_steps=2 +trainer.callbacks.throughput.skip_first=1" > $OUT/lc128.log 2>&1; echo "128k rc=$? $((SECONDS-T0)) s"
grep -v "Warning\|warn(" $OUT/lc128.log | tail -6 | cut -c1-600; cat $OUT/long_context.md 2>/dev/null | grep "^| 20"
cp -r outputs/bench $OUT/bench_runs 2>/dev/null; cd $OUT && tar czf /tmp/all.tgz . && rm -rf $OUT/* && mv /tmp/all.tgz $OUT/callA.tgz
