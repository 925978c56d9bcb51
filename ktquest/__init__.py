"""ktquest: long-context LLM inference with query-aware sparse attention over a paged KV store."""

__version__ = "0.1.0"


def load(model=None, config=None, **overrides):
    """Load a GGUF model (a path or a bundled model's name) into an ``Engine`` (see ``ktquest.engine.load``);
    None = the bundled smollm2-135m."""
    from ktquest.engine import load as _load  # torch and the model code load on first use only

    return _load(model, config, **overrides)
