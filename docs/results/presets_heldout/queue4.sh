#!/bin/bash
# 2026-11-27 (session 4): the budget. On seed 2's 8K misses a budget of 256 blocks answers what 128 misses
# (diagnosis only, not a choice). Decide on the tuning fillers (8K pass keys, classic + code, seed 0): each
# store's presets at 128 blocks a KV head (as shipped then: budget_yaml/*_k128.yaml, copies of the presets before
# the change), 192 and 256 (SnapKV candidates scaled with it).
cd /work/main
while pgrep -f "tools/eval_longctx.py|tools/fidelity.py" > /dev/null; do sleep 10; done
O=/tmp/q31c
T="--task passkey --lengths 8192 --depths 0.2,0.4,0.6,0.8 --trials 2 --fillers tuning --seed 0 --threads 2 --quiet --verbose"
run() { # name, args...
  name=$1; shift
  [ -f $O/$name.json ] && return
  python tools/eval_longctx.py "$@" --json $O/$name.json > $O/$name.log 2>&1
}
AS=preselect_block=true,ada_budget=true,preselect_refresh=16
run tuning_8k_quest_budget $T --configs docs/results/presets_heldout/budget_yaml/quest_k128.yaml \
  --variant q_k192:second_select_num=192 --variant q_k256:second_select_num=256 \
  --variant aq:ada_budget=true --variant aq_k192:ada_budget=true,second_select_num=192 --variant aq_k256:ada_budget=true,second_select_num=256 \
  --variant as:$AS,preselect_block_count=384 --variant as_k192:$AS,preselect_block_count=576,second_select_num=192 \
  --variant as_k256:$AS,preselect_block_count=768,second_select_num=256
run tuning_8k_kt_budget $T --configs docs/results/presets_heldout/budget_yaml/kt_k128.yaml \
  --variant k192:second_select_num=192,preselect_block_count=768 --variant k256:second_select_num=256,preselect_block_count=1024
run tuning_8k_snapkv_budget $T --configs docs/results/presets_heldout/budget_yaml/snapkv_k128.yaml \
  --variant k192:second_select_num=192,preselect_block_count=576 --variant k256:second_select_num=256,preselect_block_count=768
echo QUEUE4 DONE
