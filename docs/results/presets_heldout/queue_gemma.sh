#!/bin/bash
# Issue 31 on Gemma 3 270M (its real 32K context): held-out pass keys of seed 3 (prose, narrative, json x depths
# 0.2-0.8 x 2 = 24 prompts a length, completion style: a base model) at 8K, 16K and 30K for dense and every preset
# as shipped (2,048 tokens of blocks a KV head on the global layers). quest's store answers quest, ada_quest and
# ada_snapkv (their decode knobs as variants). Hours on 2 cores: 8K ~40 min, 16K ~1.5 h, 30K ~3.5 h.
# Writes /tmp/q31g/; a run whose JSON is there is skipped; copy the finished ones here. LENGTHS="8192" runs one length, STORES="quest snapkv" those stores in that order.
cd /work/main
while pgrep -f "tools/eval_longctx.py|tools/fidelity.py|tools/bench_decode.py" > /dev/null; do sleep 10; done
O=/tmp/q31g; mkdir -p $O
run() { # name, length, args...
  name=$1; L=$2; shift 2
  [ -f $O/$name.json ] && return
  python tools/eval_longctx.py --model gemma3-270m --task passkey --lengths $L --depths 0.2,0.4,0.6,0.8 --trials 2 \
    --fillers held-out --seed 3 --threads 2 --quiet --verbose --resume --set sliding_window_keep=32768 "$@" \
    --json $O/$name.json >> $O/$name.log 2>&1
}
V="--variant ada_quest:ada_budget=true --variant ada_snapkv:preselect_block=true,preselect_block_count=768,ada_budget=true,preselect_refresh=16"
store() { # length, store: one run (quest's answers ada_quest and ada_snapkv too)
  case $2 in
    dense) run gemma_heldout_seed3_$1_dense $1 --configs dense ;;
    quest) run gemma_heldout_seed3_$1_quest $1 --configs configs/quest.yaml $V ;;
    *) run gemma_heldout_seed3_$1_$2 $1 --configs configs/$2.yaml ;;
  esac
}
for L in ${LENGTHS:-8192 16384 30720}; do
  for S in ${STORES:-dense quest ktransformers snapkv}; do store $L $S; done
done
echo QUEUE_GEMMA DONE
