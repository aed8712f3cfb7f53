#!/bin/bash
# call 2: where test (b)'s device memory goes; one 7B layer at long context, flash vs cuDNN; 256 K through 8 layers
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | tail -1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 MACHINE=nvidia-h200
T0=$SECONDS
timeout 100 python3 .gpu/debug_oom.py > $OUT/debug_oom.log 2>&1; echo "debug oom rc=$? $((SECONDS-T0)) s"
grep -E "^==|^   |FAILED|summary|RunResult" $OUT/debug_oom.log | head -90
T0=$SECONDS
timeout 130 python3 recipes/long_context_layer.py --tokens 32768 131072 262144 --backends flash cudnn --out $OUT/layer.md > $OUT/layer.log 2>&1; echo "layer rc=$? $((SECONDS-T0)) s"
tail -20 $OUT/layer.log
T0=$SECONDS
timeout 330 python3 recipes/bench.py --timeout 320 --out $OUT/long_context --run "experiment=long_context data=synthetic hardware=auto model.config.num_hidden_layers=8 trainer.max_steps=3" > $OUT/proxy.log 2>&1; echo "256k proxy rc=$? $((SECONDS-T0)) s"
tail -8 $OUT/proxy.log; cat $OUT/long_context.md 2>/dev/null | tail -3
cp -r outputs/bench $OUT/bench_runs 2>/dev/null; cd $OUT && tar czf /tmp/all.tgz . && rm -rf $OUT/* && mv /tmp/all.tgz $OUT/call2.tgz
