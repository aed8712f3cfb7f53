#!/bin/bash
# session 17, call 3 (call 2 cut to what the time left allows: four more requests refused), issue 15 on
# transformers 5.25.0 (the newest release, carried in .whl-tf): the Qwen2.5-3B plain HF module with nothing set
# (blocks compiled by default), its planner prediction logged; the bf16 back-off test with its noise taken per role.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site-tf .whl-tf/*.whl 2>&1 | tail -1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | tail -1
export PYTHONUNBUFFERED=1 MACHINE=$(nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200 && echo nvidia-h200 || echo nvidia-h100); echo $MACHINE
export PYTHONPATH=/tmp/site-tf:/tmp/site:$PWD:$PWD/recipes
python3 -c "import torch, transformers; print(torch.__version__, transformers.__version__)"
T0=$SECONDS
timeout 150 python3 recipes/defaults_vs_baselines.py --model qwen2_5_3b --micro-batch 8 --warmup 3 --steps 5 --modes megatrain-default --timeout 145 --out $OUT/throughput > $OUT/default3b.log 2>&1; echo "3b default (5.25) rc=$? $((SECONDS-T0)) s"
grep -v "Warning\|warn(" $OUT/default3b.log | grep '^{\|Error\|error\|placement' | cut -c1-900
T0=$SECONDS
timeout 110 python3 -m pytest -q -s -p no:cacheprovider "tests/test_auto_placement_cuda.py::test_a_tried_placement_that_runs_out_of_memory_backs_off_and_runs_the_step_again[bf16-mixed]" > $OUT/backoff_test.log 2>&1; echo "back-off test (5.25) rc=$? $((SECONDS-T0)) s"
grep -E "passed|failed|^\(b\)|worst|Error|assert" $OUT/backoff_test.log | cut -c1-300 | tail -8
