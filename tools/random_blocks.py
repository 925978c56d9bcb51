"""Random GGML blocks with sane scales: bytes of a quantized tensor whose dequantized weights have a chosen std.

Each function returns ``uint8 [n_blocks, type_size]`` laid out as ggml's ``block_*`` structs
(ggml-common.h). The quant payload (nibbles, high bits) is uniform random bytes; the scales are set so the
dequantized weights have mean ~0 and std ~``std``: a per-block fp16 ``d`` jittered by +-20% and, for the
k-quants, 6-bit (Q4_K/Q5_K) or int8 (Q6_K) sub-block scales drawn from a range that keeps ``d`` a normal
fp16 where it can be. The k-quants with a minimum (Q4_K, Q5_K) and Q5_1 use ``m = sc`` and ``dmin`` chosen
so each sub-block is centred: w = d*sc*q - dmin*m = d*sc*(q - mid).

Everything is vectorized over blocks: a random-bits generator (SFC64) fills the payload, a few small
arrays fill the scales, so gigabytes are written at the disk's pace.
"""

from __future__ import annotations

import gguf
import numpy as np

Q = gguf.GGMLQuantizationType

# Jitter of the block scale d: uniform in [1 - J, 1 + J]; E[f^2] = 1 + J^2 / 3.
_JITTER = 0.2
_JITTER_RMS = float(np.sqrt(1 + _JITTER**2 / 3))


def _uniform_q_std(levels: int) -> float:
    """Std of a value uniform over ``levels`` integers."""
    return float(np.sqrt((levels * levels - 1) / 12))


