#!/bin/bash
# call 1 (2026-12-03, eleventh session; 1800 s of device time): update_on_device=N on the GPU (CUDA parity
# (4, 3) and the sync test with N=3), the 3B plain HF module with N = 8 and 12 side by side with the default
# and everything on the GPU, the 7B CausalLM default (the first block now updated on the device), and the
# first whole-model GPT-OSS throughput (issue 18)
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | tail -1
export PYTHONPATH=/tmp/site:$PWD:$PWD/recipes PYTHONUNBUFFERED=1 MACHINE=nvidia-h200
NULLS="strategy.engine.slots=null strategy.engine.keep_activations=null strategy.engine.kept_saves=null strategy.engine.cache_weights=null strategy.engine.grad_buffers=null"
T0=$SECONDS
timeout 90 python3 -m pytest -q -s -p no:cacheprovider tests/test_parity_cuda.py -k "three_slots or no_hidden_sync" > $OUT/cuda_tests.log 2>&1; echo "cuda parity/sync tests rc=$? $((SECONDS-T0)) s"
grep -E "passed|failed|^\(a\)|^\(e\)|worst|Error|assert" $OUT/cuda_tests.log | cut -c1-300 | tail -12
T0=$SECONDS
timeout 230 python3 recipes/defaults_vs_baselines.py --model qwen2_5_3b --micro-batch 8 --warmup 3 --steps 3 --modes megatrain-default megatrain-set all-on-gpu --engine update_on_device=8 --timeout 70 --out $OUT/throughput > $OUT/compare3b.log 2>&1; echo "3b side by side (N=8) rc=$? $((SECONDS-T0)) s"
T0=$SECONDS
timeout 75 python3 recipes/defaults_vs_baselines.py --model qwen2_5_3b --micro-batch 8 --warmup 3 --steps 3 --modes megatrain-set --engine update_on_device=12 --timeout 70 --out $OUT/throughput > $OUT/compare3b_n12.log 2>&1; echo "3b N=12 rc=$? $((SECONDS-T0)) s"
grep -hv "Warning\|warn(" $OUT/compare3b.log $OUT/compare3b_n12.log | grep '^{' | cut -c1-700
T0=$SECONDS
LEFT=$((560 - SECONDS)); [ $LEFT -gt 150 ] && LEFT=150
timeout $LEFT python3 recipes/bench.py --timeout $((LEFT - 5)) --out $OUT/throughput --run "experiment=bench_7b hardware=auto trainer.max_steps=7 trainer.log_every_n_steps=1 +trainer.callbacks.throughput.window=1 $NULLS" > $OUT/causallm7b.log 2>&1; echo "7b causallm default rc=$? $((SECONDS-T0)) s"
T0=$SECONDS
LEFT=$((585 - SECONDS))
timeout $LEFT python3 recipes/bench.py --timeout $((LEFT - 5)) --out $OUT/throughput --run "model=gpt_oss_20b model.config.num_hidden_layers=4 data=synthetic hardware=auto trainer=sweep data.batch_size=34 data.seq_len=2048 trainer.max_steps=6 trainer.log_every_n_steps=1 +trainer.callbacks.throughput.window=1" > $OUT/moe.log 2>&1; echo "gpt-oss 4 layers rc=$? $((SECONDS-T0)) s"
for d in outputs/bench/*/; do echo "== $d"; grep -h "placement\|chose\|host-bound\|warn" $d/output.log | cut -c1-400 | tail -6; cut -d, -f1-9 $d/logs/metrics.csv 2>/dev/null | grep -v "^,,,," | cut -c1-120 | tail -8; done
cat $OUT/throughput.md 2>/dev/null | grep "^| 20" | cut -c1-500
cp -r outputs/bench $OUT/bench_runs 2>/dev/null; rm -f $OUT/bench_runs/*/trace*
