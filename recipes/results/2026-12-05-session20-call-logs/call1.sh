#!/bin/bash
# session 20, call 1, image's transformers. (1) The GPU tests of session 19's GPU-path changes not yet run on a GPU:
# a streamed first block's masters kept on the device (update_on_device; parity, automatic placement), grouped GEMM
# experts compiled inside their blocks ((e) fp32, (f) bf16), the first call's re-call. (2) Issue 18's Qwen3 shape with
# nothing set (H200: 10 layers; H100: 5 layers), 8 x 2048, steps 4-7 timed as session 18 did (window 4), step 8 under the step profiler. (3) The
# LM head + loss at Qwen3's (3b's) and GPT-OSS's head shapes: the cross-entropy compiled with its gradient (new)
# against autograd's path, recipes/fused_kernels.py --loss-only. BUDGET s.
set -u
B=${BUDGET:-570}
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | grep -v "already exists" | tail -1
export PYTHONUNBUFFERED=1 MACHINE=$(nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200 && echo nvidia-h200 || echo nvidia-h100); echo $MACHINE
export PYTHONPATH=/tmp/site:$PWD:$PWD/recipes
Q=$([ $MACHINE = nvidia-h200 ] && echo "model.config.num_hidden_layers=10" || echo "model.config.num_hidden_layers=5")
rm -rf outputs/bench
T0=$SECONDS
timeout 230 python3 -m pytest -q -s -p no:cacheprovider "tests/test_compiled_blocks_cuda.py::test_cuda_moe_compiled_inside_its_blocks_fp32_parity" "tests/test_compiled_blocks_cuda.py::test_cuda_moe_compiled_inside_bf16_trains_like_eager" \
  tests/test_head_loss_cuda.py tests/test_auto_placement_cuda.py tests/test_parity_cuda.py -k "compiled_cross or inside or auto or three_slots or home_on_demand or keep_cache or no_hidden_sync or depth or differentiat" > $OUT/gpu_tests.log 2>&1; echo "GPU tests rc=$? $((SECONDS-T0)) s"
grep -E "passed|failed|^FAILED|worst|Error" $OUT/gpu_tests.log | cut -c1-300 | tail -16
RUN="trainer=sweep trainer.log_every_n_steps=1 +trainer.callbacks.throughput.skip_first=3 +trainer.callbacks.throughput.window=4 data=synthetic data.seq_len=2048 hardware=auto trainer.max_steps=9"
PROF="+trainer.callbacks.profile._target_=profile_breakdown.StepProfiler +trainer.callbacks.profile.first_step=8 +trainer.callbacks.profile.steps=1 +trainer.callbacks.profile.out_dir=/tmp/profile +trainer.callbacks.profile.top=20 +trainer.callbacks.profile.ops=30 +trainer.callbacks.profile.gaps=8"
T0=$SECONDS; LEFT=$((B - SECONDS))
[ $LEFT -gt 90 ] && timeout $((LEFT < 240 ? LEFT : 240)) python3 recipes/bench.py --timeout 235 --out $OUT/throughput --run "model=qwen3_30b_a3b $Q data.batch_size=8 $RUN $PROF" > $OUT/qwen3_now.log 2>&1; echo "qwen3_now rc=$? $((SECONDS-T0)) s"
T0=$SECONDS; LEFT=$((B - SECONDS))
[ $LEFT -gt 40 ] && timeout $((LEFT < 120 ? LEFT : 120)) python3 recipes/fused_kernels.py --loss-only --shapes 3b gpt-oss --repeats 5 > $OUT/loss.log 2>&1; echo "loss rc=$? $((SECONDS-T0)) s"; cat $OUT/loss.log | grep "^|\|rror" | cut -c1-250
for d in outputs/bench/*/; do echo "== $d"; grep -h "placement chosen\|Error\|compile failed\|planner" $d/output.log | cut -c1-400 | tail -3; grep -h "profile steps\|  gap " $d/output.log | cut -c1-200 | head -12; echo "per step (step TFLOPS tokens/s allocator-retries; peak GPU GiB):"; python3 -c "import csv,sys; rows=list(csv.DictReader(open(sys.argv[1]))); print(' | '.join(f\"{r['step']} {float(r['TFLOPS']):.1f} {float(r['tokens/s']):.0f} {r.get('gpu_alloc_retries') or 0}\" for r in rows if r.get('TFLOPS')), '; peak', max((r['peak_gpu_mem_GiB'] for r in rows if r.get('peak_gpu_mem_GiB')), key=float, default=None))" $d/logs/metrics.csv 2>&1 | tail -1; done
cat $OUT/throughput.md 2>/dev/null | grep "^| 20" | cut -d'|' -f5,7,9-13 | cut -c1-200
cp -r outputs/bench $OUT/bench_runs 2>/dev/null; rm -f $OUT/bench_runs/*/trace*; cd $OUT && tar czf /tmp/all.tgz . && rm -rf $OUT/* && mv /tmp/all.tgz $OUT/call1.tgz
