#!/usr/bin/env bash
# Issues 27, 28 and 31 on a lent GPU machine (16 cores, one GPU, a Python with CUDA torch, no network): the Gemma 3
# runs that take hours on the 2-core host (queue_variants.sh here, presets_heldout/queue_gemma.sh), each the same
# eval_longctx.py command with the model on the device (fp32, exact prefill in layer order; the sparse-prefill
# store keeps chunk order, which sparse prefill needs). Eight runs at a time, two threads each, in priority order,
# until a deadline; then every JSON and log is packed into $OUT/results.tgz (an unfinished run leaves its log and
# JSON.partial, which a later call on the same machine resumes). --fresh: every prompt is a first prompt, read on
# the GPU (a prompt after a rewind reads its past through the CPU operator on 2 threads, which made the 30K runs
# of the first lease, 2026-11-27, take over ten minutes each).
#
# It needs, carried: .whl/ (a ktquest wheel built for the machine's Python: only its _C*.so is taken, the sources
# are the working tree's; a gguf wheel) and .gm/ (the bundled Gemma GGUF, xz-compressed and split in parts that fit
# the tree's limit: `xz -T2 -6 -c FILE | split -b 59000000 - .gm/gemma.xz.`, one part a call; a warm machine keeps
# what earlier calls carried). SMOKE=1 DEVICE=cpu runs each command at 1,024 tokens, one prompt, here.
#
#   [JOBSET=rest|heldout|heldout30k] bash docs/results/gemma3/device_queue.sh [deadline seconds]
set -u -o pipefail
DEADLINE=${1:-500}
START=$(date +%s)
OUT=${OUT:-/tmp/devout}
R=${R:-/tmp/devres}
DEVICE=${DEVICE:-cuda}
MODEL=${MODEL:-/tmp/gemma-3-270m-q4_k_m.gguf}
mkdir -p "$OUT" "$R"
export PYTHONUNBUFFERED=1
if [ "$DEVICE" = cuda ]; then
    [ -d /tmp/site/gguf ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
        --target /tmp/site .whl/gguf-*.whl || exit 1
    python3 - <<'EOF' || exit 1
import glob, zipfile
with zipfile.ZipFile(glob.glob(".whl/ktquest-*.whl")[0]) as z:
    for name in z.namelist():
        if name.startswith("ktquest/_C") and name.endswith(".so"):
            open(name, "wb").write(z.read(name))
EOF
    export PYTHONPATH=$PWD:/tmp/site
    if [ ! -f "$MODEL" ]; then
        cat .gm/gemma.xz.* | xz -dc > "$MODEL.part" && mv "$MODEL.part" "$MODEL" || exit 1
    fi
    echo "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818  $MODEL" | sha256sum -c || exit 1
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    python3 -c "import torch, ktquest._C; print('torch', torch.__version__, torch.cuda.get_device_name())" || exit 1
fi
ON="--set device=$DEVICE --set dtype=float32"
LAYER="--set prefill.order=layer"
V="--variant ada_quest:ada_budget=true --variant ada_snapkv:preselect_block=true,preselect_block_count=768,ada_budget=true,preselect_refresh=16"
# name | eval_longctx.py arguments past the common ones. JOBSET: heldout (issue 31: the held-out pass keys at 16K
# and 30K, every store; the first lease's call), heldout30k (the presets' 30K ones, one filler a run; its second
# call), rest (default: what is left, issue 27's pass keys and needles at 16K and 30K, every store, and issue 28's
# sparse prefill on the held-out pass keys at 8K-30K beside the same store read exactly, one filler a run).
SP=docs/results/quest_sparse_prefill.yaml
jobs() {
    case "${JOBSET:-rest}" in
    heldout)
        for L in 30720 16384; do
            H="--task passkey --lengths $L --depths 0.2,0.4,0.6,0.8 --trials 2 --fillers held-out --seed 3 $LAYER"
            echo "gemma_heldout_seed3_${L}_dense|$H --configs dense"
            echo "gemma_heldout_seed3_${L}_quest|$H --configs configs/quest.yaml $V"
            echo "gemma_heldout_seed3_${L}_ktransformers|$H --configs configs/ktransformers.yaml"
            echo "gemma_heldout_seed3_${L}_snapkv|$H --configs configs/snapkv.yaml"
        done ;;
    heldout30k)
        for S in quest ktransformers snapkv; do
            for F in prose narrative json; do
                C="--configs configs/$S.yaml"; [ $S = quest ] && C="$C $V"
                echo "gemma_heldout_seed3_30720_${S}_$F|--task passkey --lengths 30720 --depths 0.2,0.4,0.6,0.8 --trials 2 --fillers $F --seed 3 $LAYER $C"
            done
        done ;;
    rest)
        for L in 30720 16384; do  # issues 27 and 28: pass keys and needles, seed 0 (gemma3/queue_variants.sh)
            for t in passkey needle; do
                G="--task $t --lengths $L --depths 0.1,0.3,0.5,0.7,0.9 --trials 2 --seed 0"
                echo "${t}_${L}_dense|$G $LAYER --configs dense"
                echo "${t}_${L}_quest_variants|$G $LAYER --configs configs/quest.yaml $V"
                echo "${t}_${L}_ktransformers|$G $LAYER --configs configs/ktransformers.yaml"
                echo "${t}_${L}_snapkv|$G $LAYER --configs configs/snapkv.yaml"
                echo "${t}_${L}_quest_sp|$G --configs $SP"
            done
        done
        for L in 30720 16384 8192; do  # issue 28: sparse prefill against exact on the held-out pass keys of seed 3
            for F in prose narrative json; do
                H="--task passkey --lengths $L --depths 0.2,0.4,0.6,0.8 --trials 2 --fillers $F --seed 3 --configs $SP"
                echo "gemma_heldout_seed3_${L}_quest_sp_$F|$H"
                echo "gemma_heldout_seed3_${L}_quest_xp_$F|$H --set prefill.mode=exact $LAYER"
            done
        done ;;
    *) echo "JOBSET=$JOBSET: one of heldout, heldout30k, rest" >&2; return 1 ;;
    esac
}
one() {  # name|args: one eval, skipped when its JSON is there or the deadline has passed
    name=${1%%|*} args=${1#*|}
    [ -f "$R/$name.json" ] && return 0
    left=$((DEADLINE - ($(date +%s) - START)))
    [ "$left" -gt 30 ] || return 0
    if [ "${SMOKE:-0}" = 1 ]; then
        args=$(echo "$args" | sed -E 's/--lengths [0-9]+/--lengths 1024/; s/--depths [0-9.,]+/--depths 0.5/; s/--trials 2/--trials 1/')
    fi
    # shellcheck disable=SC2086
    timeout "$left" python3 tools/eval_longctx.py --model "$MODEL" $args --threads 2 --quiet --verbose --fresh --resume \
        --set sliding_window_keep=32768 $ON --json "$R/$name.json" >> "$R/$name.log" 2>&1
    echo "$name: rc $? at $(($(date +%s) - START)) s"
}
export -f one
export R MODEL ON DEADLINE START SMOKE JOBSET
smoke() {  # SMOKE=1: one run of each kind (the 16K runs; heldout30k's first store)
    if [ "${SMOKE:-0}" != 1 ]; then cat; elif [ "${JOBSET:-rest}" = heldout30k ]; then head -n 3; else grep 16384; fi
}
jobs | smoke | xargs -P "${JOBS:-8}" -I{} bash -c 'one "$@"' _ {}
tar czf "$OUT/results.tgz" -C "$R" .
ls "$R"/*.json 2>/dev/null | wc -l
