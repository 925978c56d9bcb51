"""The bytes a KV store of a config reserves, as the C++ store lays it out (cpp/kvstore/layout.h): what the RAM
checks (``kv/memory.py``) compare with the memory available before anything is allocated."""

from __future__ import annotations

from ktquest import _C


def store_bytes(n_layers: int, n_kv_heads: int, head_dim: int, max_seq_len: int, block_size: int, kv_type: str,
                anchor_type: str, anchor_num: int, index_group: int = 0) -> int:
    """Bytes a full store of this config reserves (K, V, scales, anchors, the index's group bounds): the layout
    the C++ store reserves its regions from (cpp/kvstore/layout.h)."""
    return _C.store_bytes(n_layers, n_kv_heads, head_dim, max_seq_len, block_size, kv_type, anchor_type, anchor_num,
                          index_group)


def candidate_copy_bytes(n_layers: int, n_kv_heads: int, head_dim: int, block_size: int, kv_type: str,
                         anchor_type: str, int8_candidates: bool, n_candidates: int, head_mode: str) -> int:
    """Bytes of the store's copy of ``n_candidates`` preselected blocks per layer and set of KV heads (their
    K/V tiles and anchor rows, with the room the copy keeps for later blocks)."""
    return _C.candidate_copy_bytes(n_layers, n_kv_heads, head_dim, block_size, kv_type, anchor_type,
                                   int8_candidates, n_candidates, head_mode)
