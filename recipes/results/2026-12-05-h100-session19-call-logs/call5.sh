#!/bin/bash
# session 19, call 5 (prepared, unrun: the session's device time was spent), image's transformers, for the next
# session. (1) The GPU tests of this session's GPU-path changes: a streamed first block's masters kept on the device
# (update_on_device; parity, automatic placement), grouped GEMM experts compiled inside their blocks ((e) fp32, (f) bf16).
# (2) Side by side, nothing set: Qwen3-30B-A3B as it is now against the masters' round trip of before
# (masters_home/sitecustomize.py); on an H200 also GPT-OSS-20B with its experts compiled whole (the interim policy,
# around/ inverted: whole/sitecustomize.py) against around (the default). H200: the shapes (Qwen3 10 layers
# 8 x 2048, GPT-OSS 7 layers 14 x 2048); H100: Qwen3 5 layers. BUDGET s.
set -u
B=${BUDGET:-570}
D=recipes/results/2026-12-05-h100-session19-call-logs
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | grep -v "already exists" | tail -1
export PYTHONUNBUFFERED=1 MACHINE=$(nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200 && echo nvidia-h200 || echo nvidia-h100); echo $MACHINE
export PYTHONPATH=/tmp/site:$PWD:$PWD/recipes
Q=$([ $MACHINE = nvidia-h200 ] && echo "model.config.num_hidden_layers=10" || echo "model.config.num_hidden_layers=5")
rm -rf outputs/bench
T0=$SECONDS
timeout 200 python3 -m pytest -q -s -p no:cacheprovider "tests/test_compiled_blocks_cuda.py::test_cuda_moe_compiled_inside_its_blocks_fp32_parity" "tests/test_compiled_blocks_cuda.py::test_cuda_moe_compiled_inside_bf16_trains_like_eager" \
  tests/test_auto_placement_cuda.py tests/test_parity_cuda.py -k "inside or auto or three_slots or home_on_demand or keep_cache or no_hidden_sync or depth" > $OUT/gpu_tests.log 2>&1; echo "GPU tests rc=$? $((SECONDS-T0)) s"
grep -E "passed|failed|^FAILED|worst|Error" $OUT/gpu_tests.log | cut -c1-300 | tail -16
RUN="trainer=sweep trainer.log_every_n_steps=1 +trainer.callbacks.throughput.window=1 data=synthetic data.seq_len=2048 hardware=auto trainer.max_steps=7"
bench() {  # name, overrides...
  local name=$1; shift; local T0=$SECONDS LEFT=$((B - SECONDS))
  [ $LEFT -gt 90 ] && timeout $((LEFT < 190 ? LEFT : 190)) python3 recipes/bench.py --timeout 185 --out $OUT/throughput --run "$*" > $OUT/$name.log 2>&1
  echo "$name rc=$? $((SECONDS-T0)) s"
}
bench qwen3_now "model=qwen3_30b_a3b $Q data.batch_size=8 $RUN"
PYTHONPATH=$PWD/$D/masters_home:$PYTHONPATH bench qwen3_masters_home "model=qwen3_30b_a3b $Q data.batch_size=8 $RUN"
if [ $MACHINE = nvidia-h200 ]; then
  G="model=gpt_oss_20b model.config.num_hidden_layers=7 data.batch_size=14 $RUN"
  bench gpt_oss_around "$G"
  PYTHONPATH=$PWD/$D/whole:$PYTHONPATH bench gpt_oss_whole "$G strategy.engine.compile_blocks=true"
fi
for d in outputs/bench/*/; do echo "== $d"; grep -o "model=[a-z0-9_]*" $d/.hydra/overrides.yaml 2>/dev/null | head -1; grep -h "placement chosen\|Error\|error\|compile failed" $d/output.log | cut -c1-400 | tail -3; echo "per step (TFLOPS, step, tokens/s):"; cut -d, -f2,8,9 $d/logs/metrics.csv 2>/dev/null | grep -v "^,,," | grep -v "^," | tr '\n' ' '; echo; done
cp -r outputs/bench $OUT/bench_runs 2>/dev/null; rm -f $OUT/bench_runs/*/trace*; cd $OUT && tar czf /tmp/all.tgz . && rm -rf $OUT/* && mv /tmp/all.tgz $OUT/call5.tgz
