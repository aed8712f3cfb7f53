#!/bin/bash
# session 25, call 5 (carry .whl and .ab, .ab/old being `git archive` of e8adfe7, the code before this change; BUDGET
# seconds): blocks compiled while router logits are recorded (a graph break at the recording hook) against eager
# (before), side by side: Qwen3-30B-A3B cut to 10 layers with its router loss on (model.config.output_router_logits=true)
# at call 3's pick and placement, pinned (25 x 2048, keep 0, cache 7, update_on_device=4), steps 4-7 timed; then the
# router loss's fp32 parity on the GPU (tests/test_compiled_blocks_cuda.py (g)) on this change.
set -u
B=${BUDGET:-330}
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | grep -v "already exists" | tail -1
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader
ROOT=$PWD
rm -rf outputs/bench .ab/old/outputs/bench
RUN="trainer=sweep trainer.log_every_n_steps=1 +trainer.callbacks.throughput.skip_first=3 +trainer.callbacks.throughput.window=4 data=synthetic data.seq_len=2048 hardware=auto trainer.max_steps=8 model.config.output_router_logits=true"
Q="model=qwen3_30b_a3b model.config.num_hidden_layers=10 data.batch_size=25 strategy.engine.keep_activations=0 strategy.engine.kept_saves=all strategy.engine.cache_weights=7 strategy.engine.update_on_device=4"
bench() {  # name, tree, seconds at most, overrides...
  local name=$1 tree=$2 cap=$3; shift 3; local T0=$SECONDS LEFT=$((B - SECONDS))
  [ $LEFT -gt 90 ] && (cd $tree && PYTHONPATH=/tmp/site:$PWD:$PWD/recipes timeout $((LEFT < cap ? LEFT : cap)) python3 recipes/bench.py --timeout $((LEFT < cap ? LEFT - 5 : cap - 5)) --out $OUT/throughput_$name --run "$*") > $OUT/$name.log 2>&1
  echo "$name rc=$? $((SECONDS-T0)) s"
}
bench qwen3_router_compiled $ROOT 120 "$Q $RUN"
bench qwen3_router_eager $ROOT/.ab/old 120 "$Q $RUN"
for d in outputs/bench/*/ .ab/old/outputs/bench/*/; do echo "== $d"; grep -h "placement chosen\|Error\|compile failed" $d/output.log | cut -c1-300 | tail -3; python3 -c "import csv,sys; rows=list(csv.DictReader(open(sys.argv[1]))); print(' | '.join(f\"{r['step']} {float(r['TFLOPS']):.1f} {float(r['tokens/s']):.0f} {r['peak_gpu_mem_GiB'][:5]}\" for r in rows if r.get('TFLOPS')))" $d/logs/metrics.csv 2>&1 | tail -1; grep -h "^[0-9]*,.*,[0-9.]*,[0-9]*,$" $d/logs/metrics.csv | head -0; done
LEFT=$((B - SECONDS - 5)); [ $LEFT -gt 40 ] && PYTHONPATH=/tmp/site:$PWD timeout $LEFT python3 -m pytest -q -x -s tests/test_compiled_blocks_cuda.py -k router_loss > $OUT/router_parity.log 2>&1; echo "router parity rc=$?"; grep -h "^(g)\|passed\|failed\|Error" $OUT/router_parity.log | tail -6
mkdir -p $OUT/runs && cp -r outputs/bench $OUT/runs/compiled; cp -r .ab/old/outputs/bench $OUT/runs/eager 2>/dev/null; true
