"""ktquest: long-context LLM inference with query-aware sparse attention over a paged KV store."""

from ktquest.formats.errors import GGUFError as GGUFError  # every model that cannot load (numpy-free)

__version__ = "0.1.0"

OPENMP_SPIN = "10000"  # GOMP_SPINCOUNT set by set_openmp_spin


def set_openmp_spin() -> bool:
    """Shorten the spin of torch's idle OpenMP workers to OPENMP_SPIN pauses (~0.1-0.2 ms), in a process that
    is ktquest's own: the CLI and the server call it, and tools/bench_decode.py with no llama.cpp beside.

    libgomp's default lets an idle worker spin for 300,000 pauses (~3 ms) after every parallel torch op. With
    as many threads as cores, that spinner takes a core from ktquest's own kernel threads (the int8 GEMM, the
    store's attention), which then run about a third slower: million.yaml's prefill on 2 cores read 300
    tok/s, 420 with the short spin. A short spin still carries back-to-back torch ops (OMP_WAIT_POLICY=PASSIVE,
    which sleeps at once, read 301-311 -> 350-358 tok/s there, and looked 3-9% slower on torch-heavy exact
    prefill). Not on import: the runtime is shared with any other OpenMP library in a process (llama.cpp's
    decode ran 30% slower under PASSIVE). libgomp reads the variable when torch loads, so this does nothing
    once torch is imported, nor over a user's GOMP_SPINCOUNT or OMP_WAIT_POLICY (libgomp lets an explicit
    spin count override the policy). Returns whether it set it."""
    import os
    import sys

    if "torch" in sys.modules or "GOMP_SPINCOUNT" in os.environ or "OMP_WAIT_POLICY" in os.environ:
        return False
    os.environ["GOMP_SPINCOUNT"] = OPENMP_SPIN
    return True


def load(model=None, config=None, **overrides):
    """Load a GGUF model (a path or a bundled model's name) into an ``Engine`` (see ``ktquest.engine.load``);
    None = the bundled smollm2-135m."""
    from ktquest.engine import load as _load  # torch and the model code load on first use only

    return _load(model, config, **overrides)
