#!/bin/bash
# session 33 (carry .whl; BUDGET seconds in all): session 29's call (issue 18 on the H200: GPT-OSS-20B cut to 7
# layers and Qwen3-30B-A3B cut to 10 at the picks that model routed experts, with the host AdamW's busy time) given
# 400 s, then, BUDGET left, the cuda-marked tests (not run on the engine changes of sessions 31-33).
set -u
B=${BUDGET:-575}
BUDGET=$((B < 400 ? B : 400)) bash recipes/results/2026-12-06-session29-call-logs/call.sh
export PYTHONPATH=/tmp/site:$PWD
LEFT=$((B - SECONDS - 10)); [ $LEFT -gt 60 ] && { timeout $LEFT python3 -m pytest -q -p no:cacheprovider -m cuda -rfE --durations=8 tests/test_parity_cuda.py tests/test_compiled_blocks_cuda.py tests/test_head_loss_cuda.py tests/test_long_context_cuda.py tests/test_sink_attention.py > $OUT/cuda_tests.log 2>&1; echo "cuda tests rc=$?"; grep -h "^FAILED\|^ERROR\|passed\|failed" $OUT/cuda_tests.log | cut -c1-300 | tail -12; }
