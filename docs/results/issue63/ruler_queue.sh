#!/bin/bash
# Issue 63: RULER's 11 synthetic tasks, 20 samples a task and length, dense and every preset, one run per
# (model, length, task, store). One prefill a store: quest's store answers quest, ada_quest and ada_snapkv
# (--variant: their shipped decode knobs; the three presets share block size, windows and store type).
# A run whose JSON exists is skipped and a killed run resumes (--resume), so the queue can be stopped at any time
# and started again; the outputs live beside this script (runs/), so they survive between sessions.
# Usage: MODEL=smollm2-135m LENGTH=4096 [OUT=docs/results/issue63/runs] [THREADS=2] bash ruler_queue.sh
cd "$(dirname "$0")/../../.."
MODEL=${MODEL:-smollm2-135m}; LENGTH=${LENGTH:-4096}; THREADS=${THREADS:-2}; TRIALS=${TRIALS:-20}
OUT=${OUT:-docs/results/issue63/runs}/${MODEL}_${LENGTH}; mkdir -p "$OUT"
TASKS=${TASKS:-"niah_single_1 niah_single_2 niah_single_3 niah_multikey_1 niah_multikey_2 niah_multikey_3 niah_multivalue niah_multiquery vt cwe fwe"}
V="--variant ada_quest:ada_budget=true --variant ada_snapkv:preselect_block=true,preselect_block_count=768,ada_budget=true,preselect_refresh=16"
EXTRA=""; [ "$MODEL" = gemma3-270m ] && EXTRA="--set sliding_window_keep=$LENGTH"
run() { # task name args...
  local out=$OUT/${1}_${2} t=$1; shift 2
  [ -f "$out.json" ] && return
  python tools/eval_longctx.py --model "$MODEL" --task "$t" --lengths "$LENGTH" --trials "$TRIALS" "$@" --seed 0 \
    --threads "$THREADS" --quiet --verbose --resume $EXTRA --json "$out.json" >> "$out.log" 2>&1
}
for t in $TASKS; do
  run "$t" dense --configs dense
  run "$t" quest_variants --configs configs/quest.yaml $V
  run "$t" ktransformers --configs configs/ktransformers.yaml
  run "$t" snapkv --configs configs/snapkv.yaml
  run "$t" million --configs configs/million.yaml
done
echo "QUEUE DONE $MODEL $LENGTH"
