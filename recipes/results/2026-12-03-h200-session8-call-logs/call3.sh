#!/bin/bash
# call 3 (2026-12-03, eighth session): the back-off test in fp32 (call 2 stopped at an assertion on the first
# choice before the comparison), the 7B CausalLM with nothing placed again (the first overlapped step no longer
# frees and pins gradient buffers), and one 7B layer with HF's RMSNorm against torch's fused F.rms_norm
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | tail -1
export PYTHONPATH=/tmp/site:$PWD:$PWD/recipes PYTHONUNBUFFERED=1 MACHINE=nvidia-h200
T0=$SECONDS
timeout 80 python3 -m pytest -q -s -p no:cacheprovider tests/test_auto_placement_cuda.py -k "backs_off and 32" > $OUT/backoff_fp32.log 2>&1; echo "fp32 back-off test rc=$? $((SECONDS-T0)) s"
grep -E "passed|failed|^\(b\)|losses:|weights:|Error" $OUT/backoff_fp32.log | cut -c1-400 | tail -6
T0=$SECONDS
NULLS="strategy.engine.slots=null strategy.engine.keep_activations=null strategy.engine.kept_saves=null strategy.engine.cache_weights=null strategy.engine.grad_buffers=null"
timeout 200 python3 recipes/bench.py --timeout 190 --out $OUT/throughput --run "experiment=bench_7b hardware=auto trainer.max_steps=8 trainer.log_every_n_steps=1 +trainer.callbacks.throughput.window=1 $NULLS" > $OUT/causallm7b.log 2>&1; echo "7b causallm default rc=$? $((SECONDS-T0)) s"
grep -v "Warning\|warn(" $OUT/causallm7b.log | tail -2 | cut -c1-400
cat outputs/bench/*/logs/metrics.csv | cut -c1-200
T0=$SECONDS
timeout 90 python3 recipes/norm_kernels.py > $OUT/norm_kernels.log 2>&1; echo "norm kernels rc=$? $((SECONDS-T0)) s"
grep -v "Warning\|warn(" $OUT/norm_kernels.log | tail -6
cp -r outputs/bench $OUT/bench_runs 2>/dev/null; cd $OUT && tar czf /tmp/all.tgz . && rm -rf $OUT/* && mv /tmp/all.tgz $OUT/call3.tgz
