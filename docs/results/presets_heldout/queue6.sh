#!/bin/bash
# 2026-11-27 (session 4): held-out pass keys of a new seed (3) for every preset with the 2,048-token budget,
# 8K first (where the presets fell short of dense), then 4K and 2K. quest's store answers quest, ada_quest and
# ada_snapkv (their decode knobs as variants: how they ship). Writes /tmp/q31d/; a run whose JSON is there is skipped.
cd /work/main
while pgrep -f "tools/eval_longctx.py|tools/fidelity.py|tools/bench_decode.py" > /dev/null; do sleep 10; done
O=/tmp/q31d; mkdir -p $O
run() { # name, length, args...
  name=$1; L=$2; shift 2
  [ -f $O/$name.json ] && return
  python tools/eval_longctx.py --task passkey --lengths $L --depths 0.2,0.4,0.6,0.8 --trials 2 --fillers held-out \
    --seed 3 --threads 2 --quiet --verbose "$@" --json $O/$name.json > $O/$name.log 2>&1
}
V="--variant ada_quest:ada_budget=true --variant ada_snapkv:preselect_block=true,preselect_block_count=768,ada_budget=true,preselect_refresh=16"
for L in 8192 4096 2048; do
  run heldout_seed3_${L}_dense $L --configs dense
  run heldout_seed3_${L}_quest $L --configs configs/quest.yaml $V
  run heldout_seed3_${L}_ktransformers $L --configs configs/ktransformers.yaml
  run heldout_seed3_${L}_snapkv $L --configs configs/snapkv.yaml
done
echo QUEUE6 DONE
