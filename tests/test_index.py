"""The hierarchical index (cpp/index/, cpp/select/pruned_select.cpp) against torch and against the flat scan.

Contracts: the index's group rows are the element-wise min / max of their blocks' anchor rows (through
appends, partial blocks and groups, truncates); a group's bound is at least the fp32 score the flat scan
gives each of its blocks; a store with ``index_group`` picks exactly the blocks (ids, order, ties) of the
same store without it, for every anchor type, head mode, group size, k, exclusion and kernel path; keys
with structure are pruned (fewer blocks scored than candidates).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_kv_store import ANCHOR_CASES

from ktquest import _C
from ktquest.config import ConfigError, LongContextConfig, load_config
from ktquest.kv.memory import store_bytes
from ktquest.native.store import KVStore

# ---- torch references ----


def f16_outward(x: torch.Tensor, up: bool) -> torch.Tensor:
    """x (fp32) rounded to fp16 toward +inf (up) or -inf, returned as fp32."""
    a = x.numpy()
    with np.errstate(over="ignore"):
        h = a.astype(np.float16)
    wrong = h.astype(np.float32) < a if up else h.astype(np.float32) > a
    h = np.where(wrong, np.nextafter(h, np.float16(np.inf if up else -np.inf)), h)
    return torch.from_numpy(h.astype(np.float32))


def ref_group_rows(anchors: torch.Tensor, counts: torch.Tensor, anchor_type: str, G: int) -> torch.Tensor:
    """The index's rows [KVH, ng, 2, D] from the stored anchors [KVH, nb, A, D] and counts [KVH, nb]: per group
    of G blocks the element-wise min then max over its valid anchor rows (QUEST: min of the min rows, max of
    the max rows), rounded to fp16 outward (min down, max up); a group without a valid anchor is (+inf,
    -inf)."""
    KVH, nb, A, D = anchors.shape
    ng = -(-nb // G)
    out = torch.empty(KVH, ng, 2, D)
    for h in range(KVH):
        for g in range(ng):
            blocks = range(g * G, min(nb, (g + 1) * G))
            if anchor_type == "QUEST":
                lo = torch.stack([anchors[h, b, 0] for b in blocks])
                hi = torch.stack([anchors[h, b, 1] for b in blocks])
            else:
                rows = [anchors[h, b, j] for b in blocks for j in range(int(counts[h, b]))]
                lo = hi = torch.stack(rows) if rows else None
            if lo is None:
                out[h, g, 0], out[h, g, 1] = float("inf"), float("-inf")
            else:
                out[h, g, 0], out[h, g, 1] = f16_outward(lo.min(0).values, False), f16_outward(hi.max(0).values, True)
    return out


def ref_group_bounds(q: torch.Tensor, rows: torch.Tensor, anchor_type: str, mode: str) -> torch.Tensor:
    """The groups' bounds in fp64 [n_sets, ng]: sum_d Q-_d gmin_d + Q+_d gmax_d per KV head (BLOCK_*: the sign
    split of the summed query; the others: the summed split of each query head), SHARED summed over heads."""
    KVH = rows.shape[0]
    qg = q.double().reshape(KVH, -1, q.shape[-1])  # [KVH, G, D]
    if anchor_type in ("BLOCK_MAX", "BLOCK_MEAN"):
        e = qg.sum(1)
        qn, qp = e.clamp(max=0), e.clamp(min=0)
    else:
        qn, qp = qg.clamp(max=0).sum(1), qg.clamp(min=0).sum(1)  # [KVH, D]
    r = rows.double()
    b = (r[:, :, 0] * qn[:, None]).sum(-1) + (r[:, :, 1] * qp[:, None]).sum(-1)  # [KVH, ng]
    return b.sum(0, keepdim=True) if mode == "SHARED" else b


# ---- helpers ----


def keys(kind: str, T: int, KVH: int, D: int, g: torch.Generator, scale: float = 1.0) -> torch.Tensor:
    """random: N(0, 1); structured: a mean that changes every 128 tokens plus small noise (groups of 128
    tokens differ, so bounds prune); ties: integers in {-1, 0, 1} and repeated tokens (many equal scores)."""
    if kind == "random":
        k = torch.randn(T, KVH, D, generator=g)
    elif kind == "structured":
        means = torch.randn(-(-T // 128), KVH, D, generator=g) * 2
        k = means.repeat_interleave(128, 0)[:T] + 0.3 * torch.randn(T, KVH, D, generator=g)
    else:
        k = torch.randint(-1, 2, (T, KVH, D), generator=g).float()
        k[T // 3: T // 3 + 40] = k[T // 3]  # 40 copies of one key: equal anchors, equal scores
    return k * scale


def twin_stores(G: int, KVH: int, D: int, cap: int, bs: int, kv_type: str, anchor_type: str, anchor_num: int,
                threads: int = 2) -> list[KVStore]:
    """[flat, indexed]: the same store without and with an index of G blocks per group."""
    return [KVStore(1, KVH, D, cap, block_size=bs, kv_type=kv_type, anchor_type=anchor_type, anchor_num=anchor_num,
                    threads_num=threads, index_group=ig) for ig in (0, G)]


def append(stores, k: torch.Tensor, imp: torch.Tensor | None) -> None:
    for s in stores:
        s.append(0, k, k, imp)


def check_rows(store: KVStore, anchor_type: str, G: int) -> None:
    anchors, counts = store.anchors(0)
    assert torch.equal(store.bounds(0), ref_group_rows(anchors, counts, anchor_type, G))


def check_picks(flat: KVStore, idx: KVStore, q: torch.Tensor, mode: str, excl, ks) -> int:
    """Every k of ks: the indexed store's picks are the flat store's. Returns the blocks the index scored."""
    scored = 0
    for k in ks:
        want = flat.select(0, q, k, mode, exclude_ranges=excl)
        got = idx.select(0, q, k, mode, exclude_ranges=excl)
        assert torch.equal(got, want), (mode, k, excl)
        scored += idx.last_index_stats()["blocks_scored"]
    return scored


def check_bounds(store: KVStore, q: torch.Tensor, mode: str, G: int) -> None:
    """Every group's bound is >= the fp32 score of each of its blocks (no slack), and within the rounding
    margin of the fp64 bound of the group's rows."""
    scores = store.block_scores(0, q, mode).reshape(-1, store.n_blocks(0)).double()  # [n_sets, nb]
    bounds = store.group_bounds(0, q, mode).reshape(scores.shape[0], -1)  # [n_sets, ng]
    member = bounds.repeat_interleave(G, 1)[:, : scores.shape[1]]  # each block's group bound
    assert bool((member >= scores).all()), (member - scores).min()
    rows = store.bounds(0)
    ref = ref_group_bounds(q, rows, store.anchor_type, mode)
    finite = rows.isfinite().all(-1).all(-1)  # [KVH, ng]: groups with anchors
    finite = finite.all(0, keepdim=True) if mode == "SHARED" else finite
    mag = (q.double().abs().reshape(rows.shape[0], -1, q.shape[-1]).sum(1)[:, None]
           * rows.double().abs().amax(2)).sum(-1)  # [KVH, ng] sum_d W_d max(|gmin_d|, |gmax_d|)
    mag = mag.sum(0, keepdim=True) if mode == "SHARED" else mag
    over = (bounds - ref)[finite]
    assert bool((over >= 0).all()) and bool((over <= 1e-4 * mag[finite] + 1e-30).all())


