#!/bin/bash
# after the tuning queue: held-out pass keys, seed 1, 24 prompts a length (dense first), the fidelity runs, then
# each preset's store as the configs stand when its run starts
cd /work/main
while pgrep -f "presets_heldout/queue.sh" > /dev/null; do sleep 10; done
rm -f /tmp/q31/tuning_8k_dense.json
H="--task passkey --lengths 2048,4096,8192 --depths 0.2,0.4,0.6,0.8 --trials 2 --fillers held-out --seed 1 --threads 2 --quiet --verbose"
F="--length 8192 --positions 256 --budget 1024 --threads 2"
held() { # name, args...
  name=$1; shift
  [ -f /tmp/q31/$name.json ] && return
  python tools/eval_longctx.py $H "$@" --json /tmp/q31/$name.json > /tmp/q31/$name.log 2>&1
}
fid() { # name, args...
  name=$1; shift
  [ -f /tmp/q31/$name.json ] && return
  python tools/fidelity.py $F "$@" --json /tmp/q31/$name.json > /tmp/q31/$name.log 2>&1
}
held heldout_seed1_dense --configs dense
fid fidelity_8k_packages_kt_ada --text packages --configs configs/ktransformers.yaml --variant nosticky:sticky_blocks=0 --variant adab:ada_budget=true --variant ts2:token_step=2,sticky_blocks=0 --variant r16:preselect_refresh=16 --variant adab_r16:ada_budget=true,preselect_refresh=16
fid fidelity_8k_packages_snapkv --text packages --configs configs/snapkv.yaml --variant nosticky:sticky_blocks=0 --variant r16:preselect_refresh=16
fid fidelity_8k_packages_quest_refresh --text packages --configs configs/quest.yaml --variant ada_snapkv:preselect_block=true,preselect_block_count=384,ada_budget=true --variant ada_snapkv_r16:preselect_block=true,preselect_block_count=384,ada_budget=true,preselect_refresh=16
fid fidelity_8k_packages_refresh_r8 --text packages --configs configs/ktransformers.yaml,configs/snapkv.yaml --variant r8:preselect_refresh=8 --variant r32:preselect_refresh=32
[ -f /tmp/q31/GO ] || { echo "waiting for /tmp/q31/GO (the configs decided)"; while [ ! -f /tmp/q31/GO ]; do sleep 10; done; }
held heldout_seed1_quest --configs configs/quest.yaml --variant nosticky:sticky_blocks=0 \
  --variant ada_quest:ada_budget=true,token_step=2,sticky_blocks=0 --variant ada_quest_sticky_ts1:ada_budget=true \
  --variant ada_snapkv:preselect_block=true,preselect_block_count=384,ada_budget=true \
  --variant ada_snapkv_nosticky:preselect_block=true,preselect_block_count=384,ada_budget=true,sticky_blocks=0 \
  --variant ada_snapkv_r16:preselect_block=true,preselect_block_count=384,ada_budget=true,preselect_refresh=16 \
  --variant ada_snapkv_r8:preselect_block=true,preselect_block_count=384,ada_budget=true,preselect_refresh=8
held heldout_seed1_ktransformers --configs configs/ktransformers.yaml --variant nosticky:sticky_blocks=0 --variant r0:preselect_refresh=0
held heldout_seed1_snapkv --configs configs/snapkv.yaml --variant nosticky:sticky_blocks=0 --variant r0:preselect_refresh=0
fid fidelity_8k_prose_snapkv --text prose --configs configs/snapkv.yaml --variant nosticky:sticky_blocks=0 --variant r16:preselect_refresh=16
echo NEXT DONE
