"""The store's second stage of selection (``rerank``, cpp/kvstore/rerank.h) against a torch reference.

With rerank R > 1 the anchors pick R k blocks of each set (the selection of rerank 1 with R k), each pick is
weighed by its attention mass for the query (its own log-sum-exp per query head, as a share of the head's over
the set's picks, summed over the set's heads), and the k heaviest are kept (equal masses: the lower id); with
Ada-KV the budget is split by those masses (ada_budgets). The reference computes the masses from the
attention's own block LSEs (``attend(with_block_lse=True)``) of the first stage's picks.
"""

from __future__ import annotations

import pytest
import torch
from test_selection import ada_budgets_reference
from test_sparse_attention import FP32_ATOL, FP32_RTOL, rows_of

from ktquest import _C
from ktquest.native.store import KVStore

KVH, G, D, BS = 3, 2, 64, 8
H = KVH * G


def stores(T: int, R: int, kv_type="FP16", seed=0, **kw):
    """A store with rerank=R and its twin with rerank 1, the same T tokens; q [H, D]."""
    g = torch.Generator().manual_seed(seed)
    k, v = torch.randn(T, KVH, D, generator=g), torch.randn(T, KVH, D, generator=g)
    made = [KVStore(1, KVH, D, T + 64, block_size=BS, kv_type=kv_type, threads_num=2, rerank=r, **kw) for r in (R, 1)]
    for st in made:
        st.append(0, k, v)
    return made[0], made[1], torch.randn(H, D, generator=g) * 2


def masses(plain: KVStore, q, first: torch.Tensor, mode: str, variants=None) -> list[list[tuple[float, int]]]:
    """Each set's (mass, id) of the first stage's picks."""
    rows = rows_of(first, KVH)
    full = first if first.dim() == 2 else first[None].expand(KVH, -1)
    _, _, bl = plain.attend(0, q, full.contiguous(), with_block_lse=True, variants=variants)  # [KVH, cols, G]
    bl = bl.double()
    if mode == "SHARED":  # one set: every query head, each against its KV head's tile of the pick
        n = len(rows[0])
        lse = bl[:, :n, :].permute(1, 0, 2).reshape(n, H)  # [picks, H]
        sets = [(rows[0], lse)]
    else:
        sets = [(rows[h], bl[h, : len(rows[h]), :]) for h in range(KVH)]
    out = []
    for ids, lse in sets:
        share = torch.exp(lse - torch.logsumexp(lse, 0, keepdim=True)).sum(-1) if ids else torch.zeros(0)
        out.append([(float(share[j]), b) for j, b in enumerate(ids)])
    return out


def reference(plain: KVStore, q, k: int, R: int, mode="SEPARATE", excl=(), allowed=None, ada=None, variants=None):
    """The second stage's picks, per set, ascending."""
    first = plain.select(0, q, k * R, mode, excl, allowed, ada_alpha=ada, variants=variants)
    m = masses(plain, q, first, mode, variants)
    keep = [k] * len(m)
    if ada is not None:
        scores = torch.full((len(m), plain.n_blocks(0)), float("-inf"))
        for s, row in enumerate(m):
            for j, (w, _) in enumerate(row):
                scores[s, j] = w
        keep = ada_budgets_reference(scores, k * len(m), ada).tolist()
    return [sorted(b for _, b in sorted(row, key=lambda x: (-x[0], x[1]))[: keep[s]]) for s, row in enumerate(m)]


@pytest.mark.parametrize("kv_type", ["FP32", "FP16", "BF16", "Q8_0", "Q4_0"])
@pytest.mark.parametrize("mode", ["SEPARATE", "SHARED"])
def test_picks_match_the_reference(force_scalar, kv_type, mode):
    T = 1003  # a partial last block
    st, plain, q = stores(T, 4, kv_type)
    nb = st.n_blocks(0)
    excl = [(0, 1), (nb - 4, nb)]
    for k in (1, 5, 12):
        got = rows_of(st.select(0, q, k, mode, excl), KVH)
        want = reference(plain, q, k, 4, mode, excl)
        assert got[: len(want)] == want
        assert all(len(r) == k for r in want)
    # The second stage changes the picks (else this test shows nothing): not the anchors' top k.
    assert rows_of(st.select(0, q, 5, mode, excl), KVH) != rows_of(plain.select(0, q, 5, mode, excl), KVH)


def test_select_attend_attends_the_picks_and_reports_the_stage():
    st, plain, q = stores(2000, 3)
    excl = [(0, 2), (240, 250)]
    out, lse, ids = st.select_attend(0, q, 10, "SEPARATE", excl)
    assert ids.tolist() == [sorted(r) for r in reference(plain, q, 10, 3, "SEPARATE", excl)]
    o2, l2 = plain.attend(0, q, ids)
    torch.testing.assert_close(out, o2, rtol=FP32_RTOL, atol=FP32_ATOL)
    torch.testing.assert_close(lse, l2, rtol=FP32_RTOL, atol=FP32_ATOL)
    t = st.last_timing()
    assert t["rerank_ms"] > 0 and plain.last_timing()["rerank_ms"] == 0


