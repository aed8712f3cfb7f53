#!/bin/bash
# session 25, call 2 (carry .whl; BUDGET seconds in all): whether experts go without tokens in a run that learns, and
# what the router loss's recorded outputs cost at GPU size (recipes/moe_router_loss.py, MegaTrainStrategy's defaults,
# bf16-mixed): GPT-OSS-20B-wide (hidden 2880, 32 experts top-4) and Qwen3-30B-A3B-wide (hidden 2048, 128 experts
# top-8), 2 layers, 4 x 2048 tokens per step, addition written out as bytes (--data arithmetic), lr 1e-4, router loss
# 0.5, 30 steps; GPT-OSS again with the router loss off (--coef 0).
set -u
B=${BUDGET:-560}
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | grep -v "already exists" | tail -1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD:$PWD/recipes
nvidia-smi --query-gpu=name --format=csv,noheader; free -g | head -2
R="python3 recipes/moe_router_loss.py --accelerator cuda --precision bf16-mixed --layers 2 --micro-batch 4 --seq-len 2048 --lr 1e-4 --data arithmetic --vocab 256 --steps 30"
one() {  # name, seconds at most, args...
  local name=$1 cap=$2; shift 2; local T0=$SECONDS LEFT=$((B - SECONDS - 10))
  [ $LEFT -gt 40 ] && timeout $((LEFT < cap ? LEFT : cap)) $R "$@" > $OUT/$name.log 2>&1
  echo "$name rc=$? $((SECONDS-T0)) s"
  python3 -c "
import json,sys
o=json.loads(open(sys.argv[1]).read().strip().splitlines()[-1])['megatrain']
print('  losses', [round(x,3) for x in o['losses']][::3], 'step_s_median', round(o['step_s_median'],4))
print('  idle expert-layers per step', o['idle_experts_per_step'], 'all-zero GB', [round(b/1e9,3) for b in o['all_zero_expert_grad_bytes_per_step_fp32']][::3], 'of', round(o['block_grad_bytes_per_step_fp32']/1e9,3))" $OUT/$name.log 2>&1 | tail -3
}
one gpt_oss_coef05 150 --arch gpt_oss --hidden 2880 --experts 32 --top-k 4 --coef 0.5
one gpt_oss_coef0 120 --arch gpt_oss --hidden 2880 --experts 32 --top-k 4 --coef 0
one qwen3_coef05 150 --arch qwen3_moe --hidden 2048 --experts 128 --top-k 8 --coef 0.5
