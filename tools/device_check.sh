#!/usr/bin/env bash
# The checks that need a GPU, as one script for a lent machine (a Python with CUDA torch, no network), in under
# 10 minutes: the CUDA tests (the device decode step against the CPU's, graphs across buckets, a rewind and a KV
# file load; layer-major prefill), then decode on models of Qwen2.5-1.5B's and Qwen2.5-7B's shapes (Q4_K_M,
# written there by make_shaped_gguf.py while the tests run) with the device step beside the forward pass it
# replaces, prefill of the same prompts, and the time split of a token (tools/bench_device_decode.py).
# JSON and the tests' log go to $OUT (default tools/out); the benchmarks print to stdout.
#
# It needs, in .whl/ (carried): the extension built for the machine's Python (a ktquest wheel: only its
# _C*.so is taken, the sources are the working tree's; `python3.12 -m pip wheel --no-deps -w .whl .`), the gguf
# and llguidance wheels, and tiny.gguf (any GGUF with the tokenizer to copy, e.g.
# `python tools/make_shaped_gguf.py --shape tiny --out .whl/tiny.gguf`).
#
#   bash tools/device_check.sh [tests|decode|prefill|int8|all] [bench args]   (all: tests and decode)
set -u -o pipefail
status=0
what=${1:-all}
shift || true
OUT=${OUT:-tools/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/gguf-*.whl \
    .whl/llguidance-*.whl || exit 1
python3 - <<'EOF' || exit 1
import glob, zipfile
whl = glob.glob(".whl/ktquest-*.whl")[0]
with zipfile.ZipFile(whl) as z:
    for name in z.namelist():
        if name.startswith("ktquest/_C") and name.endswith(".so"):
            open(name, "wb").write(z.read(name))
            print("extension:", name)
EOF
export PYTHONPATH=$PWD:/tmp/site
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv,noheader
python3 -c "import torch, ktquest._C; print('torch', torch.__version__, torch.cuda.get_device_name(), 'CUDA', torch.version.cuda)"
nproc

shaped() {  # the models, written on the CPU while the tests run
    [ -f /tmp/q15.gguf ] || python3 tools/make_shaped_gguf.py --shape qwen2.5-1.5b --tokenizer .whl/tiny.gguf \
        --out /tmp/q15.gguf > "$OUT/make_gguf.log" 2>&1
    [ "$what" = prefill ] || [ -f /tmp/q7.gguf ] || python3 tools/make_shaped_gguf.py --shape qwen2.5-7b \
        --tokenizer .whl/tiny.gguf --out /tmp/q7.gguf >> "$OUT/make_gguf.log" 2>&1
}
if [ "$what" = all ] || [ "$what" = decode ] || [ "$what" = prefill ]; then shaped & fi
if [ "$what" = tests ] || [ "$what" = all ]; then
    timeout 100 python3 -m pytest -q -p no:cacheprovider tests/test_device_step.py tests/test_cuda.py \
        tests/test_layer_prefill.py "tests/test_long_context.py::test_device_kv_bytes_do_not_grow_with_the_prompt" \
        2>&1 | tee "$OUT/pytest_cuda.log" | tail -30 || status=1
fi
if [ "$what" = decode ] || [ "$what" = all ]; then
    for _ in $(seq 90); do  # (at most 3 minutes: a failed write leaves no file, and its log says why)
        [ -f /tmp/q15.gguf ] && ! pgrep -f "out /tmp/q15.gguf" > /dev/null && break
        sleep 2
    done
    timeout 90 python3 tools/bench_device_decode.py --model /tmp/q15.gguf --contexts 8192,32768,131072 \
        --configs quest --json "$OUT/bench_device_decode_1.5b.json" "$@" 2>&1 || status=1
    timeout 140 python3 tools/bench_device_decode.py --model /tmp/q15.gguf --contexts 8192,32768,131072,262144 \
        --configs million --json "$OUT/bench_device_decode_1.5b_million.json" "$@" 2>&1 || status=1
    wait
    tail -2 "$OUT/make_gguf.log"
    timeout 180 python3 tools/bench_device_decode.py --model /tmp/q7.gguf --contexts 32768,131072 \
        --configs quest,million --json "$OUT/bench_device_decode_7b.json" "$@" 2>&1 || status=1
    timeout 60 python3 tools/bench_device_decode.py --model /tmp/q15.gguf --contexts 32768 --configs million \
        --steps torch,device --set weights=int8 --json "$OUT/bench_device_decode_1.5b_int8.json" "$@" 2>&1 || status=1
fi
if [ "$what" = int8 ]; then
    timeout 60 python3 tools/bench_int8_weights.py --json "$OUT/bench_int8_weights.json" || status=1
fi
if [ "$what" = prefill ]; then
    wait
    timeout 300 python3 tools/bench_device_prefill.py --model /tmp/q15.gguf --json "$OUT/bench_device_prefill.json" \
        "$@" 2>&1 | tee "$OUT/bench_device_prefill.log" || status=1
fi
exit $status
