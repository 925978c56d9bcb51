"""One layer of a long-context pass, executed: the windows' dense attention, the store's part, their LSE merge
and the store append, as functions of (the cache's ``Shape``, ``Windows``, ``KVStore``, ``DecodePlanner``,
``PassGeometry``). ``LongContextCache`` (kv/long_context.py) composes them; it holds no attention code.

    attend_layer      a pass of T tokens through one layer (a prompt's chunk, or a decode step off the native path)
    attend_layer_dca  the same with dual chunk attention past its first chunk (models/dual_chunk.py)
    decode_native     one decode token through one layer in one native call (cpp/decode/layer_step.h)

A prompt's chunk attends every context block (exact prefill) or, with sparse prefill, per KV head the blocks
``prefill_blocks`` picks; its queries are regrouped as [KVH, T * G] "heads" so the store reads past K/V in
place in their stored type. A decode step attends the blocks the planner says (a fixed list or a fresh
selection).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from ktquest.config import PrefillConfig
from ktquest.kv.attention import FLASH_CPU, merge_attention
from ktquest.kv.dual_chunk_attention import dca_pieces, dca_range, merge_parts
from ktquest.kv.placement import Placement
from ktquest.kv.plan import DecodePlanner
from ktquest.kv.windows import PassGeometry, Windows
from ktquest.models.dual_chunk import DualChunk
from ktquest.native.attention import dense_decode_attention
from ktquest.native.store import KVStore

FLASH_TILE = 64  # query tokens per flash call of window_attention


@dataclass(frozen=True, slots=True)
class Shape:
    """What every pass of one long-context cache shares."""

    n_heads: int
    n_kv_heads: int
    head_dim: int
    block_size: int
    ib: int  # the init window's blocks: context blocks start there
    scale: float  # the windows' softmax scale (the store's is 1 / sqrt(D) too)
    threads: int
    placement: Placement
    native_decode: bool  # a decode step runs natively (CPU fp32, not DYNAMIC anchors: decode_native)
    dynamic: bool  # DYNAMIC anchors: the store takes each token's attention as its importance
    prefill: PrefillConfig
    all_blocks: torch.Tensor  # int32 [max_blocks] = arange

    @property
    def group(self) -> int:
        return self.n_heads // self.n_kv_heads


def attend_layer(s: Shape, win: Windows, store: KVStore, planner: DecodePlanner, g: PassGeometry, layer: int,
                 q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, exact_from: int) -> torch.Tensor:
    """Store k/v at the pass's positions and return causal attention over everything held, in ``layer`` (a prompt
    pass's queries are the cache's to record).

    q: [T, H, D], k/v: [T, KVH, D] (device) -> out [T, H, D]. exact_from: prompt queries from this position on
    read every context block (``prefill.exact_tail``)."""
    T = q.shape[0]
    # ---- device part: init + local windows + this chunk, dense ----
    win.write(layer, g.w0, k, v)
    out_w, lse_w, probs = window_attention(s, win, layer, q, g)  # [T, H, D], [T, H] fp32
    imp = None
    if s.dynamic:  # a token's importance: the attention the chunk's queries give it
        imp = probs.view(s.n_kv_heads, T, s.group, -1)[..., g.w0: g.w0 + T].sum((1, 2)).t().float()
        imp = s.placement.to_host(imp)
    # ---- store part: the context blocks [ib, lb) ----
    lb = g.loc0 // s.block_size
    if lb > s.ib:
        if g.decode:
            out_s, lse_s = decode_context(s, store, planner, layer, q, lb)
            out_s, lse_s = s.placement.to_device(out_s)[None], s.placement.to_device(lse_s)[None]
        else:
            out_s, lse_s = prefill_context(s, store, g, layer, q, lb, exact_from)
        out_w, _ = merge_attention(out_w, lse_w, out_s, lse_s)
    # ---- the chunk goes to the store (after attention: the store part never sees it) ----
    store.append(layer, s.placement.to_host(k), s.placement.to_host(v), imp)
    return out_w.to(q.dtype)


def attend_layer_dca(s: Shape, win: Windows, store: KVStore, planner: DecodePlanner, g: PassGeometry, layer: int,
                     qv: torch.Tensor, k: torch.Tensor, v: torch.Tensor, exact_from: int,
                     dc: DualChunk) -> torch.Tensor:
    """``attend_layer`` with dual chunk attention (models/dual_chunk.py): qv [3, T, H, D], the queries' intra,
    successive and inter rotations. The pass's queries by chunk: each group reads the init window, the local
    window (the pass's own rows causally) and the store's context blocks, every key by the rotation its chunk
    calls for (the store's blocks by the bounds it is given: cpp/select/request.h), merged by their LSE."""
    T, bs = qv.shape[1], s.block_size
    win.write(layer, g.w0, k, v)
    lb = g.loc0 // bs
    out = torch.empty(T, s.n_heads, s.head_dim, dtype=torch.float32, device=qv.device)
    r0 = win.row(g.loc0)
    for qa, qb, ci in dc.groups(g.start, T):
        rows = slice(qa - g.start, qb - g.start)
        qg = qv[:, rows]
        init = min(win.init_end, qb)  # (a chunk shorter than the init window: its first groups end inside it)
        if g.decode and s.native_decode:  # the windows' rows a rotation at a time, in the native decode kernel
            q3 = qg[:, 0].contiguous()  # [3, H, D]
            parts = [dense_decode_attention(q3[v], win.k[layer], win.v[layer], win.row(b - 1) + 1, s.scale,
                                            s.threads, skip=(0, win.row(a)))
                     for ka, kb in ((0, init), (g.loc0, qb)) for v, a, b in dca_pieces(dc, ci, ka, kb)]
            parts = [(o[None], lse[None]) for o, lse in parts]
        else:
            parts = [dca_range(qg, qa, win.k[layer, :, :init], win.v[layer, :, :init], 0, s.scale, dc),
                     dca_range(qg, qa, win.k[layer, :, r0: win.row(qb - 1) + 1],
                               win.v[layer, :, r0: win.row(qb - 1) + 1], g.loc0, s.scale, dc)]
        if lb > s.ib:  # ---- the store's context blocks [ib, lb), the rotations' bounds in blocks ----
            var = dc.block_bounds(ci, bs)
            if g.decode:
                o, lse = decode_context(s, store, planner, layer, qg, lb, var)
                parts.append((s.placement.to_device(o)[None], s.placement.to_device(lse)[None]))
            else:
                parts.append(prefill_context(s, store, dataclasses.replace(g, start=qa, T=qb - qa), layer, qg, lb,
                                             exact_from, var))
        out[rows] = merge_parts(parts)[0]
    store.append(layer, s.placement.to_host(k), s.placement.to_host(v), None)
    return out.to(qv.dtype)


def decode_native(s: Shape, win: Windows, store: KVStore, planner: DecodePlanner, g: PassGeometry, layer: int,
                  q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """``attend_layer`` for one decode token on the CPU in one native call: window write, dense window attention,
    the store part as the planner says, LSE merge and the store append. q [1, H, D] -> [1, H, D]."""
    lb = g.loc0 // s.block_size
    blocks, select = planner.plan(layer, lb) if lb > s.ib else (None, None)
    out = torch.empty(1, s.n_heads, s.head_dim)
    ids = store.decode_step(layer, q[0].contiguous(), k[0].contiguous(), v[0].contiguous(), win.k[layer],
                            win.v[layer], g.w0, g.width, g.skip, s.scale, s.threads, out[0], blocks, select)
    if ids is not None:
        planner.record(layer, ids, lb)
    return out


def window_attention(s: Shape, win: Windows, layer: int, q: torch.Tensor, g: PassGeometry):
    """Dense attention over the device windows: (out [T, H, D], lse [T, H], probs [KVH, T*G, W] or None).

    Rows are ordered (t, g) per KV head, so the [T, W] mask broadcasts over G without a copy, and for T = 1
    every reshape is a view. Where torch's fused CPU flash attention takes the buffers (not with DYNAMIC anchors,
    which need probs) it runs in query tiles of FLASH_TILE tokens, each against the columns its last query sees;
    probs None. Otherwise a baddbmm or bmm, one exp pass for the softmax and its log-sum-exp, and one bmm.
    """
    T, KVH, G, D = q.shape[0], s.n_kv_heads, s.group, s.head_dim
    keys = win.k[layer, :, : g.width]  # [KVH, W, D]
    vals = win.v[layer, :, : g.width]
    qh = q.reshape(T, KVH, G, D).transpose(0, 1).reshape(KVH, T * G, D)  # [KVH, T*G, D]
    if s.placement.flash and not s.dynamic:
        # The fused kernel returns the LSE too: 2-3x faster than the explicit ops below. Query tiles of
        # FLASH_TILE tokens, each against the key columns its last query sees ([0, w)): a prompt chunk's causal
        # square costs about half of one masked call (torch's CPU flash skips no block of a mask, and with
        # is_causal not the upper half of a 512-square either).
        outs, lses = [], []
        for t0 in range(0, T, FLASH_TILE):
            t1 = min(T, t0 + FLASH_TILE)
            w = g.width if g.mask is None else win.row(g.start + t1 - 1) + 1  # (the last tile: W)
            mask = None if g.mask is None else g.mask_rows[t0 * G: t1 * G, :w]  # [tile*G, w]
            o, lse = FLASH_CPU(qh[None, :, t0 * G: t1 * G], keys[None, :, :w], vals[None, :, :w], 0.0, False,
                               attn_mask=mask, scale=s.scale)
            outs.append(o)
            lses.append(lse)
        out, lse = (outs[0], lses[0]) if len(outs) == 1 else (torch.cat(outs, 2), torch.cat(lses, 2))
        out = out.view(KVH, T, G, D).transpose(0, 1).reshape(T, s.n_heads, D)
        return out, lse.view(KVH, T, G).transpose(0, 1).reshape(T, s.n_heads), None
    if keys.dtype != torch.float32:
        qh, keys, vals = qh.float(), keys.float(), vals.float()
    if g.mask is None:  # decode, nothing to hide
        sc = torch.bmm(qh, keys.transpose(1, 2)).mul_(s.scale)  # [KVH, G, W]
    elif T == 1:
        sc = torch.baddbmm(g.mask, qh, keys.transpose(1, 2), alpha=s.scale)  # mask [1, W] broadcasts
    else:
        sc = torch.bmm(qh, keys.transpose(1, 2)).mul_(s.scale)  # [KVH, T*G, W]
        sc.view(KVH, T, G, g.width).add_(g.mask[:, None, :])
    # softmax and its log-sum-exp in one exp pass, in place (torch.logsumexp would run its own exp over a
    # temporary of the scores' size): [KVH, T*G, W]
    m = sc.amax(-1, keepdim=True).clamp_min_(torch.finfo(sc.dtype).min)  # a row of -inf keeps m finite
    probs = sc.sub_(m).exp_()
    total = probs.sum(-1, keepdim=True)  # >= 1 in every row that has an unmasked key
    probs.div_(total)
    lse = (m + total.log()).squeeze(-1)  # [KVH, T*G]
    out = torch.bmm(probs, vals)  # [KVH, T*G, D]
    out = out.view(KVH, T, G, D).transpose(0, 1).reshape(T, s.n_heads, D)
    return out, lse.view(KVH, T, G).transpose(0, 1).reshape(T, s.n_heads), probs


# ---- the store's part of a prompt's chunk ----


def prefill_context(s: Shape, store: KVStore, g: PassGeometry, layer: int, q: torch.Tensor, lb: int,
                    exact_from: int, var: tuple[int, int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of every chunk query to the context blocks [ib, lb) (all of them, or with sparse prefill those
    ``prefill_blocks`` picks), read in place from DRAM. var: dual chunk attention's block bounds, q then
    [3, T, H, D] (``KVStore.attend``'s variants)."""
    T = q.shape[-3]
    blocks = prefill_blocks(s, store, g, layer, q, lb, exact_from, var)  # [n]: every block; [KVH, n]: sparse picks
    cut = min(max(exact_from - g.start, 0), T)  # queries [cut, T): the prompt's exact tail
    if blocks.dim() == 1 or cut == T:
        return read_context(s, store, layer, q, blocks, var)
    every = s.all_blocks[s.ib: lb]
    (o1, s1), (o2, s2) = (read_context(s, store, layer, q[..., :cut, :, :], blocks, var),
                          read_context(s, store, layer, q[..., cut:, :, :], every, var))
    return torch.cat([o1, o2]), torch.cat([s1, s2])


def store_rows(s: Shape, q: torch.Tensor) -> torch.Tensor:
    """q [..., T, H, D] as the store's query "heads" [..., KVH * T * G, D] fp32 on the host: head (kvh, t, g)
    reads KV head kvh (the store's grouping h // (H' / KVH) with H' = KVH*T*G)."""
    T, KVH, G, D = q.shape[-3], s.n_kv_heads, s.group, s.head_dim
    lead = q.shape[:-3]
    x = q.float().reshape(*lead, T, KVH, G, D).transpose(-4, -3)  # [..., KVH, T, G, D]
    return s.placement.to_host(x.reshape(*lead, KVH * T * G, D))


def read_context(s: Shape, store: KVStore, layer: int, q: torch.Tensor, blocks: torch.Tensor,
                 var: tuple[int, int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, H, D] (with dual chunk attention's block bounds var: [3, T, H, D]) attends the store's ``blocks``
    of ``layer`` ([KVH, n] per KV head, or [n] for every head): (out [T, H, D], lse [T, H]) fp32 on the device."""
    T, KVH, G, D = q.shape[-3], s.n_kv_heads, s.group, s.head_dim
    out, lse = store.attend(layer, store_rows(s, q).contiguous(), blocks, variants=var)
    out = out.view(KVH, T, G, D).permute(1, 0, 2, 3).reshape(T, s.n_heads, D)
    lse = lse.view(KVH, T, G).permute(1, 0, 2).reshape(T, s.n_heads)
    return s.placement.to_device(out), s.placement.to_device(lse)


def prefill_blocks(s: Shape, store: KVStore, g: PassGeometry, layer: int, q: torch.Tensor, lb: int,
                   exact_from: int, var: tuple[int, int] | None = None) -> torch.Tensor:
    """The context blocks a prefill chunk attends. Exact prefill (and sparse before ``prefill.exact_tokens``,
    while the context holds at most ``prefill.blocks`` blocks, or in a chunk within the prompt's last
    ``prefill.exact_tail`` tokens: ``exact_from``): every block of [ib, lb), [n]. (A chunk that reaches into
    that tail takes the sparse picks; ``prefill_context`` gives its tail queries every block.) Sparse: per KV
    head the ``prefill.blocks`` blocks whose anchor scores, summed over ``select_queries`` of the chunk's
    queries (spread over it, its last included) and their query heads, are highest, plus the chunk's length of
    blocks just before the local window (the local window ends with the chunk, so its first queries would
    otherwise see no recent token before themselves): [KVH, n] int32, ascending, -1 padded. The choice is the
    store's selection, pruned by the hierarchical index when ``index_group`` > 0 (a chunk then scores the
    N / (block_size * index_group) group bounds and the blocks of the groups that may hold a pick, not all
    N / block_size blocks)."""
    pf = s.prefill
    if pf.mode != "sparse" or g.start < pf.exact_tokens or lb - s.ib <= pf.blocks or g.start >= exact_from:
        return s.all_blocks[s.ib: lb]
    T, KVH = q.shape[-3], s.n_kv_heads
    R = min(pf.select_queries, T)
    pick = torch.linspace(0, T - 1, R).round().long()  # [R]
    qs = store_rows(s, q[..., pick, :, :]).contiguous()
    picked = store.select(layer, qs, pf.blocks, "SEPARATE", [(0, s.ib), (lb, store.n_blocks(layer))], variants=var)
    recent = torch.arange(max(s.ib, lb - -(-T // s.block_size)), lb).expand(KVH, -1)  # [KVH, <= T / bs]
    blocks = torch.cat([picked.long(), recent], 1)
    big = torch.iinfo(torch.int64).max  # the -1 padding and the repeats sort last, then become -1
    blocks = blocks.masked_fill(blocks < 0, big).sort(dim=1).values
    blocks[:, 1:].masked_fill_(blocks[:, 1:] == blocks[:, :-1], big)
    blocks = blocks.sort(dim=1).values
    return blocks.masked_fill_(blocks == big, -1).to(torch.int32).contiguous()


# ---- the store's part of a decode step (off the native path) ----


def decode_context(s: Shape, store: KVStore, planner: DecodePlanner, layer: int, q: torch.Tensor,
                   lb: int, var: tuple[int, int] | None = None, out: torch.Tensor | None = None,
                   lse: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """q: [1, H, D] (with dual chunk attention's block bounds var: [3, 1, H, D]) -> (out [H, D], lse [H]) fp32
    on the CPU over the context blocks the planner says (into ``out`` / ``lse`` where given)."""
    qc = s.placement.to_host(q[..., 0, :, :].float()).contiguous()  # [H, D] or [3, H, D]
    blocks, select = planner.plan(layer, lb)
    if select is None:
        return store.attend(layer, qc, blocks, out, lse, variants=var)
    out, lse, ids = store.select_attend(layer, qc, select.k, select.mode, select.exclude_ranges, select.allowed,
                                        out, lse, ada_alpha=select.ada_alpha, variants=var, rerank=select.rerank)
    planner.record(layer, ids, lb)
    return out, lse
