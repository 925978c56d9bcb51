"""ktquest: long-context LLM inference with query-aware sparse attention over a paged KV store."""

import os as _os
import sys as _sys

__version__ = "0.1.0"

# ktquest's kernels run on its own thread pool between torch ops. By default torch's idle OpenMP threads spin
# for a while after each op, on the very cores the pool's workers then need: the shaped 1.5B model's prefill
# lost 10% to it (perf: libgomp). Passive threads sleep at once. libgomp reads this when torch loads, so it
# holds only when ktquest is imported first (the CLI, the server); a user's own setting stands.
if "torch" not in _sys.modules:
    _os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def load(model=None, config=None, **overrides):
    """Load a GGUF model into an ``Engine`` (see ``ktquest.engine.load``); None = the bundled SmolLM2."""
    from ktquest.engine import load as _load  # torch and the model code load on first use only

    return _load(model, config, **overrides)
