#!/bin/bash
# call 1: host AdamW kernels, GPU tests, the 7B CausalLM with nothing set
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | tail -1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 MACHINE=nvidia-h200
nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv,noheader; nproc; free -g | head -2; lscpu | grep -i "model name"
T0=$SECONDS
timeout 80 python3 recipes/benchmark_host_adam.py --params 256e6 --repeats 3 > $OUT/host_adam.log 2>&1; echo "host adam rc=$? $((SECONDS-T0)) s"; cat $OUT/host_adam.log
# streaming stores stay on only where they beat ordinary ones on this host
S=$(grep "fp32 (native kernel, streaming" $OUT/host_adam.log | awk '{print $(NF-5)}'); F=$(grep "fp32 (torch fused" $OUT/host_adam.log | awk '{print $(NF-5)}')
echo "streaming $S torch $F"
if python3 -c "import sys; sys.exit(0 if float('${S:-0}') > float('${F:-1}') else 1)"; then echo "streaming on"; else export MEGATRAIN_ADAM_STREAMING=0; echo "streaming off"; fi
T0=$SECONDS
timeout 215 python3 -m pytest -q -s -p no:cacheprovider tests/test_auto_placement_cuda.py tests/test_parity_cuda.py tests/test_long_context_cuda.py > $OUT/cuda_tests.log 2>&1; echo "cuda tests rc=$? $((SECONDS-T0)) s"
grep -E "passed|failed|PASS|FAIL|Error|chose|placement|peak|diff" $OUT/cuda_tests.log | tail -40
T0=$SECONDS
timeout 265 python3 recipes/bench.py --timeout 255 --out $OUT/throughput --run "experiment=bench_7b hardware=auto trainer.max_steps=8 strategy.engine.slots=null strategy.engine.keep_activations=null strategy.engine.kept_saves=null strategy.engine.cache_weights=null strategy.engine.grad_buffers=null" > $OUT/bench7b.log 2>&1; echo "bench 7b rc=$? $((SECONDS-T0)) s"
tail -25 $OUT/bench7b.log; cat $OUT/throughput.md 2>/dev/null | tail -3
cp -r outputs/bench $OUT/bench_runs 2>/dev/null; cd $OUT && tar czf /tmp/all.tgz . && rm -rf $OUT/* && mv /tmp/all.tgz $OUT/call1.tgz
