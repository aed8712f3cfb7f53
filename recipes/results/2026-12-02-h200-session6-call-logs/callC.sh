#!/bin/bash
# call C (2026-12-02, sixth session): the 7B CausalLM with nothing set (stacks every 120 s, in case it stalls
# again); then the full 7B at 128 K tokens, four steps (the last two timed: the overlapped host AdamW)
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | tail -1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 MACHINE=nvidia-h200
T0=$SECONDS
timeout 230 python3 .gpu/with_stacks.py 120 experiment=bench_7b hardware=auto trainer.max_steps=8 strategy.engine.slots=null strategy.engine.keep_activations=null strategy.engine.kept_saves=null strategy.engine.cache_weights=null strategy.engine.grad_buffers=null hydra.run.dir=$OUT/bench7b > $OUT/bench7b.log 2>&1; echo "bench 7b rc=$? $((SECONDS-T0)) s"
grep -E "placement|verdict|metrics|Error|error" $OUT/bench7b.log | cut -c1-700 | tail -8
grep -A14 "most recent call first" $OUT/bench7b.log | grep -v "^$" | head -40
T0=$SECONDS
LEFT=$((585 - SECONDS))
timeout $LEFT python3 recipes/bench.py --timeout $((LEFT - 8)) --out $OUT/long_context --run "experiment=long_context data=synthetic hardware=auto data.seq_len=131072 trainer.max_steps=4" > $OUT/lc128.log 2>&1; echo "128k rc=$? $((SECONDS-T0)) s"
grep -v "Warning\|warn(" $OUT/lc128.log | tail -3 | cut -c1-700; cat $OUT/long_context.md 2>/dev/null | grep "^| 20"
cp -r outputs/bench $OUT/bench_runs 2>/dev/null; cd $OUT && tar czf /tmp/all.tgz . && rm -rf $OUT/* && mv /tmp/all.tgz $OUT/callC.tgz
