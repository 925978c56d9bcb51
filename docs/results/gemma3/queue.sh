#!/bin/bash
# (kept as run on 2026-11-26: it wrote to /tmp/q27/, the finished runs were copied to docs/results/gemma3/)
# issue 27 (+ issue 28's sparse prefill on gemma3): passkey/needle at 8K/16K/30K, 10 trials (depths 0.1..0.9 x 2)
cd /work/main
while pgrep -f "tools/eval_longctx.py" > /dev/null; do sleep 10; done
run() { # task length name
  out=/tmp/q27/${1}_${2}_${3}
  [ -f $out.json ] && return
  case $3 in dense) cfg=dense;; quest_sp) cfg=docs/results/quest_sparse_prefill.yaml;; *) cfg=configs/$3.yaml;; esac
  python tools/eval_longctx.py --model gemma3-270m --task $1 --lengths $2 --depths 0.1,0.3,0.5,0.7,0.9 --trials 2 \
    --configs $cfg --seed 0 --threads 2 --quiet --verbose --set sliding_window_keep=32768 --json $out.json > $out.log 2>&1
}
ALL="dense quest quest_sp ktransformers snapkv ada_snapkv ada_quest"
run passkey 8192 ktransformers; run passkey 8192 quest_sp
for c in $ALL; do run needle 8192 $c; done
for c in ktransformers ada_snapkv ada_quest quest_sp; do run passkey 16384 $c; done
for c in $ALL; do run needle 16384 $c; done
for t in passkey needle; do for c in $ALL; do run $t 30720 $c; done; done
echo QUEUE DONE
