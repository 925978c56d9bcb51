#!/bin/bash
# Issue 31 on Gemma 3 270M: top-1 agreement with dense on held-out code (the library's sub-packages) and prose at
# 8K for every preset as shipped (2,048 tokens of blocks a KV head on the 3 global layers), queue7.sh's commands
# with --model gemma3-270m. quest's prompt answers quest, ada_quest and ada_snapkv (their decode knobs as
# variants). Waits until no evaluation runs; writes /tmp/q31f/; a run whose JSON is there is skipped.
cd /work/main
while pgrep -f "tools/eval_longctx.py|tools/fidelity.py|tools/bench_decode.py" > /dev/null; do sleep 10; done
O=/tmp/q31f; mkdir -p $O
run() { # name, args...
  name=$1; shift
  [ -f $O/$name.json ] && return
  python tools/fidelity.py --model gemma3-270m --length 8192 --positions 256 --budget 2048 --threads 2 "$@" \
    --json $O/$name.json > $O/$name.log 2>&1
}
V="--variant ada_quest:ada_budget=true --variant ada_snapkv:preselect_block=true,preselect_block_count=768,ada_budget=true,preselect_refresh=16"
for text in packages prose; do
  run gemma_fidelity_8k_${text}_k256_quest --text $text --configs configs/quest.yaml $V
  run gemma_fidelity_8k_${text}_k256_ktransformers --text $text --configs configs/ktransformers.yaml
  run gemma_fidelity_8k_${text}_k256_snapkv --text $text --configs configs/snapkv.yaml
done
echo QUEUE_GEMMA_FIDELITY DONE
