#!/bin/bash
# 2026-11-27 (session 4): the budget. On seed 2's 8K misses a budget of 256 blocks answers what 128 misses
# (diagnosis only, not a choice). Decide on the tuning fillers and text at 8K: each store's presets at 128
# blocks a KV head (as shipped then), 192 and 256 (SnapKV candidates scaled with it), as variants on one
# prefill a store. Pass keys (classic + code, seed 0) on budget_yaml/*_k128.yaml, copies of the presets before
# the change; then fidelity on the tuning text, where --budget 1024 gives today's presets their 128 picks.
# (Run as two scripts that session, this one and queue5.sh; one now.) Writes /tmp/q31c/; a run whose JSON is
# there is skipped.
cd /work/main
while pgrep -f "tools/eval_longctx.py|tools/fidelity.py" > /dev/null; do sleep 10; done
O=/tmp/q31c; mkdir -p $O
B=docs/results/presets_heldout/budget_yaml
T="--task passkey --lengths 8192 --depths 0.2,0.4,0.6,0.8 --trials 2 --fillers tuning --seed 0 --threads 2 --quiet --verbose"
F="--length 8192 --positions 256 --budget 1024 --threads 2"
run() { # name, tool, args...
  name=$1; tool=$2; shift 2
  [ -f $O/$name.json ] && return
  python tools/$tool "$@" --json $O/$name.json > $O/$name.log 2>&1
}
AS=preselect_block=true,ada_budget=true,preselect_refresh=16
QV="--variant q_k192:second_select_num=192 --variant q_k256:second_select_num=256
  --variant aq:ada_budget=true --variant aq_k192:ada_budget=true,second_select_num=192
  --variant aq_k256:ada_budget=true,second_select_num=256 --variant as:$AS,preselect_block_count=384
  --variant as_k192:$AS,preselect_block_count=576,second_select_num=192
  --variant as_k256:$AS,preselect_block_count=768,second_select_num=256"
KV="--variant k192:second_select_num=192,preselect_block_count=768 --variant k256:second_select_num=256,preselect_block_count=1024"
SV="--variant k192:second_select_num=192,preselect_block_count=576 --variant k256:second_select_num=256,preselect_block_count=768"
run tuning_8k_quest_budget eval_longctx.py $T --configs $B/quest_k128.yaml $QV
run tuning_8k_kt_budget eval_longctx.py $T --configs $B/kt_k128.yaml $KV
run tuning_8k_snapkv_budget eval_longctx.py $T --configs $B/snapkv_k128.yaml $SV
run fidelity_8k_tuning_quest_budget fidelity.py $F --configs configs/quest.yaml $QV
run fidelity_8k_tuning_kt_budget fidelity.py $F --configs configs/ktransformers.yaml $KV
run fidelity_8k_tuning_snapkv_budget fidelity.py $F --configs configs/snapkv.yaml $SV
echo QUEUE4 DONE
