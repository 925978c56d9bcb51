"""How many bytes a long_context store needs, and the check that refuses a ``max_seq_len`` whose store
would not fit in RAM before anything is allocated."""

from __future__ import annotations

import os

from ktquest import _C
from ktquest.config import ConfigError, LongContextConfig


def store_bytes(lc: LongContextConfig, n_layers: int, n_kv_heads: int, head_dim: int, max_seq_len: int) -> int:
    """Bytes the DRAM store needs when full (K, V, scales, anchors): the layout the C++ store reserves."""
    return _C.store_bytes(n_layers, n_kv_heads, head_dim, max_seq_len, lc.block_size, lc.kv_type, lc.anchor_type,
                          lc.anchor_num)


def candidate_copy_bytes(lc: LongContextConfig, n_layers: int, n_kv_heads: int, head_dim: int,
                         max_seq_len: int) -> int:
    """Bytes of the store's copy of the preselected candidates (their K/V tiles and anchor rows, per layer and
    set of KV heads) at the size it starts with after prefill; it grows by a block each block_size tokens
    once the room it keeps for later blocks is used."""
    if not lc.preselect_block:
        return 0
    need = min(lc.preselect_block_count, -(-max_seq_len // lc.block_size))
    return _C.candidate_copy_bytes(n_layers, n_kv_heads, head_dim, lc.block_size, lc.kv_type, lc.anchor_type,
                                   lc.int8_candidates, need, lc.head_select_mode)


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
    try:  # the store's layout refuses sizes past its limits (int32 block ids) or that overflow
        need = store_bytes(lc, *dims) + candidate_copy_bytes(lc, *dims)
    except (ValueError, OverflowError) as e:
        raise ConfigError(f"max_seq_len={max_seq_len} is not allowed: {e}") from None
    have = available_ram()
    if need > have:
        raise ConfigError(f"max_seq_len={max_seq_len} is not allowed: the {lc.kv_type} KV store would need "
                          f"{need / 2**30:.2f} GiB and {have / 2**30:.2f} GiB of RAM is available; lower "
                          f"max_seq_len or pick a smaller kv_type (Q8_0, Q4_0)")
