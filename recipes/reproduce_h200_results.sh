#!/usr/bin/env bash
# bash recipes/reproduce_h200_results.sh [part ...]      parts: tests 3b 7b depth 14b compact14b (default: the first
# four), 7b_split (split_embedding_update side by side), compact14b_full (all 48 blocks) and 3b_bf16 (bf16
# gradients through the one-pass native AdamW against fp32 gradients, interleaved, with the baselines),
# profile3b (the 3B breakdown alone) and native (the one-pass kernels' exactness and speed on this host)
#
# The runs behind recipes/results/2026-11-30-h200-*.md, with the exact commands, on one H200 (the 14B part
# needs about 230 GiB of host memory: nvidia-h200-x2). Rows go to recipes/results/<today>-h200-throughput
# .csv/.md (and -14b for the 14B part); pytest prints the parity figures. The deepspeed_zero3_offload run
# needs deepspeed importable (shared/GPU.md says how to carry it to a machine without network); it is
# skipped with a message otherwise. About 3 min for tests, 6 for 3b, 3 for 7b, 3 for depth, 5 for 14b.
# compact14b: the Qwen2.5-14B shape with 46 of its 48 blocks (14.2 B parameters) and host_state="compact" on
# one nvidia-h200, whose ~125 GiB of free host memory it nearly fills (measured 117.6 GiB RSS; ~6.5 min).
set -euo pipefail
cd "$(dirname "$0")/.."
parts=("$@")
[ ${#parts[@]} -eq 0 ] && parts=(tests 3b 7b depth)
out="recipes/results/$(date +%F)-h200-throughput"
bench() { python recipes/benchmark_throughput.py "$@"; }

for part in "${parts[@]}"; do
  case "$part" in
    tests)
      python -m pytest -q -s tests/test_parity_cuda.py ;;
    3b)
      common=(--model qwen2_5_3b --micro-batch 8 --accumulate 1 --seq-len 2048 --warmup 2 --out "$out")
      mt=(--strategies megatrain --keep 32 --cache 36 --loss-chunk 4096)
      bench "${common[@]}" --steps 8 "${mt[@]}"  # the defaults: own accumulators (they fit), bf16 gradients (native)
      bench "${common[@]}" --steps 6 --strategies single_device
      if python -c "import deepspeed" 2>/dev/null; then
        bench "${common[@]}" --strategies deepspeed_zero3_offload --steps 4
      else
        echo "deepspeed is not importable: deepspeed_zero3_offload skipped" >&2
      fi
      bench "${common[@]}" --steps 8 "${mt[@]}" --fp32-grads  # fp32 gradients: 28 host B/param in the AdamW
      # the measured breakdown (torch.profiler over 2 steps; the profiler slows the steps it covers)
      bench "${common[@]}" --steps 4 "${mt[@]}" --profile 2 --out "$out-profile" ;;
    profile3b)  # the 3B breakdown alone, final defaults
      bench --model qwen2_5_3b --micro-batch 8 --accumulate 1 --seq-len 2048 --warmup 2 --steps 4 --strategies megatrain \
        --keep 32 --cache 36 --loss-chunk 4096 --profile 2 --out "$out-profile" ;;
    native)  # the one-pass kernels on this host: exactness against this torch (CPU tests), then speed
      python -m pytest -q -p no:cacheprovider tests/test_native_adam.py tests/test_bf16_grads.py tests/test_compact_state.py
      python recipes/benchmark_host_adam.py --params 256e6 --repeats 3 ;;
    7b)
      # 24 kept blocks: what the spare device memory holds (127 GiB reserved); 20 gave 3.70 s/step
      bench --model qwen2_5_7b --strategies megatrain --micro-batch 16 --accumulate 1 --steps 20 --warmup 2 \
        --slots 3 --keep 24 --kept-saves matmuls --cache 28 --loss-chunk 4096 --grad-buffers 4 --out "$out" ;;
    depth)
      for layers in 28 112; do
        bench --model qwen2_5_1_5b --layers "$layers" --strategies megatrain --micro-batch 4 --accumulate 4 \
          --steps 4 --warmup 2 --slots 3 --offload-inputs --out "$out"
      done ;;
    14b)
      CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0} MACHINE=${MACHINE:-nvidia-h200-x2} bench --model qwen2_5_14b \
        --strategies megatrain --micro-batch 8 --accumulate 1 --steps 20 --warmup 2 --keep 4 --cache 48 \
        --loss-chunk 4096 --out "$out-14b" ;;
    3b_bf16)  # bf16 gradients through the one-pass native AdamW against fp32 gradients, interleaved, and baselines
      common=(--model qwen2_5_3b --micro-batch 8 --accumulate 1 --seq-len 2048 --warmup 2 --out "$out")
      mt=(--strategies megatrain --keep 32 --cache 36 --loss-chunk 4096)
      python recipes/benchmark_host_adam.py --params 256e6 --repeats 3
      bench "${common[@]}" --steps 8 "${mt[@]}" --bf16-grads
      bench "${common[@]}" --steps 8 "${mt[@]}" --fp32-grads
      bench "${common[@]}" --steps 6 --strategies single_device
      if python -c "import deepspeed" 2>/dev/null; then
        bench "${common[@]}" --strategies deepspeed_zero3_offload --steps 4
      fi
      bench "${common[@]}" --steps 8 "${mt[@]}" --bf16-grads
      bench "${common[@]}" --steps 8 "${mt[@]}" --fp32-grads ;;
    7b_split)  # split_embedding_update against the default, side by side (not yet measured)
      for flag in --split-embedding ""; do
        bench --model qwen2_5_7b --strategies megatrain --micro-batch 16 --accumulate 1 --steps 20 --warmup 2 \
          --slots 3 --keep 24 --kept-saves matmuls --cache 28 --loss-chunk 4096 --grad-buffers 4 $flag --out "$out"
      done ;;
    compact14b_full)  # all 48 blocks (14.77 B params): planner 131.8 GB of the ~133 GB free (not yet run)
      bench --model qwen2_5_14b --strategies megatrain --host-state compact --micro-batch 8 \
        --accumulate 1 --steps 20 --warmup 1 --keep 4 --cache 48 --loss-chunk 4096 --timeout 570 --out "$out-compact" ;;
    compact14b)
      bench --model qwen2_5_14b --layers 46 --strategies megatrain --host-state compact --micro-batch 8 \
        --accumulate 1 --steps 20 --warmup 1 --keep 4 --cache 46 --loss-chunk 4096 --timeout 570 --out "$out-compact" ;;
    *)
      echo "unknown part: $part (tests native 3b 3b_bf16 profile3b 7b 7b_split depth 14b compact14b compact14b_full)" >&2; exit 2 ;;
  esac
done
