"""The native code's enums and constants, named once by C++ (one table each in cpp/): the config's schema and
the native facades take their names from here. No torch is imported: the config reads this before torch loads
(``ktquest.set_openmp_spin``)."""

from __future__ import annotations

from ktquest import _C

KV_TYPES: tuple[str, ...] = _C.KV_TYPES  # the store's element types
ANCHOR_TYPES: tuple[str, ...] = _C.ANCHOR_TYPES
LINEAR_ANCHORS: tuple[str, ...] = _C.LINEAR_ANCHORS  # a block's score is one dot product with its anchor row
HEAD_MODES: tuple[str, ...] = _C.HEAD_MODES  # SEPARATE (one selection per KV head) or SHARED
Q8_GROUP: int = _C.Q8_GROUP  # values per scale of the Q8_0 / Q4_0 store types (head_dim must be a multiple)
GGML_TYPES: tuple[str, ...] = _C.GGML_TYPES  # the GGUF tensor types the matrix kernels read in place
MAX_STICKY_BLOCKS: int = _C.MAX_STICKY_BLOCKS  # long_context.sticky_blocks at most
MAX_RERANK: int = _C.MAX_RERANK  # long_context.rerank at most
