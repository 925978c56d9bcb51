"""How many bytes a long_context store needs, and the check that refuses a ``max_seq_len`` whose store
would not fit in RAM before anything is allocated."""

from __future__ import annotations

import os

from ktquest.config import LINEAR_ANCHORS, ConfigError, LongContextConfig


_ROW_BYTES = {"FP32": 4.0, "FP16": 2.0, "BF16": 2.0, "Q8_0": 1.0, "Q4_0": 0.5}  # bytes per element


def _tile_bytes(lc: LongContextConfig, head_dim: int) -> int:
    """One (KV head, block) tile of K or V: block_size rows and their Q8_0/Q4_0 scales, padded to 64 bytes."""
    scales = head_dim // 32 * 4 if lc.kv_type in ("Q8_0", "Q4_0") else 0
    return int(lc.block_size * (head_dim * _ROW_BYTES[lc.kv_type] + scales) + 63) // 64 * 64


def store_bytes(lc: LongContextConfig, n_layers: int, n_kv_heads: int, head_dim: int, max_seq_len: int) -> int:
    """Bytes the DRAM store needs when full (K, V, scales, anchors): the layout of cpp/kv_store.h."""
    bs, D = lc.block_size, head_dim
    tile = _tile_bytes(lc, D)
    linear = lc.anchor_type in LINEAR_ANCHORS
    A = 2 if lc.anchor_type == "QUEST" else 1 if linear else lc.anchor_num
    anchor_bytes = 2 if linear and lc.kv_type == "FP16" else 4  # linear anchors over FP16 keys are fp16
    per_block = 2 * tile + A * D * anchor_bytes + 4 + (D * 8 if lc.anchor_type == "BLOCK_MEAN" else 0) \
        + (A * 8 if lc.anchor_type == "DYNAMIC" else 0)
    return n_layers * n_kv_heads * -(-max_seq_len // bs) * per_block


def candidate_copy_bytes(lc: LongContextConfig, n_layers: int, n_kv_heads: int, head_dim: int,
                         max_seq_len: int) -> int:
    """Bytes of the store's copy of the preselected candidates (their K/V tiles and anchor rows, per layer and
    KV head), at the size it starts with after prefill: room for preselect_block_count blocks and a quarter
    more (at least 64) that join as decoding goes on; it grows by a block each block_size tokens past that."""
    if not lc.preselect_block or lc.anchor_type not in LINEAR_ANCHORS:  # only linear anchors' candidates are cached
        return 0
    D = head_dim
    A = 2 if lc.anchor_type == "QUEST" else 1
    row = A * D * (1 if lc.int8_candidates else 2 if lc.kv_type == "FP16" else 4) + (4 if lc.int8_candidates else 0)
    need = min(lc.preselect_block_count, -(-max_seq_len // lc.block_size))
    return n_layers * n_kv_heads * (need + max(64, need // 4)) * (2 * _tile_bytes(lc, D) + row + 4)


def available_ram() -> int:
    """MemAvailable from /proc/meminfo (else physical memory), bytes."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def check_store_fits(lc: LongContextConfig, args, max_seq_len: int) -> None:
    """ConfigError (with the figure) when a full store for ``max_seq_len`` would not fit in available RAM."""
    dims = (args.n_layers, args.n_kv_heads, args.head_dim, max_seq_len)
    need, have = store_bytes(lc, *dims) + candidate_copy_bytes(lc, *dims), available_ram()
    if need > have:
        raise ConfigError(f"max_seq_len={max_seq_len} is not allowed: the {lc.kv_type} KV store would need "
                          f"{need / 2**30:.2f} GiB and {have / 2**30:.2f} GiB of RAM is available; lower "
                          f"max_seq_len or pick a smaller kv_type (Q8_0, Q4_0)")
