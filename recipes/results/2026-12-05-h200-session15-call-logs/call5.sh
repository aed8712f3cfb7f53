#!/bin/bash
# call 5 (seventeenth session, 2026-12-05), transformers 5.17 (the image's), issue 18: calls 3 and 4 cut to what
# decides the MoE default and fits the time left (BUDGET seconds, default 560), most telling first: GPT-OSS-20B cut to
# 7 layers at 14 x 2048 by default (experts eager) and with compile_blocks=true (compiled around the experts), side
# by side; one Qwen3-30B-A3B layer pair eager against compiled; the resident baseline (Qwen3-30B-A3B cut to 4 layers,
# everything on the GPU beside the default), each only where the time left allows it.
set -u
B=${BUDGET:-560}
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | tail -1
export PYTHONPATH=/tmp/site:$PWD:$PWD/recipes PYTHONUNBUFFERED=1 MACHINE=nvidia-h200
RUN="trainer=sweep trainer.log_every_n_steps=1 +trainer.callbacks.throughput.skip_first=3 +trainer.callbacks.throughput.window=4 data=synthetic data.seq_len=2048 hardware=auto"
for COMPILE in null true; do
  T0=$SECONDS; LEFT=$((B - SECONDS))
  [ $LEFT -gt 100 ] && timeout $((LEFT < 150 ? LEFT : 150)) python3 recipes/bench.py --timeout 145 --out $OUT/throughput --run "model=gpt_oss_20b model.config.num_hidden_layers=7 $RUN data.batch_size=14 trainer.max_steps=7 strategy.engine.compile_blocks=$COMPILE" > $OUT/moe7_$COMPILE.log 2>&1; echo "gpt-oss 7 layers compile_blocks=$COMPILE rc=$? $((SECONDS-T0)) s"
done
T0=$SECONDS; LEFT=$((B - SECONDS))
[ $LEFT -gt 90 ] && timeout $((LEFT < 160 ? LEFT : 160)) python3 recipes/moe_layer.py --shape qwen3 --micro-batch 8 --seq-len 2048 --layers 2 --reps 3 --experts grouped_mm_gather --compile > $OUT/qwen3_layer.log 2>&1; echo "qwen3 layer rc=$? $((SECONDS-T0)) s"
grep -v "Warning\|warn(" $OUT/qwen3_layer.log 2>/dev/null | tail -14 | cut -c1-260
T0=$SECONDS; LEFT=$((B - SECONDS))
[ $LEFT -gt 110 ] && timeout $LEFT python3 recipes/defaults_vs_baselines.py --model qwen3_30b_a3b --layers 4 --micro-batch 8 --warmup 3 --steps 4 --modes all-on-gpu megatrain-default --timeout $(((LEFT - 10) / 2)) --out $OUT/throughput > $OUT/qwen3_resident.log 2>&1; echo "qwen3 4 layers resident vs default rc=$? $((SECONDS-T0)) s"
grep -v "Warning\|warn(" $OUT/qwen3_resident.log 2>/dev/null | grep '^{\|Error\|error' | cut -c1-900
for d in outputs/bench/*/; do echo "== $d"; grep -h "placement chosen\|placement tried\|Error\|compile failed" $d/output.log | cut -c1-400 | tail -4; cut -d, -f2,8,9 $d/logs/metrics.csv 2>/dev/null | grep -v "^,,," | tail -3 | tr '\n' ' '; echo; done
cat $OUT/throughput.md 2>/dev/null | grep "^| 20" | cut -d'|' -f5,7,9-13 | cut -c1-200
cp -r outputs/bench $OUT/bench_runs 2>/dev/null; rm -f $OUT/bench_runs/*/trace*; cd $OUT && tar czf /tmp/all.tgz . && rm -rf $OUT/* && mv /tmp/all.tgz $OUT/call5.tgz