# ---- group rows and bounds ----


@pytest.mark.parametrize("anchor_type,anchor_num", ANCHOR_CASES)
@pytest.mark.parametrize("kv_type", ["FP16", "FP32", "Q8_0"])
@pytest.mark.parametrize("G", [1, 3, 32])
def test_group_rows_follow_appends_and_truncates(anchor_type, anchor_num, kv_type, G):
    """Prefill chunks, single tokens into a partial block, truncates inside a block and at a block edge that
    leave the last group partial (DYNAMIC: blocks that lose every anchor), then appends again."""
    KVH, D, bs = 2, 32, 4
    g = torch.Generator().manual_seed(G)
    k, imp = keys("random", 700, KVH, D, g), torch.randint(0, 4, (700, KVH), generator=g).float()
    if kv_type == "FP32":
        k[50:53] *= 1e5  # past fp16's range: rows of -inf / +inf
    imp = imp if anchor_type == "DYNAMIC" else None
    store = KVStore(1, KVH, D, 700, block_size=bs, kv_type=kv_type, anchor_type=anchor_type, anchor_num=anchor_num,
                    index_group=G)
    t = 0
    for n, cut in [(301, None), (1, None), (1, None), (97, 203), (1, None), (150, 196), (7, 1), (0, 0), (100, None)]:
        store.append(0, k[t: t + n], k[t: t + n], None if imp is None else imp[t: t + n])
        t += n
        check_rows(store, anchor_type, G)
        if cut is not None:
            store.truncate(0, cut)
            t = cut
            check_rows(store, anchor_type, G)
    assert store.n_groups(0) == -(-store.n_blocks(0) // G)


@settings(max_examples=60, deadline=None)
@given(
    case=st.sampled_from(ANCHOR_CASES),
    KVH=st.integers(1, 3),
    qg=st.integers(1, 3),
    D=st.sampled_from([8, 12, 32]),
    bs=st.integers(1, 9),
    T=st.integers(1, 200),
    G=st.integers(1, 9),
    kv_type=st.sampled_from(["FP32", "FP16", "BF16"]),
    scale=st.sampled_from([1e-3, 1.0, 300.0, 1e5]),  # 1e5: past fp16, rows of +-inf (no bound)
    kind=st.sampled_from(["random", "structured", "ties"]),
    seed=st.integers(0, 2**16),
    scalar=st.booleans(),
)
def test_group_bound_covers_every_member_score(case, KVH, qg, D, bs, T, G, kv_type, scale, kind, seed, scalar):
    anchor_type, anchor_num = case
    anchor_num = min(anchor_num, bs) if anchor_type in ("FIXED", "DYNAMIC") else anchor_num
    kv_type = "FP32" if scale > 1e4 and kv_type == "FP16" else kv_type  # the FP16 store refuses such keys
    g = torch.Generator().manual_seed(seed)
    store = KVStore(1, KVH, D, T, block_size=bs, kv_type=kv_type, anchor_type=anchor_type, anchor_num=anchor_num,
                    index_group=G)
    store.append(0, keys(kind, T, KVH, D, g, scale), torch.zeros(T, KVH, D), torch.rand(T, KVH, generator=g))
    _C.set_force_scalar(scalar)
    try:
        for mode in ("SEPARATE", "SHARED"):
            check_bounds(store, torch.randn(KVH * qg, D, generator=g) * scale, mode, G)
    finally:
        _C.set_force_scalar(False)


# ---- picks: the flat scan's ----


@pytest.mark.parametrize("anchor_type,anchor_num", ANCHOR_CASES)
@pytest.mark.parametrize("mode", ["SEPARATE", "SHARED"])
@pytest.mark.parametrize("G", [1, 2, 7, 32])
def test_indexed_picks_equal_flat_picks(force_scalar, anchor_type, anchor_num, mode, G):
    """Random, structured and tied keys; k from 1 to past the candidates; no exclusion, the init and local
    windows excluded (as a decode step does), a range in the middle; a partial last block and group; single
    tokens, a truncate inside a block and another at a group's edge, then more appends."""
    KVH, qg, D, bs = 3, 3, 32, 4
    kv_type = "FP16" if G in (1, 7) else "FP32"  # fp16 (linear) anchors and fp32 ones
    g = torch.Generator().manual_seed(G * 10 + len(mode))
    flat, idx = stores = twin_stores(G, KVH, D, 2048, bs, kv_type, anchor_type, anchor_num)
    scored = candidates = 0
    for kind in ("random", "structured", "ties"):
        for s in stores:
            s.truncate(0, 0)
        k = keys(kind, 1200, KVH, D, g)
        imp = torch.randint(0, 4, (1200, KVH), generator=g).float() if anchor_type == "DYNAMIC" else None
        t = 0
        for n, cut in [(603, None), (1, None), (2, 411), (5, None), (190, 4 * bs * G + 8), (301, None)]:
            append(stores, k[t: t + n], None if imp is None else imp[t: t + n])
            t += n
            if cut is not None:
                for s in stores:
                    s.truncate(0, cut)
                t = cut
            nb = flat.n_blocks(0)
            for excl in ([], [(0, 2), (max(0, nb - 16), nb + 5)], [(nb // 3, nb // 2)]):
                n_cand = len([b for b in range(nb) if not any(b0 <= b < b1 for b0, b1 in excl)])
                q = keys(kind, KVH * qg, 1, D, g)[:, 0] + 0.1 * torch.randn(KVH * qg, D, generator=g)
                scored += check_picks(flat, idx, q, mode, excl, [1, 2, 5, 17, max(0, n_cand - 1), n_cand, n_cand + 3])
                candidates += 7 * n_cand * (1 if mode == "SHARED" else KVH)
    assert scored < candidates  # the index pruned somewhere


@pytest.mark.parametrize("mode", ["SEPARATE", "SHARED"])
@pytest.mark.parametrize("centre", [0.5, 1.0])
def test_indexed_picks_with_quest_centre_equal_flat_picks(force_scalar, mode, centre):
    """QUEST scored with a centre share (below the bound): the group bounds still bound every score, and the
    index picks what the flat scan picks."""
    KVH, qg, D, bs, G = 3, 3, 32, 4, 8
    g = torch.Generator().manual_seed(7)
    flat, idx = stores = [KVStore(1, KVH, D, 2048, block_size=bs, kv_type="FP16", threads_num=2, index_group=ig,
                                  quest_centre=centre) for ig in (0, G)]
    scored = candidates = 0
    for kind in ("random", "structured", "ties"):
        for s in stores:
            s.truncate(0, 0)
        append(stores, keys(kind, 1200, KVH, D, g), None)
        nb = flat.n_blocks(0)
        for excl in ([], [(0, 2), (nb - 16, nb)]):
            n_cand = nb - sum(b1 - b0 for b0, b1 in excl)
            q = keys(kind, KVH * qg, 1, D, g)[:, 0] + 0.1 * torch.randn(KVH * qg, D, generator=g)
            check_bounds(idx, q, mode, G)
            scored += check_picks(flat, idx, q, mode, excl, [1, 5, 17, n_cand - 1, n_cand])
            candidates += 5 * n_cand * (1 if mode == "SHARED" else KVH)
    assert scored < candidates  # the index pruned somewhere


@pytest.mark.parametrize("mode", ["SEPARATE", "SHARED"])
def test_indexed_picks_with_per_head_k_and_threads(force_scalar, mode):
    """Per-head k (Ada-KV's decode budgets), and 1 or 3 threads: the same ids as the flat scan on 2."""
    KVH, qg, D, bs, G = 3, 3, 64, 8, 16
    g = torch.Generator().manual_seed(3)
    k = keys("structured", 20000, KVH, D, g)
    flat = KVStore(1, KVH, D, 20000, block_size=bs, threads_num=2)
    flat.append(0, k, k)
    for threads in (1, 3):
        idx = KVStore(1, KVH, D, 20000, block_size=bs, threads_num=threads, index_group=G)
        idx.append(0, k, k)
        for ks in ([128, 128, 128], [0, 300, 7], [2500, 1, 40]):
            ks = ks if mode == "SEPARATE" else ks[1]
            q = k[torch.randint(0, 20000, (1,), generator=g)].reshape(KVH, 1, D).expand(KVH, qg, D).reshape(-1, D)
            check_picks(flat, idx, q + 0.1 * torch.randn(KVH * qg, D, generator=g), mode, [(0, 2), (2400, 2500)], [ks])


@pytest.mark.parametrize("mode", ["SEPARATE", "SHARED"])
def test_indexed_picks_over_many_blocks(force_scalar, mode):
    """150,000 one-token blocks: the walk's second phase splits a set into several chunks, each with its own
    top k, merged at the end; picks still equal the flat scan's (ties included)."""
    KVH, qg, D, T = 2, 2, 8, 150_000
    g = torch.Generator().manual_seed(12)
    for kind in ("random", "ties"):
        k = keys(kind, T, KVH, D, g)
        for G in (1, 3):
            flat, idx = twin_stores(G, KVH, D, T, 1, "FP32", "QUEST", 2)
            append((flat, idx), k, None)
            q = keys(kind, KVH * qg, 1, D, g)[:, 0]
            check_picks(flat, idx, q, mode, [(0, 16), (T - 512, T)], [1, 50, 3000])


def test_structured_keys_are_pruned():
    """A query like the keys of one stretch of a context whose stretches line up with the groups: most
    groups' bounds fall below the k-th best score, so far fewer blocks are scored than there are candidates
    (the same picks)."""
    KVH, qg, D, bs, G = 3, 3, 64, 8, 16
    g = torch.Generator().manual_seed(4)
    k = keys("structured", 32768, KVH, D, g)
    flat, idx = twin_stores(G, KVH, D, 32768, bs, "FP16", "QUEST", 2)
    append((flat, idx), k, None)
    q = (k[5000].reshape(KVH, 1, D) * 2).expand(KVH, qg, D).reshape(-1, D)
    check_picks(flat, idx, q, "SEPARATE", [(0, 2), (4032, 4096)], [128])
    stats = idx.last_index_stats()
    assert stats["groups"] == 3 * 256 and stats["candidates"] == 3 * (4096 - 66)
    assert stats["blocks_scored"] < stats["candidates"] // 3, stats
    assert flat.last_index_stats() == {"groups": 0, "blocks_scored": 3 * 4030, "candidates": 3 * 4030}
    # set_walk_index(False): the indexed store scans every block as the flat one does (the same picks), and
    # walks its index again when turned back on
    idx.set_walk_index(False)
    check_picks(flat, idx, q, "SEPARATE", [(0, 2), (4032, 4096)], [128])
    assert idx.last_index_stats() == flat.last_index_stats()
    idx.set_walk_index(True)
    check_picks(flat, idx, q, "SEPARATE", [(0, 2), (4032, 4096)], [128])
    assert idx.last_index_stats() == stats


def test_candidate_lists_stay_flat():
    """A selection over candidate lists (SnapKV) scores the candidates as without an index: same picks."""
    KVH, D, bs = 3, 64, 8
    g = torch.Generator().manual_seed(6)
    k = keys("structured", 4000, KVH, D, g)
    flat, idx = twin_stores(4, KVH, D, 4000, bs, "FP16", "QUEST", 2)
    append((flat, idx), k, None)
    allowed = [sorted(torch.randperm(500, generator=g)[:120].tolist()) for _ in range(KVH)]
    for _ in range(3):
        q = torch.randn(9, D, generator=g)
        want = flat.select(0, q, 16, allowed=allowed)
        assert torch.equal(idx.select(0, q, 16, allowed=allowed), want)
        out, lse, ids = idx.select_attend(0, q, 16, allowed=allowed)
        assert torch.equal(ids, want)


def test_select_attend_through_the_index_is_select_then_attend():
    KVH, D, bs = 3, 64, 8
    g = torch.Generator().manual_seed(8)
    k = keys("structured", 6000, KVH, D, g)
    flat, idx = twin_stores(8, KVH, D, 6000, bs, "FP16", "QUEST", 2)
    append((flat, idx), k, None)
    q = torch.randn(9, D, generator=g)
    for mode in ("SEPARATE", "SHARED"):
        out, lse, ids = idx.select_attend(0, q, 32, mode, exclude_ranges=[(0, 2)])
        out2, lse2, ids2 = flat.select_attend(0, q, 32, mode, exclude_ranges=[(0, 2)])
        assert torch.equal(ids, ids2) and torch.equal(out, out2) and torch.equal(lse, lse2)


# ---- memory and errors ----


@pytest.mark.parametrize("G", [1, 5, 64])
def test_bytes_count_the_group_bounds(G):
    """store_bytes (the DRAM check before allocation) and nbytes count the index: KVH x groups x 2 x D fp16."""
    KVH, D, bs, cap = 3, 64, 8, 10_000
    args = (2, KVH, D, cap, bs, "FP16", "QUEST", 2)
    max_groups = -(-(cap // bs) // G)
    assert _C.store_bytes(*args, G) - _C.store_bytes(*args) == 2 * KVH * max_groups * 2 * D * 2
    flat, idx = (KVStore(2, KVH, D, cap, block_size=bs, index_group=ig) for ig in (0, G))
    for s in (flat, idx):
        s.append(1, torch.randn(1001, KVH, D), torch.randn(1001, KVH, D))
    assert idx.nbytes() - flat.nbytes() == KVH * -(-126 // G) * 2 * D * 2
    # the long_context cache's fit check counts what a full store of its config holds
    lc = LongContextConfig(block_size=bs, kv_type="FP16", index_group=G)
    full = KVStore(1, KVH, D, 1000, block_size=bs, index_group=G)
    full.append(0, torch.randn(1000, KVH, D), torch.randn(1000, KVH, D))
    assert store_bytes(lc, 1, KVH, D, 1000) == full.nbytes()


def test_bad_index_group_is_a_clear_error():
    assert LongContextConfig().index_group == 0  # the flat scan by default
    assert load_config(overrides=["index_group=16"]).long_context.index_group == 16
    for value, msg in [(-1, r"long_context.index_group=-1 is not allowed: an integer >= 0 \(0 = no index\)"),
                       ("8", r"long_context.index_group='8' has the wrong type: expected int"),
                       (2.0, r"long_context.index_group=2.0 has the wrong type: expected int"),
                       (True, r"long_context.index_group=True has the wrong type: expected int")]:
        with pytest.raises(ConfigError, match=msg):
            load_config(overrides=[("long_context.index_group", value)])
    with pytest.raises(ConfigError, match=r"--set.*long_context.index_group=-4 is not allowed"):
        load_config(overrides=["long_context.index_group=-4"])
    with pytest.raises(ValueError, match=r"index_group=-1 is not allowed: an integer >= 0"):
        KVStore(1, 1, 64, 64, index_group=-1)
    with pytest.raises(ValueError, match="index_group"):
        KVStore(1, 1, 64, 64, index_group=2.5)
    with pytest.raises(ValueError, match=r"index_group must be >= 0 .*got -3"):
        _C.KVStore(1, 1, 64, 64, 16, "FP16", "QUEST", 2, 1, False, -3)
    with pytest.raises(ValueError, match=r"index_group must be >= 0"):
        _C.store_bytes(1, 1, 64, 64, 16, "FP16", "QUEST", 2, -1)
    flat = KVStore(1, 1, 64, 64)
    flat.append(0, torch.randn(9, 1, 64), torch.randn(9, 1, 64))
    with pytest.raises(ValueError, match=r"no hierarchical index \(index_group=0\)"):
        flat.bounds(0)
    with pytest.raises(ValueError, match="no hierarchical index"):
        flat.group_bounds(0, torch.randn(1, 64))
