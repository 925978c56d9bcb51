#!/bin/bash
# issue 31: sticky blocks for the presets, decided on the tuning fillers (classic, code) at 8K, seed 0
cd /work/main
common="--task passkey --lengths 8192 --depths 0.2,0.4,0.6,0.8 --trials 2 --fillers tuning --seed 0 --threads 2 --quiet --verbose"
run() { # name, args...
  name=$1; shift
  [ -f /tmp/q31/$name.json ] && return
  python tools/eval_longctx.py $common "$@" --json /tmp/q31/$name.json > /tmp/q31/$name.log 2>&1
}
run tuning_8k_quest --configs configs/quest.yaml \
  --variant sticky4:sticky_blocks=4 \
  --variant ada_quest:ada_budget=true,token_step=2 \
  --variant ada_quest_sticky4:ada_budget=true,sticky_blocks=4 \
  --variant ada_snapkv:preselect_block=true,preselect_block_count=384,ada_budget=true \
  --variant ada_snapkv_sticky4:preselect_block=true,preselect_block_count=384,ada_budget=true,sticky_blocks=4
run tuning_8k_ktransformers --configs configs/ktransformers.yaml --variant sticky4:sticky_blocks=4
run tuning_8k_snapkv --configs configs/snapkv.yaml --variant sticky4:sticky_blocks=4
run tuning_8k_dense --configs dense
