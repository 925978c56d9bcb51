"""ktquest: long-context LLM inference with query-aware sparse attention over a paged KV store."""

import os as _os

__version__ = "0.1.0"

# torch's OpenMP runtime (libgomp) spins an idle worker for up to 300,000 pauses (milliseconds) after every
# parallel torch op. With as many threads as cores, that spinner takes a core from ktquest's own kernel
# threads (the int8 GEMM, the store's attention), which then run about a third slower (a long_context
# prefill on 2 cores: 300 -> 420 tok/s with 10,000). 10,000 pauses (~0.1-0.2 ms) still carry back-to-back
# torch ops. libgomp reads it once, when torch loads: so it holds where ktquest is imported before torch
# (the CLI, the server, tools/); an explicit GOMP_SPINCOUNT or OMP_WAIT_POLICY wins.
if "GOMP_SPINCOUNT" not in _os.environ and "OMP_WAIT_POLICY" not in _os.environ:
    _os.environ["GOMP_SPINCOUNT"] = "10000"


def load(model=None, config=None, **overrides):
    """Load a GGUF model (a path or a bundled model's name) into an ``Engine`` (see ``ktquest.engine.load``);
    None = the bundled smollm2-135m."""
    from ktquest.engine import load as _load  # torch and the model code load on first use only

    return _load(model, config, **overrides)
