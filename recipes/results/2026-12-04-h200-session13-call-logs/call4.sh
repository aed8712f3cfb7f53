#!/bin/bash
# call 4 (2026-12-04, thirteenth session): Qwen3-30B-A3B cut to 10 layers (the most whose fp32 state fits the host) at
# 8 x 2048, the strategy's defaults, timed over steps 4-7 (call 3's run was cut by its timeout at step 6)
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | tail -1
export PYTHONPATH=/tmp/site:$PWD:$PWD/recipes PYTHONUNBUFFERED=1 MACHINE=nvidia-h200
T0=$SECONDS
timeout 165 python3 recipes/bench.py --timeout 160 --out $OUT/throughput --run "model=qwen3_30b_a3b model.config.num_hidden_layers=10 trainer=sweep trainer.log_every_n_steps=1 +trainer.callbacks.throughput.skip_first=3 +trainer.callbacks.throughput.window=4 data=synthetic data.seq_len=2048 hardware=auto data.batch_size=8 trainer.max_steps=7" > $OUT/qwen3.log 2>&1; echo "qwen3-30b-a3b 10 layers 8x2048 rc=$? $((SECONDS-T0)) s"
for d in outputs/bench/*/; do echo "== $d"; grep -h "placement chosen\|Error" $d/output.log | cut -c1-300 | tail -4; cut -d, -f2,8,9 $d/logs/metrics.csv 2>/dev/null | grep -v "^,,," | tail -3 | tr '\n' ' '; echo; done
cat $OUT/throughput.md 2>/dev/null | grep "^| 20" | cut -d'|' -f5,7,9-13 | cut -c1-200
cp -r outputs/bench $OUT/bench_runs 2>/dev/null; cd $OUT && tar czf /tmp/all.tgz . && rm -rf $OUT/* && mv /tmp/all.tgz $OUT/call4.tgz
