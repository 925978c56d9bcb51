"""Rotary position embeddings: the frequencies after a GGUF's RoPE scaling, cos/sin tables, rotate-half."""

from __future__ import annotations

import dataclasses
import math

import torch

from ktquest.models.args import ModelArgs

_ROPE_CHUNK = 8192  # positions whose float64 angles are computed at once


def rope_frequencies(args: ModelArgs, max_len: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [D/2] (float64) after rope scaling, and the cos/sin multiplier (yarn's mscale,
    LongRoPE's attn_factor), for a model whose cache holds ``max_len`` tokens (LongRoPE picks its factors and
    dynamic NTK its base by it, as llama.cpp picks LongRoPE's by n_ctx: fixed for the session, so every
    cached key was rotated by the same table)."""
    d, base, s = args.n_rot, args.rope_theta, args.rope_scaling
    orig = (s.original_context_length if s is not None else 0) or args.context_length  # the trained context
    if s is not None and s.type == "dynamic" and max_len > orig:
        # Dynamic NTK (Hugging Face's rope_type "dynamic" for a sequence of max_len tokens): a larger base
        if d <= 2:
            raise ValueError(f"rope_scaling dynamic needs head_dim > 2 (the base's exponent is D / (D - 2)); "
                             f"this model's head_dim is {d}")
        base = base * (s.factor * max_len / orig - (s.factor - 1)) ** (d / (d - 2))
    inv_freq = base ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)  # [D/2]
    if s is None:
        return inv_freq, 1.0
    if s.freq_factors is not None:  # llama3 (llama.cpp's rope_freqs.weight): theta_i / factor_i
        inv_freq = inv_freq / torch.tensor(s.freq_factors, dtype=torch.float64)
    if s.type == "longrope":  # the long factors once the cache outgrows the trained context
        factors = s.long_factors if max_len > orig else s.short_factors
        return inv_freq / torch.tensor(factors, dtype=torch.float64), s.attn_factor
    if s.type == "linear":
        return inv_freq / s.factor, 1.0
    if s.type == "yarn":
        # YaRN: extrapolate (keep) the fast-rotating dims, interpolate (divide by factor) the slow ones,
        # with a linear ramp between the dims turning beta_fast and beta_slow times over the trained context.
        def correction_dim(n_rot: float) -> float:
            return d * math.log(orig / (n_rot * 2 * math.pi)) / (2 * math.log(base))

        low = max(math.floor(correction_dim(s.beta_fast)), 0)
        high = min(math.ceil(correction_dim(s.beta_slow)), d - 1)
        ramp = ((torch.arange(d // 2, dtype=torch.float64) - low) / max(high - low, 1e-3)).clamp(0, 1)
        inv_freq = inv_freq / s.factor * ramp + inv_freq * (1 - ramp)
        mscale = 0.1 * math.log(s.factor) + 1.0 if s.factor > 1 else 1.0
        return inv_freq, mscale * s.attn_factor
    return inv_freq, 1.0  # llama3: the freq factors above are all of it; dynamic: the base


def rope_variants(args: ModelArgs) -> list[ModelArgs]:
    """The RoPE each table is made for: the model's, and for sliding-window layers (gemma3) a second of base
    ``rope_theta_local`` without scaling (the file's scaling stretches the global layers only)."""
    if not any(b.rope == 1 for b in args.blocks):
        return [args]
    return [args, dataclasses.replace(args, rope_theta=args.rope_theta_local, rope_scaling=None)]


def rope_tables(args: ModelArgs, max_len: int, dtype: torch.dtype,
                device: str | torch.device, rows: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin: [max_len, D] for a cache of ``max_len`` tokens, angles computed in float64 (fp32 angles drift
    by ~1e-3 rad at 8K positions). ``rows`` > 0: that many positions instead, the frequencies still the cache's
    (dual chunk attention's query positions reach its chunk_size, past a shorter cache).

    sin carries rotate-half's sign: ``rotate_half(x) * sin_full == roll(x, D/2) * sin``. With partial rotary
    (``args.rope_dim`` = R < D) the rotated pairs are dims (i, i + D/2) for i < R/2, as ``loader.qk_perm`` gathers
    them, and every other dim has cos 1, sin 0. The float64 angles are made ``_ROPE_CHUNK`` positions at a time,
    so the tables are all the memory a long context costs here.
    """
    inv_freq, mscale = rope_frequencies(args, max_len)
    half, d, n = inv_freq.shape[0], args.head_dim, rows or max_len
    cos = torch.ones(n, d, dtype=dtype, device=device)  # [S, D]
    sin = torch.zeros(n, d, dtype=dtype, device=device)  # [S, D]
    lo, hi = slice(0, half), slice(d // 2, d // 2 + half)
    for p0 in range(0, n, _ROPE_CHUNK):
        p1 = min(p0 + _ROPE_CHUNK, n)
        angles = torch.outer(torch.arange(p0, p1, dtype=torch.float64), inv_freq)  # [n, R/2]
        c, s = angles.cos() * mscale, angles.sin() * mscale
        cos[p0:p1, lo] = c  # rounded to dtype by the copy
        cos[p0:p1, hi] = c
        sin[p0:p1, lo] = -s
        sin[p0:p1, hi] = s
    return cos, sin


def partial_rotary_order(d: int, r: int) -> torch.Tensor:
    """The gather of a head's D dims that puts a partial rotary embedding's R rotated dims (pairs (i, i + R/2),
    NEOX style) at pairs (i, i + D/2), the D - R others after each half: int64 [D], new dim -> the file's dim."""
    h, rest = r // 2, torch.arange(r, d)
    return torch.cat([torch.arange(h), rest[: d // 2 - h], torch.arange(h, r), rest[d // 2 - h:]])


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, n, D], cos/sin: [T, 1, D] -> [T, n, D] (rotate-half)."""
    return torch.addcmul(x * cos, torch.roll(x, x.shape[-1] // 2, dims=-1), sin)


