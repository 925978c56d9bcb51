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


def merge_parts(parts: list) -> tuple[torch.Tensor, torch.Tensor]:
    """One attention from the (out, lse) of disjoint key sets (None: an empty one; at least one is not)."""
    parts = [p for p in parts if p is not None]
    acc = parts[0]
    for p in parts[1:]:
        acc = merge_attention(*acc, *p)
    return acc


def dca_range(qv: torch.Tensor, qa: int, keys: torch.Tensor, values: torch.Tensor, ka: int, scale: float,
              dc: DualChunk) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The queries of one chunk, qv [3, m, H, D] at positions [qa, qa + m), over keys/values [KVH, n, D] at
    positions [ka, ka + n) (ending by the queries' end): each key by the rotation its chunk calls for, the keys
    at the queries' own positions causally -> (out [m, H, D], lse [m, H]) fp32, or None for no key. The
    long-context cache's windows and prompt workspace are such ranges."""
    m, n = qv.shape[1], keys.shape[1]
    qb, kb = qa + m, ka + n
    if n == 0:
        return None
    if kb > qb:
        raise ValueError(f"dual chunk attention: keys at {ka}..{kb - 1} for queries at {qa}..{qb - 1}")
    succ, intra = dc.bounds(qa // dc.length)
    parts = []
    for variant, a, b in ((INTER, 0, succ), (SUCC, succ, intra), (INTRA, intra, qa)):
        a, b = max(a, ka), min(b, kb)
        if b > a:
            parts.append(_full(qv[variant], keys[:, a - ka: b - ka], values[:, a - ka: b - ka], scale))
    if kb > qa:  # keys [c0, kb) at the queries' own positions: the queries before c0 see none, those past kb all
        c0 = max(qa, ka)
        r0, r1, kc, vc = c0 - qa, kb - qa, keys[:, c0 - ka:], values[:, c0 - ka:]
        if r0 == 0 and r1 == m:
            parts.append(_causal(qv[INTRA], kc, vc, scale))
        else:
            out = torch.zeros(m, qv.shape[2], values.shape[2], dtype=torch.float32, device=qv.device)
            lse = torch.full((m, qv.shape[2]), float("-inf"), device=qv.device)
            out[r0:r1], lse[r0:r1] = _causal(qv[INTRA, r0:r1], kc, vc, scale)
            if r1 < m:
                out[r1:], lse[r1:] = _full(qv[INTRA, r1:], kc, vc, scale)
            parts.append((out, lse))
    return merge_parts(parts)


def dca_pieces(dc: DualChunk, ci: int, ka: int, kb: int) -> list[tuple[int, int, int]]:
    """Keys at positions [ka, kb) for a query of chunk ci, at or past all of them: [(variant, a, b)], the parts
    one rotation reads."""
    succ, intra = dc.bounds(ci)
    return [(v, max(a, ka), min(b, kb)) for v, a, b in ((INTER, 0, succ), (SUCC, succ, intra), (INTRA, intra, kb))
            if min(b, kb) > max(a, ka)]


def dca_prefill(qv: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start: int, scale: float,
                dc: DualChunk) -> torch.Tensor:
    """qv [3, T, H, D] (the queries at start.. rotated intra / successive / inter, their logits' temperature in
    them), keys/values [KVH, >= start + T, D] rotated at their key positions -> out [T, H, D] fp32."""
    t = qv.shape[1]
    out = torch.empty(t, qv.shape[2], values.shape[2], dtype=torch.float32, device=qv.device)
    for qa, qb, _ in dc.groups(start, t):
        out[qa - start: qb - start] = dca_range(qv[:, qa - start: qb - start], qa, keys[:, :qb], values[:, :qb], 0,
                                                scale, dc)[0]
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
