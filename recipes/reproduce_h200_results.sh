#!/usr/bin/env bash
# bash recipes/reproduce_h200_results.sh [part ...]      parts: tests native 3b 7b depth compact14b 14b (default: tests 3b 7b)
#
# The runs behind recipes/results/*-h200-*.md, on one H200 (14b needs ~230 GiB of host memory: nvidia-h200-x2),
# each through train.py (conf/experiment/bench_*.yaml plus the overrides below) by recipes/bench.py, which
# appends its rows, with the exact command, to recipes/results/<today>-h200-throughput.csv/.md.
# About 1.5 min for tests, 2 for 3b, 3 for 7b, 4 for depth, 6 for compact14b.
set -euo pipefail
cd "$(dirname "$0")/.."
parts=("$@")
[ ${#parts[@]} -eq 0 ] && parts=(tests 3b 7b)
export MACHINE=${MACHINE:-nvidia-h200}
bench() { python recipes/bench.py "$@"; }

for part in "${parts[@]}"; do
  case "$part" in
    tests)
      python -m pytest -q -s tests/test_parity_cuda.py ;;
    native)  # the one-pass kernels on this host: exactness against this torch (CPU tests), then speed
      python -m pytest -q -p no:cacheprovider tests/test_native_adam.py tests/test_bf16_grads.py tests/test_compact_state.py
      python recipes/benchmark_host_adam.py --params 256e6 --repeats 3 ;;
    3b)  # 2048 x 8 tokens per step, keep 32, cache 36, slots 3, loss chunks of 4096, bf16 gradients (one-pass AdamW)
      bench --run "experiment=bench_3b hardware=auto" ;;
    7b)  # 2048 x 16 tokens per step, keep 24 saving matmuls, cache 28, slots 3, a pool of 4 gradient buffers
      bench --run "experiment=bench_7b hardware=auto" ;;
    depth)  # the 1.5B width at 28 and 112 blocks, offloaded inputs: device memory flat in depth
      for layers in 28 112; do
        bench --run "experiment=bench_3b hardware=auto model=qwen2_5_1_5b model.config.num_hidden_layers=$layers \
          data.batch_size=4 trainer.accumulate_grad_batches=4 trainer.max_steps=4 strategy.engine.keep_activations=0 \
          strategy.engine.cache_weights=0 strategy.engine.offload_inputs=true model.loss_chunk_tokens=null"
      done ;;
    compact14b)  # all 48 blocks of the 14B shape (14.77 B params) in compact host state on one nvidia-h200
      bench --timeout 590 --run "experiment=bench_7b hardware=auto model=qwen2_5_14b data.batch_size=8 trainer.max_steps=10 \
        strategy.engine.host_state=compact strategy.engine.keep_activations=4 strategy.engine.kept_saves=all \
        strategy.engine.cache_weights=48" ;;
    14b)
      CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0} MACHINE=nvidia-h200-x2 bench --run "experiment=bench_7b \
        hardware=auto model=qwen2_5_14b data.batch_size=8 strategy.engine.keep_activations=4 \
        strategy.engine.kept_saves=all strategy.engine.cache_weights=48 strategy.engine.grad_buffers=null" ;;
    *)
      echo "unknown part: $part (tests native 3b 7b depth compact14b 14b)" >&2; exit 2 ;;
  esac
done
