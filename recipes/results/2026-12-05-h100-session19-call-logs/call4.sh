#!/bin/bash
# session 19, call 4, image's transformers, after (1) the first forward's check keeps no saved tensors
# (engine/first_call.py) and (2) blocks with Hugging Face's grouped_mm experts compile whole (engine/compiled.py).
# The GPU tests touched (depth memory; compiled blocks, GPT-OSS whole in fp32 among them; automatic placement), then
# GPT-OSS-20B with nothing set (compiled whole now: does _grouped_mm's device-side assert of session 14 return?),
# Qwen3-30B-A3B with nothing set, and GPT-OSS compiled around its experts (around/sitecustomize.py) beside it.
# H200: the shapes (GPT-OSS 7 layers 14 x 2048, Qwen3 10 layers 8 x 2048); H100: 4 and 5 layers, 8 x 2048.
set -u
B=${BUDGET:-570}
D=recipes/results/2026-12-05-h100-session19-call-logs
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | grep -v "already exists" | tail -1
export PYTHONUNBUFFERED=1 MACHINE=$(nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200 && echo nvidia-h200 || echo nvidia-h100); echo $MACHINE
export PYTHONPATH=/tmp/site:$PWD:$PWD/recipes
if [ $MACHINE = nvidia-h200 ]; then G="model.config.num_hidden_layers=7 data.batch_size=14"; Q="model.config.num_hidden_layers=10 data.batch_size=8"
else G="model.config.num_hidden_layers=4 data.batch_size=8"; Q="model.config.num_hidden_layers=5 data.batch_size=8"; fi
rm -rf outputs/bench
T0=$SECONDS
timeout 240 python3 -m pytest -q -s -p no:cacheprovider tests/test_compiled_blocks_cuda.py tests/test_auto_placement_cuda.py \
  "tests/test_parity_cuda.py::test_cuda_peak_memory_independent_of_depth" > $OUT/gpu_tests.log 2>&1; echo "GPU tests rc=$? $((SECONDS-T0)) s"
grep -E "passed|failed|^FAILED|worst|Error|blocks \(|48-block" $OUT/gpu_tests.log | cut -c1-300 | tail -24
RUN="trainer=sweep trainer.log_every_n_steps=1 +trainer.callbacks.throughput.window=1 data=synthetic data.seq_len=2048 hardware=auto trainer.max_steps=7"
bench() {  # name, overrides...
  local name=$1; shift; local T0=$SECONDS LEFT=$((B - SECONDS))
  [ $LEFT -gt 90 ] && timeout $((LEFT < 190 ? LEFT : 190)) python3 recipes/bench.py --timeout 185 --out $OUT/throughput --run "$*" > $OUT/$name.log 2>&1
  echo "$name rc=$? $((SECONDS-T0)) s"
}
bench gpt_oss_whole "model=gpt_oss_20b $G $RUN"
bench qwen3_whole "model=qwen3_30b_a3b $Q $RUN"
PYTHONPATH=$PWD/$D/around:$PYTHONPATH bench gpt_oss_around "model=gpt_oss_20b $G $RUN"
for d in outputs/bench/*/; do echo "== $d"; head -c 300 $d/output.log | grep -o "model=[a-z0-9_]*" | head -1; grep -h "placement chosen\|Error\|error\|compile failed\|assert" $d/output.log | cut -c1-400 | tail -3; echo "per step (TFLOPS, step, tokens/s):"; cut -d, -f2,8,9 $d/logs/metrics.csv 2>/dev/null | grep -v "^,,," | grep -v "^," | tr '\n' ' '; echo; done
cat $OUT/throughput.md 2>/dev/null | grep "^| 20" | cut -d'|' -f5,7,9-13 | cut -c1-200
cp -r outputs/bench $OUT/bench_runs 2>/dev/null; rm -f $OUT/bench_runs/*/trace*; cd $OUT && tar czf /tmp/all.tgz . && rm -rf $OUT/* && mv /tmp/all.tgz $OUT/call4.tgz
