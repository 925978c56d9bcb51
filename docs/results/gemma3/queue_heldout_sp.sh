#!/bin/bash
# Issue 28 on the host (2026-11-27, session 8, no device lent): Gemma 3's sparse prefill against the same store
# read exactly, on the held-out pass keys of seed 3 (the prose filler, 8 prompts a run), 30K then 16K. The same
# commands as device_queue.sh's JOBSET=rest (quest_sp / quest_xp; both runs' JSON name the config
# quest_sparse_prefill, the file name tells them apart), here in chunk order on the CPU, prompts sharing their
# filler. The prose filler is read from the machine's files (pydoc_data, the licences), so these prompts are not
# the lent H200's: compare sp with xp of this script, not with the H200's runs. Before each run it waits until no
# other evaluation or queue_variants.sh runs; a run whose JSON is in $OUT is skipped, a killed one resumes.
cd /work/main || exit 1
OUT=${OUT:-docs/results/gemma3/host}; mkdir -p $OUT
SP=docs/results/quest_sparse_prefill.yaml
for L in 30720 16384; do
  for m in sp xp; do
    out=$OUT/gemma_heldout_seed3_${L}_quest_${m}_prose
    [ -f $out.json ] && continue
    while pgrep -f "queue_variants[.]sh|tools/eval_longctx[.]py|tools/fidelity[.]py" > /dev/null; do sleep 20; done
    x=""; [ $m = xp ] && x="--set prefill.mode=exact"
    # shellcheck disable=SC2086
    python tools/eval_longctx.py --model gemma3-270m --task passkey --lengths $L --depths 0.2,0.4,0.6,0.8 \
      --trials 2 --fillers prose --seed 3 --configs $SP $x --threads 2 --quiet --verbose --resume \
      --set sliding_window_keep=32768 --json $out.json >> $out.log 2>&1
    echo "$out: rc $? at $(date -u +%H:%M:%S)"
  done
done
echo HELDOUT DONE
