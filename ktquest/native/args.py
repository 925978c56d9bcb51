"""Argument checks in front of the native calls: torch dtype, shape, contiguity and device, with errors
(``TypeError`` / ``ValueError`` / ``IndexError``) that name the argument. The bindings check again."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


def check_name(value: str, what: str, allowed: tuple[str, ...]) -> str:
    if not isinstance(value, str) or value.upper() not in allowed:
        raise ValueError(f"{what}={value!r} is not allowed: one of {', '.join(allowed)}")
    return value.upper()


def check_int(value, what: str, lo: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < lo:
        raise ValueError(f"{what}={value!r} is not allowed: an integer >= {lo}")
    return int(value)


def check_tensor(x, what: str, dtypes: tuple[torch.dtype, ...], ndim: int) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{what}: expected a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in dtypes:
        raise TypeError(f"{what}: dtype {x.dtype} is not supported: one of {', '.join(map(str, dtypes))}")
    if x.device.type != "cpu":
        raise ValueError(f"{what}: must be on the CPU, got {x.device}")
    if x.dim() != ndim:
        raise ValueError(f"{what}: expected {ndim} dimensions, got shape {list(x.shape)}")
    if not x.is_contiguous():
        raise ValueError(f"{what}: must be contiguous (call .contiguous())")
    return x.detach()


def as_numpy(x, what: str, dtypes: tuple[torch.dtype, ...], ndim: int) -> np.ndarray:
    """A numpy view of a CPU tensor. Fast path for the decode loop: the binding checks shape and contiguity
    again, so only the conversion is tried here; anything odd goes through check_tensor() for a clear error."""
    if type(x) is torch.Tensor and x.dtype in dtypes:
        try:
            return x.numpy()
        except RuntimeError:  # requires grad, or not on the CPU
            pass
    return check_tensor(x, what, dtypes, ndim).numpy()


def padded_ids(rows, what: str, n_rows: int) -> np.ndarray:
    """Block ids per set -> int32 [n_rows, N], -1 padded. rows: a [n_rows, N] int tensor or lists."""
    if isinstance(rows, torch.Tensor):
        if rows.dtype not in (torch.int32, torch.int64) or rows.device.type != "cpu":
            raise TypeError(f"{what}: expected a CPU int32/int64 tensor, got {rows.dtype} on {rows.device}")
        t = rows.reshape(1, -1) if rows.dim() == 1 and n_rows == 1 else rows
        if t.dim() != 2 or t.shape[0] != n_rows:
            raise ValueError(f"{what}: expected {n_rows} row(s) of block ids, got shape {list(rows.shape)}")
        return t.to(torch.int32).contiguous().numpy()
    if not isinstance(rows, Sequence):
        raise TypeError(f"{what}: expected a tensor or a list of block-id lists, got {type(rows).__name__}")
    if n_rows == 1 and (len(rows) == 0 or not isinstance(rows[0], (Sequence, torch.Tensor, np.ndarray))):
        rows = [rows]
    if len(rows) != n_rows:
        raise ValueError(f"{what}: expected {n_rows} list(s) of block ids (one per set), got {len(rows)}")
    width = max((len(r) for r in rows), default=0)
    out = np.full((n_rows, width), -1, np.int32)
    for i, r in enumerate(rows):
        ids = np.asarray(r, dtype=np.int64).reshape(-1)
        if np.any(ids < 0) or np.any(ids > np.iinfo(np.int32).max):
            raise IndexError(f"{what}: block ids must be >= 0, got {ids[ids < 0][:3].tolist()} in row {i}")
        out[i, : len(ids)] = ids
    return out


def check_variants(variants) -> tuple[int, int] | None:
    """Dual chunk attention's bounds (succ, intra) (cpp/select/request.h QueryVariants): blocks (tokens for
    SnapKV) before succ are read by q[2], the inter rotation, [succ, intra) by q[1], the rest by q[0]."""
    if variants is not None and (not isinstance(variants, tuple) or len(variants) != 2 or not all(
            isinstance(x, int) and not isinstance(x, bool) for x in variants)):
        raise ValueError(f"variants={variants!r} is not allowed: None, or (succ, intra) integers")
    return variants
