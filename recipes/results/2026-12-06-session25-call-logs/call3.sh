#!/bin/bash
# session 25, call 3 (carry .whl; BUDGET seconds; the same H100 as calls 1-2, warm): the router loss's cost at the
# size issue 18 names: GPT-OSS-20B cut to 7 layers and Qwen3-30B-A3B cut to 10, call 1's runs (nothing set but
# hardware=auto, so the planner's pick) with model.config.output_router_logits=true (each model's own
# router_aux_loss_coef: 0.9, 0.001), steps 4-7 timed; call 1 gives the same runs without it.
set -u
B=${BUDGET:-300}
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | grep -v "already exists" | tail -1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD:$PWD/recipes
nvidia-smi --query-gpu=name --format=csv,noheader
rm -rf outputs/bench
RUN="trainer=sweep trainer.log_every_n_steps=1 +trainer.callbacks.throughput.skip_first=3 +trainer.callbacks.throughput.window=4 data=synthetic data.seq_len=2048 hardware=auto trainer.max_steps=8 model.config.output_router_logits=true"
bench() {  # name, seconds at most, overrides...
  local name=$1 cap=$2; shift 2; local T0=$SECONDS LEFT=$((B - SECONDS))
  [ $LEFT -gt 90 ] && timeout $((LEFT < cap ? LEFT : cap)) python3 recipes/bench.py --timeout $((LEFT < cap ? LEFT - 5 : cap - 5)) --out $OUT/throughput --run "$*" > $OUT/$name.log 2>&1
  echo "$name rc=$? $((SECONDS-T0)) s"
}
bench gpt_oss_7_router_loss 150 "model=gpt_oss_20b model.config.num_hidden_layers=7 $RUN"
bench qwen3_10_router_loss 140 "model=qwen3_30b_a3b model.config.num_hidden_layers=10 $RUN"
for d in outputs/bench/*/; do echo "== $d"; grep -o "model=[a-z0-9_]*\|num_hidden_layers=[0-9]*" $d/.hydra/overrides.yaml 2>/dev/null | tr '\n' ' '; echo; grep -h "planner's pick\|placement chosen\|Error\|warn" $d/output.log | cut -c1-330 | tail -4; python3 -c "import csv,sys; rows=list(csv.DictReader(open(sys.argv[1]))); print(' | '.join(f\"{r['step']} {float(r['TFLOPS']):.1f} {float(r['tokens/s']):.0f} {r.get('gpu_alloc_retries') or 0}\" for r in rows if r.get('TFLOPS')))" $d/logs/metrics.csv 2>&1 | tail -1; grep -h "train/loss\|loss" $d/logs/metrics.csv | head -0; done
cat $OUT/throughput.md 2>/dev/null | grep "^| 20" | cut -d'|' -f5,7,9-16 | cut -c1-300
cp -r outputs/bench $OUT/bench_runs 2>/dev/null; cd $OUT && tar czf /tmp/all.tgz . && rm -rf $OUT/* && mv /tmp/all.tgz $OUT/call3.tgz
