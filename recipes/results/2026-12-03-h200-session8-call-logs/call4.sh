#!/bin/bash
# call 4 (2026-12-03, eighth session): the back-off test in fp32 (its first-choice assertion fixed), then a
# GPT-OSS-20B shape cut to 4 layers (fp32 state: 74.2 GB planned on this host; 6 did not fit the device time left) at the tokens per step the
# planner names to hide the host work (34 x 2048), nothing placed by hand: model TFLOPS on active parameters
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | tail -1
export PYTHONPATH=/tmp/site:$PWD:$PWD/recipes PYTHONUNBUFFERED=1 MACHINE=nvidia-h200
T0=$SECONDS
timeout 80 python3 -m pytest -q -s -p no:cacheprovider tests/test_auto_placement_cuda.py -k "backs_off and 32" > $OUT/backoff_fp32.log 2>&1; echo "fp32 back-off test rc=$? $((SECONDS-T0)) s"
grep -E "passed|failed|losses:|weights:|Error" $OUT/backoff_fp32.log | cut -c1-400 | tail -6
T0=$SECONDS
LEFT=$((255 - SECONDS))
timeout $LEFT python3 recipes/bench.py --timeout $((LEFT - 8)) --out $OUT/moe --run "model=gpt_oss_20b model.config.num_hidden_layers=4 data=synthetic hardware=auto trainer=sweep data.batch_size=34 data.seq_len=2048 trainer.max_steps=5 trainer.log_every_n_steps=1 +trainer.callbacks.throughput.window=1" > $OUT/moe.log 2>&1; echo "gpt-oss 6L rc=$? $((SECONDS-T0)) s"
grep -v "Warning\|warn(" $OUT/moe.log | tail -2 | cut -c1-500
grep -h "placement\|verdict\|mixture" outputs/bench/*/output.log | cut -c1-300
cat outputs/bench/*/logs/metrics.csv 2>/dev/null | cut -c1-200
cp -r outputs/bench $OUT/bench_runs 2>/dev/null; cd $OUT && tar czf /tmp/all.tgz . && rm -rf $OUT/* && mv /tmp/all.tgz $OUT/call4.tgz
