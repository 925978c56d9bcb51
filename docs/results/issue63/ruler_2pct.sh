#!/bin/bash
# Issue 63: RULER at a 2% budget on Gemma 3 270M at 32K: dense, quest.yaml at 82 blocks of 8 a KV head (656 tokens,
# 2% of 32,768) in all 3 global layers (dense_layer_num 0: quest.yaml's 2 dense layers would be 2 of the 3 layers
# in the store) with the anchors alone, and with the store's second stage by attention mass (long_context.rerank
# 4 and 8: --variant, one prefill answers all three). 20 samples a task; a run whose JSON exists is skipped, a
# killed one resumes (--resume). The outputs live beside this script (runs/), so they survive between sessions.
# Usage: [TASKS="niah_single_2 ..."] [THREADS=2] bash docs/results/issue63/ruler_2pct.sh
cd "$(dirname "$0")/../../.."
MODEL=gemma3-270m; LENGTH=32768; THREADS=${THREADS:-2}; TRIALS=${TRIALS:-20}
OUT=docs/results/issue63/runs/${MODEL}_${LENGTH}; mkdir -p "$OUT"
TASKS=${TASKS:-"niah_single_1 niah_multikey_1 niah_single_2 niah_multikey_2 niah_multivalue niah_multiquery vt niah_single_3 niah_multikey_3 cwe fwe"}
run() { # task name args...
  local out=$OUT/${1}_${2} t=$1; shift 2
  [ -f "$out.json" ] && return
  python tools/eval_longctx.py --model "$MODEL" --task "$t" --lengths "$LENGTH" --trials "$TRIALS" "$@" --seed 0 \
    --threads "$THREADS" --quiet --verbose --resume --set sliding_window_keep=$LENGTH --json "$out.json" >> "$out.log" 2>&1
}
for t in $TASKS; do
  run "$t" dense --configs dense
  run "$t" quest_2pct --configs configs/quest.yaml --set long_context.second_select_num=82 --set long_context.dense_layer_num=0 \
    --variant rerank4:rerank=4 --variant rerank8:rerank=8
done
echo "QUEUE DONE 2pct"
