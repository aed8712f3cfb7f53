#!/bin/bash
# session 20, call 2 (on whatever card comes; written for the H100 while no H200 came), image's transformers.
# (1) The GPU tests of session 19-20's GPU-path changes not yet run on a GPU: a streamed first block's masters kept
# on the device (parity three slots with update_on_device, home on demand, automatic placement), grouped GEMM
# experts compiled inside their blocks ((e) fp32, (f) bf16), the chunked loss's compiled cross-entropy. (2) The LM
# head + loss at Qwen3's (3b's) and GPT-OSS's head shapes, the compiled cross-entropy against autograd's path
# (recipes/fused_kernels.py --loss-only). (3) Side by side, nothing set, Qwen3-30B-A3B 5 layers (H100; 10 on an H200)
# 8 x 2048: as it is now against the streamed first block's masters' round trip of before
# (session 19's masters_home/sitecustomize.py), per-step figures (window 1). BUDGET s.
set -u
B=${BUDGET:-570}
S19=recipes/results/2026-12-05-h100-session19-call-logs
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | grep -v "already exists" | tail -1
export PYTHONUNBUFFERED=1 MACHINE=$(nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200 && echo nvidia-h200 || echo nvidia-h100); echo $MACHINE
export PYTHONPATH=/tmp/site:$PWD:$PWD/recipes
Q=$([ $MACHINE = nvidia-h200 ] && echo "model.config.num_hidden_layers=10" || echo "model.config.num_hidden_layers=5")
rm -rf outputs/bench
T0=$SECONDS
timeout 230 python3 -m pytest -q -s -p no:cacheprovider tests/test_head_loss_cuda.py "tests/test_compiled_blocks_cuda.py::test_cuda_moe_compiled_inside_its_blocks_fp32_parity" "tests/test_compiled_blocks_cuda.py::test_cuda_moe_compiled_inside_bf16_trains_like_eager" \
  tests/test_parity_cuda.py tests/test_auto_placement_cuda.py -k "compiled_cross or inside or three_slots or home_on_demand or auto" > $OUT/gpu_tests.log 2>&1; echo "GPU tests rc=$? $((SECONDS-T0)) s"
grep -E "passed|failed|^FAILED|PASSED|worst|against autograd|Error" $OUT/gpu_tests.log | cut -c1-300 | tail -20
T0=$SECONDS
timeout 100 python3 recipes/fused_kernels.py --loss-only --shapes 3b gpt-oss --repeats 5 > $OUT/loss.log 2>&1; echo "loss rc=$? $((SECONDS-T0)) s"; grep "^|\|rror" $OUT/loss.log | cut -c1-250
RUN="trainer=sweep trainer.log_every_n_steps=1 +trainer.callbacks.throughput.window=1 data=synthetic data.seq_len=2048 hardware=auto trainer.max_steps=7"
bench() {  # name, overrides...
  local name=$1; shift; local T0=$SECONDS LEFT=$((B - SECONDS))
  [ $LEFT -gt 90 ] && timeout $((LEFT < 140 ? LEFT : 140)) python3 recipes/bench.py --timeout 135 --out $OUT/throughput --run "$*" > $OUT/$name.log 2>&1
  echo "$name rc=$? $((SECONDS-T0)) s"
}
bench qwen3_now "model=qwen3_30b_a3b $Q data.batch_size=8 $RUN"
PYTHONPATH=$PWD/$S19/masters_home:$PYTHONPATH bench qwen3_masters_home "model=qwen3_30b_a3b $Q data.batch_size=8 $RUN"
for d in outputs/bench/*/; do echo "== $d"; grep -h "placement chosen\|Error\|compile failed" $d/output.log | cut -c1-400 | tail -3; echo "per step (step TFLOPS tokens/s allocator-retries; peak GPU GiB):"; python3 -c "import csv,sys; rows=list(csv.DictReader(open(sys.argv[1]))); print(' | '.join(f\"{r['step']} {float(r['TFLOPS']):.1f} {float(r['tokens/s']):.0f} {r.get('gpu_alloc_retries') or 0}\" for r in rows if r.get('TFLOPS')), '; peak', max((r['peak_gpu_mem_GiB'] for r in rows if r.get('peak_gpu_mem_GiB')), key=float, default=None))" $d/logs/metrics.csv 2>&1 | tail -1; done
cp -r outputs/bench $OUT/bench_runs 2>/dev/null; rm -f $OUT/bench_runs/*/trace*; cd $OUT && tar czf /tmp/all.tgz . && rm -rf $OUT/* && mv /tmp/all.tgz $OUT/call2.tgz