def _payload(rng: np.random.Generator, n_blocks: int, type_size: int) -> np.ndarray:
    """Uniform random bytes [n_blocks, type_size] (writable)."""
    n = n_blocks * type_size
    words = rng.bit_generator.random_raw((n + 7) // 8)
    return words.view(np.uint8)[:n].reshape(n_blocks, type_size)


def _half_bytes(x: np.ndarray) -> np.ndarray:
    """float -> fp16 little-endian bytes [..., 2]."""
    return x.astype("<f2").view(np.uint8).reshape(*x.shape, 2)


def _block_d(rng: np.random.Generator, n_blocks: int, base: float, signed: bool = False) -> np.ndarray:
    """Block scales: ``base`` jittered; ``signed``: a random sign each, which centres the symmetric types
    (their codes q - mid have mean -1/2, as llama.cpp's negative d for a block whose extreme is negative)."""
    d = base * rng.uniform(1 - _JITTER, 1 + _JITTER, n_blocks)
    return np.where(rng.integers(0, 2, n_blocks, dtype=np.uint8) == 1, -d, d) if signed else d


def _int_scales(rng: np.random.Generator, shape: tuple[int, ...], lo: int, hi: int) -> tuple[np.ndarray, float]:
    """Integer sub-block scales uniform in [lo, hi] and their RMS (for the std calibration)."""
    rms = float(np.sqrt(np.mean(np.arange(lo, hi + 1, dtype=np.float64) ** 2)))
    return rng.integers(lo, hi + 1, shape, dtype=np.uint8), rms


def _pack_k_scales(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """8 six-bit scales and 8 six-bit mins per block [n, 8] -> ggml's 12-byte packing [n, 12]
    (the inverse of get_scale_min_k4: the high 2 bits of entries 4..7 ride in the top bits of bytes 0..7)."""
    out = np.empty((sc.shape[0], 12), np.uint8)
    out[:, 0:4] = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    out[:, 4:8] = m[:, :4] | ((m[:, 4:] >> 4) << 6)
    out[:, 8:12] = (sc[:, 4:] & 0xF) | ((m[:, 4:] & 0xF) << 4)
    return out


# ---- 32-value blocks ----


def q8_0(rng, n: int, std: float) -> np.ndarray:
    """block_q8_0: d (fp16), qs int8[32]; w = d * q."""
    b = _payload(rng, n, 34)
    b[:, 0:2] = _half_bytes(_block_d(rng, n, std / (_uniform_q_std(256) * _JITTER_RMS), signed=True))
    return b


def q4_0(rng, n: int, std: float) -> np.ndarray:
    """block_q4_0: d (fp16), qs[16] nibbles; w = d * (q - 8)."""
    b = _payload(rng, n, 18)
    b[:, 0:2] = _half_bytes(_block_d(rng, n, std / (_uniform_q_std(16) * _JITTER_RMS), signed=True))
    return b


def q5_0(rng, n: int, std: float) -> np.ndarray:
    """block_q5_0: d (fp16), qh[4] fifth bits, qs[16] nibbles; w = d * (q - 16)."""
    b = _payload(rng, n, 22)
    b[:, 0:2] = _half_bytes(_block_d(rng, n, std / (_uniform_q_std(32) * _JITTER_RMS), signed=True))
    return b


def q5_1(rng, n: int, std: float) -> np.ndarray:
    """block_q5_1: d, m (fp16), qh[4], qs[16]; w = d * q + m, m = -15.5 d (centred)."""
    b = _payload(rng, n, 24)
    d = _block_d(rng, n, std / (_uniform_q_std(32) * _JITTER_RMS))
    b[:, 0:2] = _half_bytes(d)
    b[:, 2:4] = _half_bytes(-15.5 * d)
    return b


# ---- 256-value super-blocks (k-quants) ----


def _k_with_min(rng, n: int, std: float, type_size: int, levels: int) -> np.ndarray:
    """block_q4_K / block_q5_K: d, dmin (fp16), scales[12] (8 scales + 8 mins, 6 bits), payload."""
    b = _payload(rng, n, type_size)
    sc, sc_rms = _int_scales(rng, (n, 8), 32, 63)
    d = _block_d(rng, n, std / (_uniform_q_std(levels) * sc_rms * _JITTER_RMS))
    b[:, 0:2] = _half_bytes(d)
    b[:, 2:4] = _half_bytes(d * (levels - 1) / 2)  # dmin * m = d * sc * mid with m = sc
    b[:, 4:16] = _pack_k_scales(sc, sc)
    return b


def q4_k(rng, n: int, std: float) -> np.ndarray:
    """block_q4_K (144 bytes): d, dmin, scales[12], qs[128]."""
    return _k_with_min(rng, n, std, 144, 16)


def q5_k(rng, n: int, std: float) -> np.ndarray:
    """block_q5_K (176 bytes): d, dmin, scales[12], qh[32], qs[128]."""
    return _k_with_min(rng, n, std, 176, 32)


def q6_k(rng, n: int, std: float) -> np.ndarray:
    """block_q6_K (210 bytes): ql[128], qh[64], scales int8[16], d (fp16); w = d * sc * (q - 32)."""
    b = _payload(rng, n, 210)
    sc, sc_rms = _int_scales(rng, (n, 16), 64, 127)
    b[:, 192:208] = sc  # 64..127: the same bytes as int8
    b[:, 208:210] = _half_bytes(_block_d(rng, n, std / (_uniform_q_std(64) * sc_rms * _JITTER_RMS),
                                                   signed=True))
    return b


# ---- float types ----


def f32(rng, n: int, std: float) -> np.ndarray:
    return (std * rng.standard_normal(n, dtype=np.float32)).view(np.uint8).reshape(n, 4)


def f16(rng, n: int, std: float) -> np.ndarray:
    return (std * rng.standard_normal(n, dtype=np.float32)).astype("<f2").view(np.uint8).reshape(n, 2)


WRITERS = {Q.Q8_0: q8_0, Q.Q4_0: q4_0, Q.Q5_0: q5_0, Q.Q5_1: q5_1, Q.Q4_K: q4_k, Q.Q5_K: q5_k, Q.Q6_K: q6_k,
           Q.F16: f16, Q.F32: f32}


def random_blocks(qtype: Q, rng: np.random.Generator, n_blocks: int, std: float) -> np.ndarray:
    """``n_blocks`` random blocks of ``qtype`` whose dequantized values have std ~``std``: uint8 [n, size]."""
    try:
        writer = WRITERS[qtype]
    except KeyError:
        raise ValueError(f"no random-block writer for {qtype.name}; known: "
                         f"{', '.join(t.name for t in WRITERS)}") from None
    return writer(rng, n_blocks, std)
