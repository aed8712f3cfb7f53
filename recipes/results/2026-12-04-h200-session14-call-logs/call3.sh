#!/bin/bash
# call 3 (2026-12-04, fourteenth session): the GPU tests of compiled blocks (fp32 parity, bf16 against eager) and of a
# module with Liger Kernel (refused / kept whole); the automatic placement, the selective-saving memory test and the
# no-hidden-sync test with blocks compiled by default; the 7B plain HF default; GPT-OSS-20B (7 layers) by default.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl .whl-liger/*.whl 2>&1 | tail -1
export PYTHONPATH=/tmp/site:$PWD:$PWD/recipes PYTHONUNBUFFERED=1 MACHINE=nvidia-h200
RUN="trainer=sweep trainer.log_every_n_steps=1 +trainer.callbacks.throughput.skip_first=3 +trainer.callbacks.throughput.window=5 data=synthetic data.seq_len=2048 hardware=auto"
T0=$SECONDS
timeout 230 python3 -m pytest -q -s -p no:cacheprovider tests/test_compiled_blocks_cuda.py tests/test_auto_placement_cuda.py tests/test_parity_cuda.py -k "compiled or liger or measures or backs_off or saving_matmuls or no_hidden_sync" > $OUT/cuda_tests.log 2>&1; echo "cuda tests rc=$? $((SECONDS-T0)) s"
grep -E "passed|failed|^\([a-h]\)|worst|Error|assert|chosen:" $OUT/cuda_tests.log | cut -c1-300 | tail -24
T0=$SECONDS
timeout 175 python3 recipes/defaults_vs_baselines.py --model qwen2_5_7b --micro-batch 16 --warmup 3 --steps 3 --modes megatrain-default --timeout 170 --out $OUT/throughput > $OUT/plain7b.log 2>&1; echo "7b plain rc=$? $((SECONDS-T0)) s"
grep -v "Warning\|warn(" $OUT/plain7b.log | grep '^{\|Error\|error' | cut -c1-1000
T0=$SECONDS
LEFT=$((585 - SECONDS))
[ $LEFT -gt 80 ] && timeout $LEFT python3 recipes/bench.py --timeout $((LEFT - 5)) --out $OUT/throughput --run "model=gpt_oss_20b model.config.num_hidden_layers=7 $RUN data.batch_size=14 trainer.max_steps=8" > $OUT/moe7.log 2>&1; echo "gpt-oss 7 layers 14x2048 rc=$? $((SECONDS-T0)) s"
for d in outputs/bench/*/; do echo "== $d"; grep -h "placement chosen\|placement tried\|Error\|compile failed" $d/output.log | cut -c1-400 | tail -4; cut -d, -f2,8,9 $d/logs/metrics.csv 2>/dev/null | grep -v "^,,," | tail -3 | tr '\n' ' '; echo; done
cat $OUT/throughput.md 2>/dev/null | grep "^| 20" | cut -d'|' -f5,7,9-13 | cut -c1-200
cp -r outputs/bench $OUT/bench_runs 2>/dev/null; rm -f $OUT/bench_runs/*/trace*; cd $OUT && tar czf /tmp/all.tgz . && rm -rf $OUT/* && mv /tmp/all.tgz $OUT/call3.tgz
