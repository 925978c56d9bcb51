#!/usr/bin/env bash
# The native operators under AddressSanitizer + UndefinedBehaviorSanitizer: builds ktquest._C with
# -DKTQ_SANITIZE=ON in its own build folder (the installed module is left alone), copies the Python package
# beside it, and runs the operator and store tests against that copy with libasan preloaded (Python is not
# instrumented). Any ASan or UBSan report aborts the test process and fails the run.
#   PYTHON=.venv/bin/python bash tools/sanitize.sh            # the operator and store tests (a few minutes)
#   PYTHON=... bash tools/sanitize.sh -k fuzz                  # extra arguments go to pytest
# Needs g++ with libasan/libubsan (Debian: g++), and the project's build and test dependencies in $PYTHON.
# Not part of pytest's default run (the instrumented module is several times slower); .ci/run runs it.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=${PYTHON:-python3}
OUT=${KTQ_SANITIZE_DIR:-$ROOT/build/sanitize}
export PATH="$(dirname "$("$PY" -c 'import sys; print(sys.executable)')"):$PATH"  # the venv's cmake and ninja
CXX=${CXX:-g++}
for lib in libasan.so libubsan.so libstdc++.so; do  # (-print-file-name echoes a name it does not find)
  [[ -f "$($CXX -print-file-name=$lib)" ]] ||
    { echo "sanitize.sh: $CXX has no $lib: install g++ with its sanitizers (Debian: apt-get install g++)" >&2; exit 1; }
done

# 1. The instrumented module.
mkdir -p "$OUT"  # (a clean clone has no build/ before pip installs)
cmake -S "$ROOT" -B "$OUT/build" -G Ninja -DKTQ_SANITIZE=ON -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DPython_EXECUTABLE="$("$PY" -c 'import sys; print(sys.executable)')" \
  -Dpybind11_DIR="$("$PY" -m pybind11 --cmakedir)" > "$OUT.cmake.log"
cmake --build "$OUT/build" -j "${JOBS:-2}"

# 2. The package with it: a copy of ktquest/ and the module, found first on PYTHONPATH. `python -S` skips the
#    site hooks, so an editable install's finder cannot hand out the uninstrumented module; site-packages
#    comes back through PYTHONPATH for the dependencies.
rm -rf "$OUT/pkg" && mkdir -p "$OUT/pkg"
cp -r "$ROOT/ktquest" "$OUT/pkg/"
rm -f "$OUT/pkg/ktquest/"_C*.so
cp "$OUT/build/"_C*.so "$OUT/pkg/ktquest/"
SITE=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')

# 3. The tests, libasan first in the process and libstdc++ with it (python does not link it: ASan's __cxa_throw
#    interceptor needs it at start-up). Leak checks are off (the interpreter's own allocations). pytest captures
#    sys.stderr only, so a report reaches the terminal before the process aborts.
export LD_PRELOAD="$($CXX -print-file-name=libasan.so) $($CXX -print-file-name=libstdc++.so)"
export ASAN_OPTIONS="detect_leaks=0:abort_on_error=1:halt_on_error=1:strict_string_checks=1:detect_stack_use_after_return=1"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1"
export PYTHONPATH="$OUT/pkg:$SITE"
TESTS=()
for t in test_kv_store test_dense_attention test_sparse_attention test_selection test_index test_quant_matrix test_gemv_quant \
         test_native_decode test_fuzz_native test_snapkv_native test_delta_rule test_gemm_grouped; do TESTS+=("$ROOT/tests/$t.py"); done
cd "$OUT/pkg"
"$PY" -S -c 'import ktquest._C as c, sys; assert "/build/" in c.__file__ or "sanitize" in c.__file__, c.__file__' \
  || { echo "sanitize.sh: ktquest._C is not the instrumented module" >&2; exit 1; }
exec "$PY" -S -m pytest -c "$ROOT/pyproject.toml" --rootdir "$ROOT" -p no:cacheprovider -q --capture=sys \
  "${TESTS[@]}" "$@"
