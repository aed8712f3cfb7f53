#!/bin/bash
# call 3 (prepared 2026-12-05, fifteenth session; not run: no device was lent), transformers 5.17: the LM head + loss
# with each chunk's gradients in its forward against the checkpointed chunks it replaced (7B and GPT-OSS heads); the
# GPT-OSS-20B shape cut to 7 layers, 14 x 2048, by default (blocks with experts eager) and with compile_blocks=true
# (compiled around the experts), side by side; Qwen3-30B-A3B cut to 10 layers, 8 x 2048, by default.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl .whl-liger/*.whl 2>&1 | tail -1
export PYTHONPATH=/tmp/site:$PWD:$PWD/recipes PYTHONUNBUFFERED=1 MACHINE=nvidia-h200
RUN="trainer=sweep trainer.log_every_n_steps=1 +trainer.callbacks.throughput.skip_first=3 +trainer.callbacks.throughput.window=5 data=synthetic data.seq_len=2048 hardware=auto"
T0=$SECONDS
timeout 120 python3 recipes/fused_kernels.py --loss-only --shapes 7b gpt-oss --repeats 5 > $OUT/head_loss.log 2>&1; echo "head loss rc=$? $((SECONDS-T0)) s"
grep "^|" $OUT/head_loss.log
for COMPILE in null true; do
  T0=$SECONDS
  timeout 150 python3 recipes/bench.py --timeout 145 --out $OUT/throughput --run "model=gpt_oss_20b model.config.num_hidden_layers=7 $RUN data.batch_size=14 trainer.max_steps=8 strategy.engine.compile_blocks=$COMPILE" > $OUT/moe7_$COMPILE.log 2>&1; echo "gpt-oss 7 layers compile_blocks=$COMPILE rc=$? $((SECONDS-T0)) s"
done
T0=$SECONDS
LEFT=$((580 - SECONDS))
[ $LEFT -gt 80 ] && timeout $LEFT python3 recipes/bench.py --timeout $((LEFT - 5)) --out $OUT/throughput --run "model=qwen3_30b_a3b model.config.num_hidden_layers=10 $RUN data.batch_size=8 trainer.max_steps=7" > $OUT/qwen3.log 2>&1; echo "qwen3 10 layers rc=$? $((SECONDS-T0)) s"
for d in outputs/bench/*/; do echo "== $d"; grep -h "placement chosen\|placement tried\|Error\|compile failed" $d/output.log | cut -c1-400 | tail -4; cut -d, -f2,8,9 $d/logs/metrics.csv 2>/dev/null | grep -v "^,,," | tail -3 | tr '\n' ' '; echo; done
cat $OUT/throughput.md 2>/dev/null | grep "^| 20" | cut -d'|' -f5,7,9-13 | cut -c1-200
cp -r outputs/bench $OUT/bench_runs 2>/dev/null; rm -f $OUT/bench_runs/*/trace*; cd $OUT && tar czf /tmp/all.tgz . && rm -rf $OUT/* && mv /tmp/all.tgz $OUT/call3.tgz
