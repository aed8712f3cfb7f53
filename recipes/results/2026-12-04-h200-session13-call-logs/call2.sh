#!/bin/bash
# call 2 (2026-12-04, thirteenth session): "home on demand" (engine/device_update.py: what the device updates keeps its
# newer masters and moments there until the host state is read; only a streamed first block's masters go home each
# step) and the benchmark timed as training runs (synchronised at the window's two ends only, not at every batch end):
# the cuda parity/sync/auto-placement tests and the new (h) (a checkpoint sends the device state home, resume exact);
# the 3B plain HF default side by side with everything on the GPU and DeepSpeed ZeRO-3 offload (pin_memory=True);
# GPT-OSS-20B cut to 7 layers (the most whose fp32 state fits the 126 GiB host) at 14 x 2048
set -u
rm -rf ~/.cache/torch_extensions
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | tail -1
python3 -m pip install -q --no-index --no-deps --no-build-isolation --target /tmp/site .whl/deepspeed-*.tar.gz 2>&1 | tail -1
export PYTHONPATH=/tmp/site:$PWD:$PWD/recipes PYTHONUNBUFFERED=1 MACHINE=nvidia-h200
RUN="trainer=sweep trainer.log_every_n_steps=1 +trainer.callbacks.throughput.skip_first=3 +trainer.callbacks.throughput.window=5 data=synthetic data.seq_len=2048 hardware=auto"
T0=$SECONDS
timeout 170 python3 -m pytest -q -s -p no:cacheprovider tests/test_parity_cuda.py tests/test_auto_placement_cuda.py -k "three_slots or no_hidden_sync or keep_cache_offload or home_on_demand or measures or backs_off" > $OUT/cuda_tests.log 2>&1; echo "cuda tests rc=$? $((SECONDS-T0)) s"
grep -E "passed|failed|^\(a\)|^\(d\)|^\(e\)|^\(h\)|worst|Error|assert|placement chosen" $OUT/cuda_tests.log | cut -c1-300 | tail -20
T0=$SECONDS
timeout 260 python3 recipes/defaults_vs_baselines.py --model qwen2_5_3b --micro-batch 8 --warmup 3 --steps 5 --modes megatrain-default all-on-gpu deepspeed --timeout 125 --out $OUT/throughput > $OUT/compare3b.log 2>&1; echo "3b side by side rc=$? $((SECONDS-T0)) s"
grep -v "Warning\|warn(" $OUT/compare3b.log | grep '^{' | cut -c1-900
T0=$SECONDS
LEFT=$((585 - SECONDS))
[ $LEFT -gt 80 ] && timeout $LEFT python3 recipes/bench.py --timeout $((LEFT - 5)) --out $OUT/throughput --run "model=gpt_oss_20b model.config.num_hidden_layers=7 $RUN data.batch_size=14 trainer.max_steps=8" > $OUT/moe7.log 2>&1; echo "gpt-oss 7 layers 14x2048 rc=$? $((SECONDS-T0)) s"
for d in outputs/bench/*/; do echo "== $d"; grep -h "placement chosen\|Error" $d/output.log | cut -c1-400 | tail -3; cut -d, -f2,8,9 $d/logs/metrics.csv 2>/dev/null | grep -v "^,,," | tail -4 | tr '\n' ' '; echo; done
cat $OUT/throughput.md 2>/dev/null | grep "^| 20" | cut -d'|' -f5,7,9-13 | cut -c1-200
cp -r outputs/bench $OUT/bench_runs 2>/dev/null; rm -f $OUT/bench_runs/*/trace*; cd $OUT && tar czf /tmp/all.tgz . && rm -rf $OUT/* && mv /tmp/all.tgz $OUT/call2.tgz
