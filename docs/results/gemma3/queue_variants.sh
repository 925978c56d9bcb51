#!/bin/bash
# issue 27, the runs left (2026-11-27; variants updated in session 4 to the presets as they ship: ada_quest every
# token with sticky blocks, ada_snapkv's 768 candidates refreshed every 16 steps, 256 picks from quest.yaml;
# the 8K needle of ada_quest pinned to 128 picks, as the other 8K runs had): Gemma 3 pass keys and needles at
# 8K/16K/30K, 10 trials a length (depths
# 0.1..0.9 x 2), one prefill a store: quest's store answers quest, ada_quest and ada_snapkv too (--variant: the
# shipped presets' decode knobs on quest's store, which is how they ship). Writes /tmp/q27/; a run whose JSON is
# there is skipped; copy the finished ones to docs/results/gemma3/. OUT= another folder (session 7: one in the
# working tree, so that a session's end does not lose the partial runs).
cd /work/main
OUT=${OUT:-/tmp/q27}; mkdir -p $OUT
while pgrep -f "tools/eval_longctx.py|tools/fidelity.py" > /dev/null; do sleep 10; done
V="--variant ada_quest:ada_budget=true --variant ada_snapkv:preselect_block=true,preselect_block_count=768,ada_budget=true,preselect_refresh=16"
run() { # task length name args...
  out=$OUT/${1}_${2}_${3}; t=$1 l=$2; shift 3
  [ -f $out.json ] && return
  python tools/eval_longctx.py --model gemma3-270m --task $t --lengths $l --depths 0.1,0.3,0.5,0.7,0.9 --trials 2 \
    "$@" --seed 0 --threads 2 --quiet --verbose --resume --set sliding_window_keep=32768 --json $out.json >> $out.log 2>&1
}
store() { # task length: every store at that length
  run $1 $2 dense --configs dense
  run $1 $2 quest_variants --configs configs/quest.yaml $V
  run $1 $2 ktransformers --configs configs/ktransformers.yaml
  run $1 $2 snapkv --configs configs/snapkv.yaml
  run $1 $2 quest_sp --configs docs/results/quest_sparse_prefill.yaml
}
store needle 16384; store passkey 16384
run needle 8192 ada_quest --configs configs/ada_quest.yaml --set long_context.second_select_num=128
store passkey 30720; store needle 30720
echo QUEUE DONE
