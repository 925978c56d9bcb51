"""Which KV blocks a head may attend to: SnapKV preselection after prefill and Ada-KV per-head budgets.

SnapKV (Li et al. 2024): the queries of the last W prompt tokens score every context token by their
softmax attention, summed over the window and max-pooled over neighbouring tokens; summed per block,
the scores keep the top blocks of each KV head as the only candidates for decode-time selection.

Ada-KV (Feng et al. 2024): instead of the same number of blocks per KV head, a layer's total budget
follows where attention mass lies. All heads' block scores are ranked together; head i's share s_i of
the global top ``total`` is mixed with a uniform floor: b_i = s_i (1 - alpha) + alpha total / KVH.
``preselect_blocks`` uses it after prefill (Ada-SnapKV) and for decode-time Quest selection in
SEPARATE mode (non-candidate blocks scored -inf, ``count = second_select_num``).

Query head h reads KV head h // (H / KVH) (the grouping of ``repeat_interleave``), so a KV head's
score merges its query group by mean or max. The scores are the store's (``KVStore.snapkv_scores``,
cpp/select/snapkv.h: read in place, no fp32 copy of the keys); ``snapkv_token_scores`` and
``block_scores_from_tokens`` are their torch twin, in fp32, from a copy of the keys (the tests' reference). The
picks are torch; the budgets' split is the store's own (``ktquest.native.ada.ada_budgets``, cpp/select/ada.h).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Literal

import torch
import torch.nn.functional as F

from ktquest.native.ada import ada_budgets

if TYPE_CHECKING:
    from ktquest.config import LongContextConfig

GroupMerge = Literal["mean", "max"]

# Keys per chunk in snapkv_token_scores: the logits of a chunk are [H, W, chunk] fp32
# (32 heads x 32 queries x 4096 keys = 16 MiB).
SNAPKV_CHUNK = 4096


def merge_group_scores(scores: torch.Tensor, n_kv_heads: int, how: GroupMerge = "mean") -> torch.Tensor:
    """scores: [H, ...] per query head -> [KVH, ...]: mean or max over each KV head's query group."""
    H = scores.shape[0]
    if n_kv_heads < 1 or H % n_kv_heads != 0:
        raise ValueError(f"merge_group_scores: {H} query heads do not split into {n_kv_heads} KV heads")
    grouped = scores.reshape(n_kv_heads, H // n_kv_heads, *scores.shape[1:])  # [KVH, G, ...]
    if how == "mean":
        return grouped.mean(1)
    if how == "max":
        return grouped.amax(1)
    raise ValueError(f"merge_group_scores: how={how!r} is not allowed: 'mean' or 'max'")


def snapkv_token_scores(
    q_win: torch.Tensor,
    k: torch.Tensor,
    window_start_pos: int,
    pool_kernel: int = 7,
    gqa_merge: GroupMerge = "mean",
    scale: float | None = None,
    chunk_size: int = SNAPKV_CHUNK,
    variants: tuple[int, int] | None = None,
) -> torch.Tensor:
    """SnapKV scores of every context token.

    q_win: [W, H, D] queries of the window (after RoPE), query i at position window_start_pos + i.
    k:     [N, KVH, D] keys of positions 0..N-1 (after RoPE); the window lies inside: start + W <= N.
    Returns [KVH, N] fp32: for each query head, softmax(q k^T * scale) over the keys (query i sees keys
    0..start+i), summed over the W queries, max-pooled along tokens (``pool_kernel``, odd, stride 1,
    same length); then merged over each KV head's query group (``gqa_merge``). scale: 1/sqrt(D) if None.

    Keys are processed ``chunk_size`` at a time in two passes (the log-sum-exp of each query row, then
    the probabilities), so no [W, H, N] tensor exists; pooling runs on the assembled [H, N] scores.

    variants: dual chunk attention's token bounds (succ, intra) with q_win [3, W, H, D], the window's queries
    rotated intra, successive and inter (every query in one chunk): keys before succ are scored by the inter
    rotation, [succ, intra) by the successive one, the rest by the intra one (``KVStore.snapkv_scores``).
    """
    qv = None
    if variants is not None:
        qv, q_win = q_win, q_win[0]
    W, H, D = q_win.shape
    N, KVH, Dk = k.shape
    if Dk != D or KVH < 1 or H % KVH != 0:
        raise ValueError(f"snapkv_token_scores: q_win {tuple(q_win.shape)} and k {tuple(k.shape)} do not fit "
                         "[W, H, D] and [N, KVH, D] with H a multiple of KVH")
    if not (0 <= window_start_pos and window_start_pos + W <= N):
        raise ValueError(f"snapkv_token_scores: window_start_pos={window_start_pos} with W={W} must lie in "
                         f"[0, N - W] (N={N})")
    if pool_kernel < 1 or pool_kernel % 2 == 0:
        raise ValueError(f"snapkv_token_scores: pool_kernel={pool_kernel} is not allowed: "
                         "an odd integer >= 1")
    if chunk_size < 1:
        raise ValueError(f"snapkv_token_scores: chunk_size={chunk_size} is not allowed: an integer >= 1")
    G = H // KVH
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    def rows(qw: torch.Tensor) -> torch.Tensor:  # [W, H, D] -> [KVH, G * W, D] scaled
        return (qw.float() * scale).reshape(W, KVH, G, D).permute(1, 2, 0, 3).reshape(KVH, G * W, D)

    qs = [rows(q_win)] if qv is None else [rows(x) for x in qv]
    pos = window_start_pos + torch.arange(W, device=q_win.device)  # [W]
    bounds = [] if variants is None else [(0, variants[0], 2), (variants[0], variants[1], 1), (variants[1], N, 0)]

    def logits(c0: int, c1: int) -> torch.Tensor:  # [KVH, G, W, C], -inf where key > query position
        kc = k[c0:c1].float().permute(1, 2, 0)  # [KVH, D, C]
        if qv is None:
            s = torch.bmm(qs[0], kc).view(KVH, G, W, c1 - c0)
        else:  # each key by the rotation its chunk calls for
            s = torch.empty(KVH, G * W, c1 - c0, device=kc.device)
            for a, b, v in bounds:
                a, b = max(a, c0), min(b, c1)
                if b > a:
                    s[..., a - c0: b - c0] = torch.bmm(qs[v], kc[..., a - c0: b - c0])
            s = s.view(KVH, G, W, c1 - c0)
        if c1 - 1 > window_start_pos:  # only chunks reaching into the window have future keys
            future = torch.arange(c0, c1, device=q_win.device)[None, :] > pos[:, None]  # [W, C]
            s = s.masked_fill(future, float("-inf"))
        return s

    chunks = [(c0, min(c0 + chunk_size, N)) for c0 in range(0, N, chunk_size)]
    # Pass 1: lse[kvh, g, w] = log sum_j exp(logit[j]); every query sees key 0, so it ends finite.
    lse = torch.full((KVH, G, W), float("-inf"), device=q_win.device)
    for c0, c1 in chunks:
        lse = torch.logaddexp(lse, logits(c0, c1).logsumexp(-1))
    # Pass 2: probabilities chunk by chunk, summed over the window's queries.
    scores = torch.empty(KVH, G, N, device=q_win.device)  # [KVH, G, N]
    for c0, c1 in chunks:
        scores[..., c0:c1] = torch.exp(logits(c0, c1) - lse[..., None]).sum(2)
    pooled = F.max_pool1d(scores.view(H, N), pool_kernel, stride=1, padding=pool_kernel // 2)  # [H, N]
    return merge_group_scores(pooled, KVH, gqa_merge)


def block_scores_from_tokens(
    token_scores: torch.Tensor, block_size: int, n_blocks: int | None = None
) -> torch.Tensor:
    """token_scores: [KVH, N] -> [KVH, n_blocks], the sum over each block's tokens.

    n_blocks defaults to ceil(N / block_size) (a partial last block sums what it has); tokens past
    n_blocks * block_size are ignored and blocks past the tokens score 0.
    """
    if block_size < 1:
        raise ValueError(f"block_scores_from_tokens: block_size={block_size} is not allowed: an integer >= 1")
    KVH, N = token_scores.shape
    n_blocks = -(-N // block_size) if n_blocks is None else n_blocks
    if n_blocks < 0:
        raise ValueError(f"block_scores_from_tokens: n_blocks={n_blocks} is not allowed: an integer >= 0")
    t = token_scores[:, : n_blocks * block_size]
    t = F.pad(t, (0, n_blocks * block_size - t.shape[1]))
    return t.reshape(KVH, n_blocks, block_size).sum(-1)


def preselect_blocks(
    block_scores: torch.Tensor,
    count: int,
    ada: bool = False,
    alpha: float = 0.2,
    exclude: Sequence[tuple[int, int]] = (),
) -> list[torch.Tensor]:
    """The blocks each KV head keeps.  block_scores: [KVH, NB] (-inf = not a candidate).

    Returns KVH sorted LongTensors of block ids. Uniform: the top ``count`` blocks of each head;
    ``ada``: the top b_i of head i with b = ``ada_budgets(scores, count * KVH, alpha)``. Blocks in the
    half-open ranges ``exclude`` ([b0, b1): the sink and local windows, attended anyway) are never
    returned. A head with fewer candidates returns them all. Ties go to the lower block index.
    Decode-time Quest selection in SEPARATE mode is the same call with count = second_select_num.
    """
    if count < 0:
        raise ValueError(f"preselect_blocks: count={count} is not allowed: an integer >= 0")
    KVH, NB = block_scores.shape
    scores = block_scores.detach().float().clone()
    for b0, b1 in exclude:
        if not 0 <= b0 <= b1:
            raise ValueError(f"preselect_blocks: exclude range ({b0}, {b1}) is not allowed: 0 <= b0 <= b1")
        scores[:, b0:b1] = float("-inf")
    if ada:
        budgets = ada_budgets(scores, count * KVH, alpha).tolist()
    else:
        budgets = (scores != float("-inf")).sum(1).clamp(max=count).tolist()
    order = torch.sort(scores, dim=1, descending=True, stable=True).indices  # [KVH, NB]
    return [order[h, : budgets[h]].sort().values for h in range(KVH)]


def snapkv_preselect(block_scores: torch.Tensor, lc: LongContextConfig,
                     exclude: Sequence[tuple[int, int]] = ()) -> list[torch.Tensor]:
    """SnapKV (or Ada-SnapKV with ``lc.ada_budget``) candidates from SnapKV's block scores [KVH, NB] (the
    store's ``snapkv_scores``, or ``block_scores_from_tokens`` of ``snapkv_token_scores``), the knobs read from
    ``lc``: one sorted LongTensor of block ids per KV head, or one for all of them when ``lc.head_select_mode``
    is SHARED (the heads' block scores summed)."""
    if lc.head_select_mode == "SHARED":
        block_scores = block_scores.sum(0, keepdim=True)  # [1, NB]
    return preselect_blocks(block_scores, lc.preselect_block_count, lc.ada_budget, lc.ada_alpha, exclude)
