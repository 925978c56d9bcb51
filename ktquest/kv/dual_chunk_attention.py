"""Dual chunk attention over a dense cache's keys (models/dual_chunk.py says what DCA is): the queries' three
rotations, each over the keys of its chunk relation, merged exactly by log-sum-exp.

For the queries of one chunk ci (positions [qa, qb)) the keys split into four contiguous parts:

    [0, (ci-1) L)        inter:      every query, its inter rotation
    [(ci-1) L, ci L)     successive: every query, its successive rotation
    [ci L, qa)           intra:      every query, its intra rotation
    [qa, qb)             intra:      causal (query i sees keys <= i)

A prefill chunk that crosses a chunk edge is answered chunk by chunk. A decode step on the CPU reads the three
ranges with the native dense decode kernel (its ``skip`` leaves out the rows before a range).
"""

from __future__ import annotations

import torch

from ktquest.kv.attention import attention_lse, merge_attention
from ktquest.models.dual_chunk import DualChunk
from ktquest.native.attention import dense_decode_attention

INTRA, SUCC, INTER = 0, 1, 2  # the query variants' order (DualChunk.query_positions)


def _full(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
          scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """q [m, H, D] over every key of keys/values [KVH, S, D] (GQA: head h reads KV head h // G) -> out [m, H, D]
    fp32, lse [m, H]."""
    m, h, d = q.shape
    kvh = keys.shape[0]
    g = h // kvh
    rows = q.view(m, kvh, g, d).permute(1, 2, 0, 3).reshape(kvh, g * m, d)  # a KV head's query rows together
    out, lse = attention_lse(rows, keys, values, scale)
    return (out.view(kvh, g, m, -1).permute(2, 0, 1, 3).reshape(m, h, -1),
            lse.view(kvh, g, m).permute(2, 0, 1).reshape(m, h))


def _causal(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
            scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """q [m, H, D] over keys/values [KVH, m, D] at the queries' own positions, query i seeing keys <= i."""
    g = q.shape[1] // keys.shape[0]
    out, lse = attention_lse(q.transpose(0, 1), keys.repeat_interleave(g, 0), values.repeat_interleave(g, 0), scale,
                             causal=True)  # [H, m, D]: m queries over m keys per head
    return out.transpose(0, 1), lse.transpose(0, 1)


def dca_prefill(qv: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start: int, scale: float,
                dc: DualChunk) -> torch.Tensor:
    """qv [3, T, H, D] (the queries at start.. rotated intra / successive / inter, their logits' temperature in
    them), keys/values [KVH, >= start + T, D] rotated at their key positions -> out [T, H, D] fp32."""
    t = qv.shape[1]
    end, n = start + t, dc.length
    out = torch.empty(t, qv.shape[2], values.shape[2], dtype=torch.float32, device=qv.device)
    for ci in range(start // n, (end - 1) // n + 1):
        qa, qb = max(start, ci * n), min(end, (ci + 1) * n)
        rows = slice(qa - start, qb - start)
        o, lse = _causal(qv[INTRA, rows], keys[:, qa:qb], values[:, qa:qb], scale)
        for variant, a, b in ((INTRA, ci * n, qa), (SUCC, (ci - 1) * n, ci * n), (INTER, 0, (ci - 1) * n)):
            if b > max(a, 0):
                o2, lse2 = _full(qv[variant, rows], keys[:, max(a, 0):b], values[:, max(a, 0):b], scale)
                o, lse = merge_attention(o, lse, o2, lse2)
        out[rows] = o
    return out


def dca_decode(qv: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, pos: int, scale: float, dc: DualChunk,
               threads: int) -> torch.Tensor:
    """One decode query at ``pos`` on the CPU: qv [3, H, D] over the first pos + 1 rows of keys/values [KVH, S, D]
    (the native kernel, a range at a time) -> out [H, D]."""
    n = dc.length
    ci = pos // n
    out, lse = dense_decode_attention(qv[INTRA], keys, values, pos + 1, scale, threads, skip=(0, ci * n))
    for variant, a, b in ((SUCC, (ci - 1) * n, ci * n), (INTER, 0, (ci - 1) * n)):
        if b > max(a, 0):
            o2, lse2 = dense_decode_attention(qv[variant], keys, values, b, scale, threads, skip=(0, max(a, 0)))
            out, lse = merge_attention(out, lse, o2, lse2)
    return out
