"""Matrices in their GGUF encoding, multiplied in place (cpp/gemm/): ``QuantMatrix`` holds the parts of a weight
(whole rows stacked in order, each part in its own encoding) and its bias; a few tokens take ``gemv``, a prefill
chunk ``gemm_int8`` (K-quants, 4/5-bit 32-value types on int8 activations) or a panel of ``dequantize_matrix``.
The binding checks every array's dtype, shape and contiguity; these are the only calls of them in ktquest."""

from __future__ import annotations

import numpy as np

from ktquest import _C

QuantMatrix = _C.QuantMatrix  # (parts: [(type, uint8 [rows, row_bytes])], bias fp32 [out] | None, x16: bool)


def gemv(m: QuantMatrix, x: np.ndarray, y: np.ndarray, threads: int) -> None:
    """y [T, out] = x [T, in] @ W.T (+ b), fp32, for a few tokens: x rounded to int8 (int16 with ``m.x16``) per
    block, integer dot products on the encoded rows (cpp/gemm/gemv_blocks.h; the same for any thread count)."""
    _C.gemv_matrix(m, x, y, threads)


def gemm_int8(m: QuantMatrix, x: np.ndarray, y: np.ndarray, threads: int) -> None:
    """y [T, out] = x [T, in] @ W.T (+ b) for a prefill chunk where ``m.int8_gemm`` (cpp/gemm/gemm_int8.h)."""
    _C.gemm_int8(m, x, y, threads)


def gemm_int8_grouped(mats: list[QuantMatrix], offsets: np.ndarray, x: np.ndarray, y: np.ndarray,
                      threads: int, rows: np.ndarray | None = None) -> None:
    """Rows [offsets[e], offsets[e + 1]) of x [N, in] through mats[e] into the same rows of y [N, out], one call
    (cpp/gemm/gemm_int8.h: each matrix's ``gemm_int8`` on its rows, bit for bit; x quantized once). With
    ``rows`` (int64 [N]), row i reads x row rows[i] instead (x [n_x, in]: no gathered copy)."""
    _C.gemm_int8_grouped(mats, offsets, x, y, threads, rows)


def dequantize_matrix(m: QuantMatrix, r0: int, r1: int, out: np.ndarray, threads: int,
                      order: np.ndarray | None = None) -> None:
    """Rows [r0, r1) of W (or, with ``order`` int32 [out], rows order[r0:r1]) as fp32 into out [r1 - r0, in]."""
    _C.dequantize_matrix(m, r0, r1, out, threads, order)


def dequantize_rows(type_name: str, raw: np.ndarray) -> np.ndarray:
    """Encoded rows uint8 [n, row_bytes] of ``type_name`` (one of ``enums.GGML_TYPES``) -> fp32 [n, in]."""
    return _C.dequantize_rows(type_name, raw)
