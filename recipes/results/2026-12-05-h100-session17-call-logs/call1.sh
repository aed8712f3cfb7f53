#!/bin/bash
# session 17, call 1, nvidia-h100-x1 (no H200 could be started: two requests refused), transformers 5.17 (the image's):
# this machine's hardware profile measured (recipes/measure_hardware.py -> conf/hardware/h100.yaml, which
# hardware=auto then picks); the GPU tests of the automatic placement, compiled blocks, selective saving and no
# hidden sync (the first CUDA run of the first-forward check, engine/first_call.py); the 7B CausalLM with every
# placement field null, its planner prediction in its log line.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl .whl-liger/*.whl 2>&1 | tail -1
export PYTHONPATH=/tmp/site:$PWD:$PWD/recipes PYTHONUNBUFFERED=1 MACHINE=nvidia-h100
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; lscpu | grep "Model name"; nproc; grep MemTotal /proc/meminfo
python3 -c "import torch, transformers; print(torch.__version__, transformers.__version__)"
T0=$SECONDS
HW=megatrain_lightning/conf/hardware/h100.yaml
timeout 120 python3 recipes/measure_hardware.py --name h100 > /tmp/h100.yaml 2> $OUT/measure.err && cp /tmp/h100.yaml $HW && cp $HW $OUT/h100.yaml
echo "measure rc=$? $((SECONDS-T0)) s"; cat $HW 2>/dev/null || { tail -5 $OUT/measure.err; sed -i 's/("H100", "h100"), //' megatrain_lightning/hardware.py; }
NULLS="strategy.engine.slots=null strategy.engine.keep_activations=null strategy.engine.kept_saves=null strategy.engine.cache_weights=null strategy.engine.grad_buffers=null"
T0=$SECONDS
timeout 240 python3 -m pytest -q -s -p no:cacheprovider tests/test_auto_placement_cuda.py tests/test_compiled_blocks_cuda.py tests/test_parity_cuda.py -k "not parity_cuda or saving_matmuls or no_hidden_sync" > $OUT/cuda_tests.log 2>&1; echo "cuda tests rc=$? $((SECONDS-T0)) s"
grep -E "passed|failed|^\([a-h]\)|worst|Error|assert|chosen:" $OUT/cuda_tests.log | cut -c1-300 | tail -24
T0=$SECONDS
LEFT=$((585 - SECONDS))
timeout $LEFT python3 recipes/bench.py --timeout $((LEFT - 5)) --out $OUT/throughput --run "experiment=bench_7b hardware=auto trainer.max_steps=8 trainer.log_every_n_steps=1 +trainer.callbacks.throughput.skip_first=3 +trainer.callbacks.throughput.window=5 $NULLS" > $OUT/causallm7b.log 2>&1; echo "7b causallm rc=$? $((SECONDS-T0)) s"
for d in outputs/bench/*/; do echo "== $d"; grep -h "placement chosen\|placement tried\|Error\|compile" $d/output.log | cut -c1-400 | tail -4; cut -d, -f2,8,9 $d/logs/metrics.csv 2>/dev/null | grep -v "^,,," | tail -4 | tr '\n' ' '; echo; done
cat $OUT/throughput.md 2>/dev/null | grep "^| 20" | cut -d'|' -f5,7,9-13 | cut -c1-200
cp -r outputs/bench $OUT/bench_runs 2>/dev/null; rm -f $OUT/bench_runs/*/trace*; cd $OUT && tar czf /tmp/all.tgz . && rm -rf $OUT/* && mv /tmp/all.tgz $OUT/call1.tgz
