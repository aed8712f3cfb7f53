#!/bin/bash
# session 18, call 1 (= session 17 call 2, unrun there). (1) Issue 15 on transformers 5.25.0 (the newest release,
# carried in .whl-tf): the Qwen2.5-3B plain HF module with nothing set (blocks compiled by default), its planner
# prediction logged; the bf16 back-off test with its noise taken per role. (2) Issue 18 on the image's transformers:
# GPT-OSS-20B cut to 7 layers, 14 x 2048, blocks with experts eager (the default) against compile_blocks=true
# (compiled around the experts), side by side, each where the time left allows.
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
export PYTHONPATH=/tmp/site:$PWD:$PWD/recipes
RUN="trainer=sweep trainer.log_every_n_steps=1 +trainer.callbacks.throughput.skip_first=3 +trainer.callbacks.throughput.window=4 data=synthetic data.seq_len=2048 hardware=auto"
for COMPILE in null true; do
  T0=$SECONDS; LEFT=$((575 - SECONDS))
  [ $LEFT -gt 100 ] && timeout $((LEFT < 150 ? LEFT : 150)) python3 recipes/bench.py --timeout 145 --out $OUT/throughput --run "model=gpt_oss_20b model.config.num_hidden_layers=7 $RUN data.batch_size=14 trainer.max_steps=7 strategy.engine.compile_blocks=$COMPILE" > $OUT/moe7_$COMPILE.log 2>&1; echo "gpt-oss 7 layers compile_blocks=$COMPILE rc=$? $((SECONDS-T0)) s"
done
for d in outputs/bench/*/; do echo "== $d"; grep -h "placement chosen\|placement tried\|Error\|compile failed" $d/output.log | cut -c1-400 | tail -3; cut -d, -f2,8,9 $d/logs/metrics.csv 2>/dev/null | grep -v "^,,," | tail -3 | tr '\n' ' '; echo; done
cat $OUT/throughput.md 2>/dev/null | grep "^| 20" | cut -d'|' -f5,7,9-13 | cut -c1-200
cp -r outputs/bench $OUT/bench_runs 2>/dev/null; rm -f $OUT/bench_runs/*/trace*; cd $OUT && tar czf /tmp/all.tgz . && rm -rf $OUT/* && mv /tmp/all.tgz $OUT/call1.tgz
