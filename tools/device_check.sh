#!/usr/bin/env bash
# The checks that need a GPU, as one script for a lent machine (a Python with CUDA torch, no network):
# the CUDA tests, then prefill on the device at several lengths (tools/bench_device_prefill.py) on a model
# of Qwen2.5-1.5B's shapes written there by make_shaped_gguf.py. Logs and JSON go to $OUT (default tools/out).
#
# It needs, in .whl/ (carried): the extension built for the machine's Python (a ktquest wheel: only its
# _C*.so is taken, the sources are the working tree's), a gguf wheel, and tiny.gguf (any GGUF with the
# tokenizer to copy, e.g. `python tools/make_shaped_gguf.py --shape tiny --out .whl/tiny.gguf`).
#
#   bash tools/device_check.sh [tests|bench|all] [bench args...]
set -u -o pipefail
status=0
what=${1:-all}
shift || true
OUT=${OUT:-tools/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/gguf-*.whl \
    || exit 1
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

if [ "$what" = bench ] || [ "$what" = all ]; then  # the model, written on the CPU while the tests run
    [ -f /tmp/q15.gguf ] || python3 tools/make_shaped_gguf.py --shape qwen2.5-1.5b --tokenizer .whl/tiny.gguf \
        --out /tmp/q15.gguf > "$OUT/make_gguf.log" 2>&1 &
fi
if [ "$what" = tests ] || [ "$what" = all ]; then
    timeout 300 python3 -m pytest -q -p no:cacheprovider tests/test_cuda.py tests/test_layer_prefill.py \
        "tests/test_long_context.py::test_device_kv_bytes_do_not_grow_with_the_prompt" 2>&1 \
        | tee "$OUT/pytest_cuda.log" | tail -40 || status=1
fi
if [ "$what" = bench ] || [ "$what" = all ]; then
    wait
    tail -2 "$OUT/make_gguf.log"
    timeout 300 python3 tools/bench_device_prefill.py --model /tmp/q15.gguf --json "$OUT/bench_device_prefill.json" \
        "$@" 2>&1 | tee "$OUT/bench_device_prefill.log" || status=1
fi
exit $status
