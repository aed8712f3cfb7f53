#!/usr/bin/env bash
# bash recipes/model_scale_sweep.sh [hardware] [models] [steps] [strategies]
#   e.g. bash recipes/model_scale_sweep.sh h200 qwen2_5_0_5b,qwen2_5_7b,qwen2_5_14b,qwen2_5_32b 20 megatrain,single_device
#
# Throughput against model scale: one train.py multirun over models (x strategies) on synthetic
# fixed-length tokens (experiment=scale_sweep), each run in its own process, so a model that runs
# out of memory is a row in the table, not the end of the sweep. Prints the table at the end;
# it is also in <sweep dir>/sweep_results.md and .csv. Without a GPU the default is the tiny model
# (the real ones take minutes per step on a CPU).
set -euo pipefail
cd "$(dirname "$0")/.."

if python -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  default_models=qwen2_5_0_5b,qwen2_5_1_5b,qwen2_5_3b,qwen2_5_7b,qwen2_5_14b,qwen2_5_32b,qwen2_5_72b
else
  default_models=tiny
fi
hardware=${1:-auto}
models=${2:-$default_models}
steps=${3:-20}
strategies=${4:-megatrain}
sweep_dir=multirun/scale_sweep_$(date +%Y-%m-%d_%H-%M-%S)

rc=0  # 1 when no run succeeded: the table still says why
python train.py -m experiment=scale_sweep hardware="$hardware" model="$models" strategy="$strategies" \
  trainer.max_steps="$steps" hydra.sweep.dir="$sweep_dir" || rc=$?
echo
cat "$sweep_dir/sweep_results.md"
exit $rc
