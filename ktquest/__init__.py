"""ktquest: long-context LLM inference with query-aware sparse attention over a paged KV store."""

__version__ = "0.1.0"
