"""``GGUFError``, the one error of a model that cannot be loaded. Apart from ``gguf.py`` so that the command line
and ``bundled.py`` raise and catch it without loading numpy."""

from __future__ import annotations


class GGUFError(ValueError):
    """A model that cannot be loaded from its file: no such file (nor a bundled model's name), a directory, a
    FIFO or a device, a file it may not read, not GGUF, truncated or corrupt, metadata of the wrong type or out
    of range, an unsupported architecture or tokenizer, a chat template that does not compile, a missing
    tensor, one of the wrong shape or not finite. The message names the file and the problem (one line).
    ``except ktquest.GGUFError`` catches them all (``BundledModelNotFound`` is one too)."""
