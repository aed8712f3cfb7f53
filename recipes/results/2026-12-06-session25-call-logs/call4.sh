#!/bin/bash
# session 25, call 4 (carry .whl; BUDGET seconds; the same H100, warm): the resident baseline where one fits the H100's
# 80 GB: Qwen3-30B-A3B cut to 4 layers (3.1 B parameters, 50 GB of fp32 weights, gradients and AdamW moments) all on the
# GPU (Lightning's SingleDeviceStrategy, bf16-mixed, the model's own kernels) against megatrain at the same 8 x 2048 and
# at the planner's pick; then GPT-OSS-20B cut to 2 layers, both strategies at 4 x 2048. Steps 4-7 timed.
set -u
B=${BUDGET:-300}
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | grep -v "already exists" | tail -1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD:$PWD/recipes
nvidia-smi --query-gpu=name --format=csv,noheader
rm -rf outputs/bench
RUN="trainer=sweep trainer.log_every_n_steps=1 +trainer.callbacks.throughput.skip_first=3 +trainer.callbacks.throughput.window=4 data=synthetic data.seq_len=2048 hardware=auto trainer.max_steps=8"
bench() {  # name, seconds at most, overrides...
  local name=$1 cap=$2; shift 2; local T0=$SECONDS LEFT=$((B - SECONDS))
  [ $LEFT -gt 90 ] && timeout $((LEFT < cap ? LEFT : cap)) python3 recipes/bench.py --timeout $((LEFT < cap ? LEFT - 5 : cap - 5)) --out $OUT/throughput --run "$*" > $OUT/$name.log 2>&1
  echo "$name rc=$? $((SECONDS-T0)) s"
}
Q="model=qwen3_30b_a3b model.config.num_hidden_layers=4 $RUN"
G="model=gpt_oss_20b model.config.num_hidden_layers=2 $RUN"
bench qwen3_4_resident_8 110 "$Q data.batch_size=8 strategy=single_device"
bench qwen3_4_megatrain_8 100 "$Q data.batch_size=8"
bench qwen3_4_megatrain_picked 100 "$Q"
bench gpt_oss_2_resident_4 100 "$G data.batch_size=4 strategy=single_device"
bench gpt_oss_2_megatrain_4 100 "$G data.batch_size=4"
for d in outputs/bench/*/; do echo "== $d"; grep -o "model=[a-z0-9_]*\|strategy=[a-z_]*\|batch_size=[0-9]*\|num_hidden_layers=[0-9]*" $d/.hydra/overrides.yaml 2>/dev/null | tr '\n' ' '; echo; grep -h "planner's pick\|placement chosen\|Error\|warn" $d/output.log | cut -c1-330 | tail -4; python3 -c "import csv,sys; rows=list(csv.DictReader(open(sys.argv[1]))); print(' | '.join(f\"{r['step']} {float(r['TFLOPS']):.1f} {float(r['tokens/s']):.0f} {r.get('gpu_alloc_retries') or 0}\" for r in rows if r.get('TFLOPS')))" $d/logs/metrics.csv 2>&1 | tail -1; grep -h "train/loss\|loss" $d/logs/metrics.csv | head -0; done
cat $OUT/throughput.md 2>/dev/null | grep "^| 20" | cut -d'|' -f5,7,9-16 | cut -c1-300
cp -r outputs/bench $OUT/bench_runs 2>/dev/null; cd $OUT && tar czf /tmp/all.tgz . && rm -rf $OUT/* && mv /tmp/all.tgz $OUT/call4.tgz
