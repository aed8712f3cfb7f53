#!/bin/bash
# bash recipes/results/2026-12-05-session22-call-logs/call_h100.sh   (carry .whl; nvidia-h100-x1: no H200 came)
# Session 22: what does not need the H200's timings. (1) The GPU checks of the automatic placement
# (tests/test_auto_placement_cuda.py, its new (d): a host-bound GPT-OSS under Trainer(strategy="megatrain") warned
# once, after the placement's line) and the router loss's fp32 parity on the GPU (tests/test_compiled_blocks_cuda.py
# (g)); (2) docs/moe.md's idle experts per step under the router loss (bf16, a GPT-OSS-like size) and the same with
# --coef 0 (the router loss's cost), with the SM clock logged (smi.csv).
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | grep -v "already exists" | tail -1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD:$PWD/recipes
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu --format=csv,noheader,nounits -lms 250 > $OUT/smi.csv 2>&1 &
SMI=$!
T0=$SECONDS
timeout 280 python3 -m pytest -q -s -p no:cacheprovider tests/test_auto_placement_cuda.py tests/test_compiled_blocks_cuda.py -k "auto_placement or router_loss" > $OUT/cuda_tests.log 2>&1
echo "cuda tests rc=$? $((SECONDS-T0)) s"
grep -E "passed|failed|^\([a-g]\)|worst|Error|assert|chosen|warning:|mixture" $OUT/cuda_tests.log | cut -c1-500 | tail -30
MOE="--accelerator cuda --precision bf16-mixed --arch gpt_oss --hidden 2880 --layers 4 --experts 32 --top-k 4 --micro-batch 4 --seq-len 2048 --steps 10"
T0=$SECONDS; LEFT=$((580 - SECONDS))
[ $LEFT -gt 60 ] && timeout $((LEFT < 120 ? LEFT : 120)) python3 recipes/moe_router_loss.py $MOE > $OUT/moe_idle.log 2>&1; echo "moe idle experts rc=$? $((SECONDS-T0)) s"; grep "^{" $OUT/moe_idle.log | cut -c1-900
T0=$SECONDS; LEFT=$((580 - SECONDS))
[ $LEFT -gt 60 ] && timeout $((LEFT < 100 ? LEFT : 100)) python3 recipes/moe_router_loss.py $MOE --coef 0 > $OUT/moe_no_router_loss.log 2>&1; echo "moe without router loss rc=$? $((SECONDS-T0)) s"; grep "^{" $OUT/moe_no_router_loss.log | cut -c1-900
kill $SMI 2>/dev/null; wait $SMI 2>/dev/null
echo "smi: $(wc -l < $OUT/smi.csv) samples; under load, lowest SM MHz (count): $(awk -F', *' '$4 > 200 {print $2}' $OUT/smi.csv | sort -n | uniq -c | head -3 | tr '\n' ' '); hottest C: $(awk -F', *' '{print $5}' $OUT/smi.csv | sort -n | tail -1)"
