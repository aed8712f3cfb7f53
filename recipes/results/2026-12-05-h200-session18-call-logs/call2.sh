#!/bin/bash
# session 18, call 2, image's transformers, issue 18: Qwen3-30B-A3B cut to 10 layers, 8 x 2048, by default (experts
# eager) against compile_blocks=true (compiled around the experts), side by side; then the resident baseline (cut to 4
# layers, everything on the GPU beside the strategy's default), each only where the time left allows (BUDGET s).
set -u
B=${BUDGET:-570}
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | tail -1
export PYTHONUNBUFFERED=1 MACHINE=$(nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200 && echo nvidia-h200 || echo nvidia-h100); echo $MACHINE
export PYTHONPATH=/tmp/site:$PWD:$PWD/recipes
RUN="trainer=sweep trainer.log_every_n_steps=1 +trainer.callbacks.throughput.skip_first=3 +trainer.callbacks.throughput.window=4 data=synthetic data.seq_len=2048 hardware=auto"
for COMPILE in null true; do
  T0=$SECONDS; LEFT=$((B - SECONDS))
  [ $LEFT -gt 100 ] && timeout $((LEFT < 160 ? LEFT : 160)) python3 recipes/bench.py --timeout 155 --out $OUT/throughput --run "model=qwen3_30b_a3b model.config.num_hidden_layers=10 $RUN data.batch_size=8 trainer.max_steps=7 strategy.engine.compile_blocks=$COMPILE" > $OUT/qwen3_$COMPILE.log 2>&1; echo "qwen3 10 layers compile_blocks=$COMPILE rc=$? $((SECONDS-T0)) s"
done
T0=$SECONDS; LEFT=$((B - SECONDS))
[ $LEFT -gt 110 ] && timeout $LEFT python3 recipes/defaults_vs_baselines.py --model qwen3_30b_a3b --layers 4 --micro-batch 8 --warmup 3 --steps 4 --modes all-on-gpu megatrain-default --timeout $(((LEFT - 10) / 2)) --out $OUT/throughput > $OUT/qwen3_resident.log 2>&1; echo "qwen3 4 layers resident vs default rc=$? $((SECONDS-T0)) s"
grep -v "Warning\|warn(" $OUT/qwen3_resident.log 2>/dev/null | grep '^{\|Error\|error' | cut -c1-900
for d in outputs/bench/*/; do echo "== $d"; grep -h "placement chosen\|placement tried\|Error\|compile failed\|host-bound" $d/output.log | cut -c1-400 | tail -4; cut -d, -f2,8,9 $d/logs/metrics.csv 2>/dev/null | grep -v "^,,," | tail -3 | tr '\n' ' '; echo; done
cat $OUT/throughput.md 2>/dev/null | grep "^| 20" | cut -d'|' -f5,7,9-13 | cut -c1-200
cp -r outputs/bench $OUT/bench_runs 2>/dev/null; rm -f $OUT/bench_runs/*/trace*; cd $OUT && tar czf /tmp/all.tgz . && rm -rf $OUT/* && mv /tmp/all.tgz $OUT/call2.tgz