def test_more_attention_mass_than_the_anchors_alone():
    """What the stage is for: of the same number of blocks, its picks hold at least the anchors' mass."""
    st, plain, q = stores(4000, 4, "FP32", seed=3)
    nb = st.n_blocks(0)
    every = torch.arange(nb, dtype=torch.int32)[None].expand(KVH, -1).contiguous()
    _, lse_all, bl = plain.attend(0, q, every, with_block_lse=True)  # each block's share of the whole context
    share = torch.exp(bl.double() - lse_all.double().reshape(KVH, 1, G)).sum(-1)  # [KVH, nb]

    def held(ids):
        return sum(float(share[h, b]) for h, r in enumerate(rows_of(ids, KVH)) for b in r)

    for k in (4, 16):
        assert held(st.select(0, q, k)) > held(plain.select(0, q, k))


def test_ada_splits_the_budget_by_mass():
    st, plain, q = stores(1500, 2)
    got = rows_of(st.select(0, q, 6, "SEPARATE", [(0, 1)], ada_alpha=0.2), KVH)
    want = reference(plain, q, 6, 2, "SEPARATE", [(0, 1)], ada=0.2)
    assert got == want and sum(map(len, got)) == 18
    _, _, ids = st.select_attend(0, q, 6, "SEPARATE", [(0, 1)], ada_alpha=0.2)
    assert rows_of(ids, KVH) == want


@pytest.mark.parametrize("int8", [False, True])
def test_candidate_lists_through_the_cache(int8):
    """SnapKV's candidates: the first stage over the candidate copy, the second over the store's tiles."""
    st, plain, q = stores(3000, 4, int8_candidates=int8)
    g = torch.Generator().manual_seed(5)
    allowed = torch.stack([torch.randperm(370, generator=g)[:120].sort().values for _ in range(KVH)]).int()
    for _ in range(2):  # the second call is served by the layer's cached copy
        want = reference(plain, q, 8, 4, "SEPARATE", (), allowed)
        assert rows_of(st.select(0, q, 8, "SEPARATE", (), allowed), KVH) == want
        out, lse, ids = st.select_attend(0, q, 8, "SEPARATE", (), allowed)
        assert rows_of(ids, KVH) == want
        o2, l2 = plain.attend(0, q, ids)
        torch.testing.assert_close(out, o2, rtol=FP32_RTOL, atol=FP32_ATOL)
        torch.testing.assert_close(lse, l2, rtol=FP32_RTOL, atol=FP32_ATOL)
    # Every candidate kept (k >= candidates): no second stage, the same as rerank 1.
    assert torch.equal(st.select(0, q, 120, "SEPARATE", (), allowed), plain.select(0, q, 120, "SEPARATE", (), allowed))
    assert st.last_timing()["rerank_ms"] == 0


def test_dual_chunk_rotations():
    st, plain, _ = stores(1200, 3)
    q3 = torch.randn(3, H, D, generator=torch.Generator().manual_seed(2))
    var = (40, 100)  # blocks before 40: inter, [40, 100): successive, from 100: intra
    got = rows_of(st.select(0, q3, 9, "SEPARATE", variants=var), KVH)
    assert got == reference(plain, q3, 9, 3, "SEPARATE", variants=var)


def test_threads_do_not_change_the_picks():
    T = 5000
    g = torch.Generator().manual_seed(7)
    k, v, q = torch.randn(T, KVH, D, generator=g), torch.randn(T, KVH, D, generator=g), torch.randn(H, D, generator=g)
    picks = []
    for threads in (1, 2, 4):
        st = KVStore(1, KVH, D, T, block_size=BS, threads_num=threads, rerank=8)
        st.append(0, k, v)
        picks.append(st.select(0, q, 40))
    assert torch.equal(picks[0], picks[1]) and torch.equal(picks[0], picks[2])


def test_set_rerank_and_bad_values():
    st, plain, q = stores(800, 1)
    assert torch.equal(st.select(0, q, 7), plain.select(0, q, 7))
    st.set_rerank(4)
    assert st.rerank == 4 and rows_of(st.select(0, q, 7), KVH) == reference(plain, q, 7, 4)
    for bad in (0, _C.MAX_RERANK + 1):
        with pytest.raises(ValueError, match="rerank"):
            st.set_rerank(bad)
        with pytest.raises(ValueError, match="rerank"):
            KVStore(1, KVH, D, 64, rerank=bad)
