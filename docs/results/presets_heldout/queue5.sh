#!/bin/bash
# 2026-11-27 (session 4), after queue4.sh: fidelity on the tuning text at 8K at 1,024 / 1,536 / 2,048 tokens
# of blocks a KV head, each store's presets (the budget decided on the tuning fillers and text only).
cd /work/main
while pgrep -f "presets_heldout/queue4.sh" > /dev/null; do sleep 10; done
O=/tmp/q31c
F="--length 8192 --positions 256 --budget 1024 --threads 2"
run() { # name, args...
  name=$1; shift
  [ -f $O/$name.json ] && return
  python tools/fidelity.py "$@" --json $O/$name.json > $O/$name.log 2>&1
}
AS=preselect_block=true,ada_budget=true,preselect_refresh=16
run fidelity_8k_tuning_quest_budget $F --configs configs/quest.yaml \
  --variant q_k192:second_select_num=192 --variant q_k256:second_select_num=256 \
  --variant aq:ada_budget=true --variant aq_k192:ada_budget=true,second_select_num=192 --variant aq_k256:ada_budget=true,second_select_num=256 \
  --variant as:$AS,preselect_block_count=384 --variant as_k192:$AS,preselect_block_count=576,second_select_num=192 \
  --variant as_k256:$AS,preselect_block_count=768,second_select_num=256
run fidelity_8k_tuning_kt_budget $F --configs configs/ktransformers.yaml \
  --variant k192:second_select_num=192,preselect_block_count=768 --variant k256:second_select_num=256,preselect_block_count=1024
run fidelity_8k_tuning_snapkv_budget $F --configs configs/snapkv.yaml \
  --variant k192:second_select_num=192,preselect_block_count=576 --variant k256:second_select_num=256,preselect_block_count=768
echo QUEUE5 DONE
