#!/bin/bash
# 2026-11-27, after Ada-KV budgets moved into the store's selection: the Ada-KV variants on the tuning
# fillers and texts (to decide the presets), held-out code, then held-out pass keys of a new seed (2) for
# every preset as it ships when its run starts (preset runs wait for /tmp/q31b/GO: the presets decided).
cd /work/main
while pgrep -f "presets_heldout/queue2.sh" > /dev/null; do sleep 10; done
O=/tmp/q31b
T="--task passkey --lengths 8192 --depths 0.2,0.4,0.6,0.8 --trials 2 --fillers tuning --seed 0 --threads 2 --quiet --verbose"
H="--task passkey --lengths 2048,4096,8192 --depths 0.2,0.4,0.6,0.8 --trials 2 --fillers held-out --seed 2 --threads 2 --quiet --verbose"
F="--length 8192 --positions 256 --budget 1024 --threads 2"
run() { # name, tool, args...
  name=$1; tool=$2; shift 2
  [ -f $O/$name.json ] && return
  python tools/$tool "$@" --json $O/$name.json > $O/$name.log 2>&1
}
ADA_Q="--variant ada_quest_ts1_sticky4:ada_budget=true --variant ada_quest_ts2:ada_budget=true,token_step=2,sticky_blocks=0"
run tuning_8k_kt_snapkv_ada eval_longctx.py $T --configs configs/ktransformers.yaml,configs/snapkv.yaml --variant ada:ada_budget=true
run fidelity_8k_tuning_ada fidelity.py $F --configs configs/quest.yaml $ADA_Q
run fidelity_8k_tuning_kt_snapkv_ada fidelity.py $F --configs configs/ktransformers.yaml,configs/snapkv.yaml --variant ada:ada_budget=true
run fidelity_8k_packages_ada fidelity.py $F --text packages --configs configs/quest.yaml $ADA_Q
run fidelity_8k_packages_kt_snapkv_ada fidelity.py $F --text packages --configs configs/ktransformers.yaml,configs/snapkv.yaml --variant ada:ada_budget=true
run heldout_seed2_dense eval_longctx.py $H --configs dense
[ -f $O/GO ] || { echo "waiting for $O/GO (the presets decided)"; while [ ! -f $O/GO ]; do sleep 10; done; }
run heldout_seed2_quest eval_longctx.py $H --configs configs/quest.yaml \
  --variant ada_quest:$(cat $O/ada_quest.knobs) --variant ada_snapkv:$(cat $O/ada_snapkv.knobs)
run heldout_seed2_ktransformers eval_longctx.py $H --configs configs/ktransformers.yaml
run heldout_seed2_snapkv eval_longctx.py $H --configs configs/snapkv.yaml
echo QUEUE3 DONE
