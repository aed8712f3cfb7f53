#!/bin/bash
# session 26, call 4 (carry .whl and .ab, .ab/old being `git archive accca21`, the code before this change; BUDGET
# seconds): kept blocks compiled whole (saving matmul outputs, experts inside) while router logits are recorded,
# against the same calls eager (before), side by side. Qwen3-30B-A3B cut to 5 layers with its router loss on
# (model.config.output_router_logits=true), the H100 planner's pick and placement for 5 layers but every block kept
# saving matmul outputs (as the H200's pick for 10 layers keeps them: keep 10, matmuls), pinned: 13 x 2048, keep 5
# (matmuls), cache 5, update_on_device=4; steps 4-7 timed. Then the same without the router loss (this change), and
# the router loss's fp32 parity on the GPU (tests/test_compiled_blocks_cuda.py (g)), now requiring whole compiled calls.
set -u
B=${BUDGET:-480}
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | grep -v "already exists" | tail -1
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader
ROOT=$PWD
rm -rf outputs/bench .ab/old/outputs/bench
RUN="trainer=sweep trainer.log_every_n_steps=1 +trainer.callbacks.throughput.skip_first=3 +trainer.callbacks.throughput.window=4 data=synthetic data.seq_len=2048 hardware=auto trainer.max_steps=8"
Q="model=qwen3_30b_a3b model.config.num_hidden_layers=5 data.batch_size=13 strategy.engine.keep_activations=5 strategy.engine.kept_saves=matmuls strategy.engine.cache_weights=5 strategy.engine.update_on_device=4"
bench() {  # name, tree, seconds at most, overrides...
  local name=$1 tree=$2 cap=$3; shift 3; local T0=$SECONDS LEFT=$((B - SECONDS))
  [ $LEFT -gt 90 ] && (cd $tree && PYTHONPATH=/tmp/site:$PWD:$PWD/recipes timeout $((LEFT < cap ? LEFT : cap)) python3 recipes/bench.py --timeout $((LEFT < cap ? LEFT - 5 : cap - 5)) --out $OUT/throughput_$name --run "$*") > $OUT/$name.log 2>&1
  echo "$name rc=$? $((SECONDS-T0)) s"
}
bench qwen3_router_whole $ROOT 110 "$Q $RUN model.config.output_router_logits=true"
bench qwen3_router_before $ROOT/.ab/old 110 "$Q $RUN model.config.output_router_logits=true"
LEFT=$((B - SECONDS - 5)); [ $LEFT -gt 60 ] && PYTHONPATH=/tmp/site:$PWD timeout $LEFT python3 -m pytest -q -x -s tests/test_compiled_blocks_cuda.py -k router_loss > $OUT/router_parity.log 2>&1; echo "router parity rc=$?"; grep -h "^(g)\|passed\|failed\|Error" $OUT/router_parity.log | grep -v Warning | tail -6
bench qwen3_no_router $ROOT 100 "$Q $RUN"
for d in outputs/bench/*/ .ab/old/outputs/bench/*/; do echo "== $d"; grep -o "output_router_logits=[a-z]*" $d/.hydra/overrides.yaml; grep -h "placement\|Error\|compile failed" $d/output.log | cut -c1-300 | tail -3; python3 -c "import csv,sys; rows=list(csv.DictReader(open(sys.argv[1]))); print(' | '.join(f\"{r['step']} {float(r['TFLOPS']):.1f} {float(r['tokens/s']):.0f} {r['peak_gpu_mem_GiB'][:5]}\" for r in rows if r.get('TFLOPS')))" $d/logs/metrics.csv 2>&1 | tail -1; done
mkdir -p $OUT/runs && cp -r outputs/bench $OUT/runs/new; cp -r .ab/old/outputs/bench $OUT/runs/before 2>/dev/null; rm -f $OUT/runs/*/*/trace*; true
