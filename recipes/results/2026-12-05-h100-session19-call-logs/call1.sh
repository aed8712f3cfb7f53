#!/bin/bash
# session 19, call 1 (prepared in session 18 as call6.sh), image's transformers: the GPU tests after this session's
# changes to the first forward's check (containers handed to a block, replaced buffers) and the MoE compile default,
# then GPT-OSS-20B cut to 7 layers at 14 x 2048 with nothing set (now compiled around its experts; 256.9 TFLOPS with
# compile_blocks=true in call 1). Each only where the time left allows (BUDGET s).
set -u
B=${BUDGET:-570}
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | tail -1
export PYTHONUNBUFFERED=1 MACHINE=$(nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200 && echo nvidia-h200 || echo nvidia-h100); echo $MACHINE
export PYTHONPATH=/tmp/site:$PWD:$PWD/recipes
rm -rf outputs/bench
T0=$SECONDS
timeout 300 python3 -m pytest -q -s -p no:cacheprovider tests/test_compiled_blocks_cuda.py tests/test_auto_placement_cuda.py \
  tests/test_parity_cuda.py -k "not long" > $OUT/gpu_tests.log 2>&1; echo "GPU tests rc=$? $((SECONDS-T0)) s"
grep -E "passed|failed|^FAILED|worst|Error" $OUT/gpu_tests.log | cut -c1-300 | tail -20
RUN="trainer=sweep trainer.log_every_n_steps=1 +trainer.callbacks.throughput.skip_first=3 +trainer.callbacks.throughput.window=4 data=synthetic data.seq_len=2048 hardware=auto"
T0=$SECONDS; LEFT=$((B - SECONDS))
[ $LEFT -gt 120 ] && timeout $((LEFT < 160 ? LEFT : 160)) python3 recipes/bench.py --timeout 155 --out $OUT/throughput --run "model=gpt_oss_20b model.config.num_hidden_layers=7 $RUN data.batch_size=14 trainer.max_steps=7" > $OUT/moe7_default.log 2>&1; echo "gpt-oss 7 layers, nothing set rc=$? $((SECONDS-T0)) s"
for d in outputs/bench/*/; do echo "== $d"; grep -h "placement chosen\|Error\|compile failed" $d/output.log | cut -c1-400 | tail -2; cut -d, -f2,8,9 $d/logs/metrics.csv 2>/dev/null | grep -v "^,,," | tail -2 | tr '\n' ' '; echo; done
cat $OUT/throughput.md 2>/dev/null | grep "^| 20" | cut -d'|' -f5,7,9-13 | cut -c1-200
cp -r outputs/bench $OUT/bench_runs 2>/dev/null; rm -f $OUT/bench_runs/*/trace*; cd $OUT && tar czf /tmp/all.tgz . && rm -rf $OUT/* && mv /tmp/all.tgz $OUT/call1.tgz
