"""The store's second stage of selection (``rerank``, cpp/kvstore/rerank.h) against a torch reference.

With rerank R > 1 the anchors pick R k blocks of each set (the selection of rerank 1 with R k), each pick is
weighed by its attention mass for the query (its own log-sum-exp per query head, as a share of the head's over
the set's picks, summed over the set's heads), and the k heaviest are kept (equal masses: the lower id); with
Ada-KV the budget is split by those masses (ada_budgets). The reference computes the masses in torch (fp64)
from the store's dequantised keys.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from test_selection import ada_budgets_reference
from test_sparse_attention import FP32_ATOL, FP32_RTOL, rows_of

from ktquest import _C
from ktquest.native.store import KVStore

KVH, G, D, BS = 3, 2, 64, 8
H = KVH * G


def make(T: int, kv_type="FP16", seed=0, kvh=KVH, g_=G, **kw):
    """A store of T random tokens, and a query [kvh * g_, D]."""
    g = torch.Generator().manual_seed(seed)
    st = KVStore(1, kvh, D, T + 64, block_size=BS, kv_type=kv_type, threads_num=2, **kw)
    st.append(0, torch.randn(T, kvh, D, generator=g), torch.randn(T, kvh, D, generator=g))
    return st, torch.randn(kvh * g_, D, generator=g) * 2


def ref_masses(store: KVStore, q, first: torch.Tensor, mode: str, variants=None) -> list[list[tuple[float, int]]]:
    """Each set's (mass, id) of the first stage's picks, in torch (fp64) from the store's dequantised keys: a pick's
    LSE per query head, as a share of the head's over the set's picks, summed over the set's query heads."""
    ks, _ = store.read(0)  # [T, KVH, D]
    T, kvh, d = ks.shape
    qs = q.double() / math.sqrt(d)
    g_ = q.shape[-2] // kvh
    rows = rows_of(first, kvh)

    def lse(h: int, b: int) -> torch.Tensor:  # [G] the pick's own LSE per query head of KV head h
        v = 0 if variants is None or b >= variants[1] else 1 if b >= variants[0] else 2
        qh = (qs[v] if q.dim() == 3 else qs)[h * g_: (h + 1) * g_]
        bs = store.block_size
        return torch.logsumexp(qh @ ks[b * bs: min(T, (b + 1) * bs), h].double().T, -1)

    if mode == "SHARED":  # one set: every query head, each against its KV head's tile of the pick
        sets = [(rows[0], [torch.cat([lse(h, b) for h in range(kvh)]) for b in rows[0]])]
    else:
        sets = [(rows[h], [lse(h, b) for b in rows[h]]) for h in range(kvh)]
    out = []
    for ids, ls in sets:
        if not ids:
            out.append([])
            continue
        m = torch.stack(ls)  # [picks, heads]
        share = torch.exp(m - torch.logsumexp(m, 0, keepdim=True)).sum(-1)
        out.append([(float(share[j]), b) for j, b in enumerate(ids)])
    return out


def reference(store: KVStore, q, k: int, R: int, mode="SEPARATE", excl=(), allowed=None, ada=None, variants=None):
    """The second stage's picks, per set, ascending (the first stage: the store's own selection of R k)."""
    first = store.select(0, q, k * R, mode, excl, allowed, ada_alpha=ada, variants=variants)
    m = ref_masses(store, q, first, mode, variants)
    keep = [k] * len(m)
    if ada is not None:
        scores = torch.full((len(m), store.n_blocks(0)), float("-inf"))
        for s, row in enumerate(m):
            for j, (w, _) in enumerate(row):
                scores[s, j] = w
        keep = ada_budgets_reference(scores, k * len(m), ada).tolist()
    return [sorted(b for _, b in sorted(row, key=lambda x: (-x[0], x[1]))[: keep[s]]) for s, row in enumerate(m)]


@pytest.mark.parametrize("kv_type", ["FP32", "FP16", "BF16", "Q8_0", "Q4_0"])
@pytest.mark.parametrize("mode", ["SEPARATE", "SHARED"])
def test_picks_match_the_reference(force_scalar, kv_type, mode):
    T = 1003  # a partial last block (3 rows), made heavy: keys along each KV head's queries
    st, q = make(T, kv_type)
    ks, vs = st.read(0)
    ks[-3:] = q.view(KVH, G, D).sum(1)
    st.truncate(0, 0)
    st.append(0, ks, vs)
    nb = st.n_blocks(0)
    excl = [(0, 1), (nb - 20, nb - 2)]
    for k in (1, 5, 12):
        got = rows_of(st.select(0, q, k, mode, excl, rerank=4), KVH)
        want = reference(st, q, k, 4, mode, excl)
        assert got[: len(want)] == want
        assert all(len(r) == k for r in want)
    assert all(nb - 1 in r for r in got)  # the partial block is weighed (and kept)
    # The second stage changes the picks (else this test shows nothing): not the anchors' top k.
    assert rows_of(st.select(0, q, 5, mode, excl, rerank=4), KVH) != rows_of(st.select(0, q, 5, mode, excl), KVH)


@pytest.mark.parametrize("kvh,g_", [(1, 9), (2, 13), (1, 1)])
def test_query_groups_past_eight_heads(force_scalar, kvh, g_):
    """The AVX2 kernel takes a KV head's query heads 8 at a time: groups of 9, 13 and 1."""
    st, q = make(700, "FP16", seed=4, kvh=kvh, g_=g_)
    for mode in ("SEPARATE", "SHARED"):
        got = rows_of(st.select(0, q, 6, mode, [(0, 1)], rerank=3), kvh)
        assert got[: (1 if mode == "SHARED" else kvh)] == reference(st, q, 6, 3, mode, [(0, 1)])


def test_select_attend_attends_the_picks_and_reports_the_stage():
    st, q = make(2000)
    excl = [(0, 2), (240, 250)]
    out, lse, ids = st.select_attend(0, q, 10, "SEPARATE", excl, rerank=3)
    assert st.last_timing()["rerank_ms"] > 0
    assert ids.tolist() == reference(st, q, 10, 3, "SEPARATE", excl)
    o2, l2 = st.attend(0, q, ids)
    torch.testing.assert_close(out, o2, rtol=FP32_RTOL, atol=FP32_ATOL)
    torch.testing.assert_close(lse, l2, rtol=FP32_RTOL, atol=FP32_ATOL)
    st.select_attend(0, q, 10, "SEPARATE", excl)
    assert st.last_timing()["rerank_ms"] == 0


def test_more_attention_mass_than_the_anchors_alone():
    """What the stage is for: of the same number of blocks, its picks hold at least the anchors' mass."""
    st, q = make(4000, "FP32", seed=3)
    nb = st.n_blocks(0)
    every = torch.arange(nb, dtype=torch.int32)[None].expand(KVH, -1).contiguous()
    _, lse_all, bl = st.attend(0, q, every, with_block_lse=True)  # each block's share of the whole context
    share = torch.exp(bl.double() - lse_all.double().reshape(KVH, 1, G)).sum(-1)  # [KVH, nb]

    def held(ids):
        return sum(float(share[h, b]) for h, r in enumerate(rows_of(ids, KVH)) for b in r)

    for k in (4, 16):
        assert held(st.select(0, q, k, rerank=4)) > held(st.select(0, q, k))


def test_ada_splits_the_budget_by_mass():
    st, q = make(1500)
    got = rows_of(st.select(0, q, 6, "SEPARATE", [(0, 1)], ada_alpha=0.2, rerank=2), KVH)
    want = reference(st, q, 6, 2, "SEPARATE", [(0, 1)], ada=0.2)
    assert got == want and sum(map(len, got)) == 18
    assert [len(r) for r in got] != [6, 6, 6]  # (split unevenly: else Ada-KV shows nothing here)
    _, _, ids = st.select_attend(0, q, 6, "SEPARATE", [(0, 1)], ada_alpha=0.2, rerank=2)
    assert rows_of(ids, KVH) == want


@pytest.mark.parametrize("int8", [False, True])
def test_candidate_lists_through_the_cache(int8):
    """SnapKV's candidates: the first stage over the candidate copy, the second over the store's tiles."""
    st, q = make(3000, int8_candidates=int8)
    g = torch.Generator().manual_seed(5)
    allowed = torch.stack([torch.randperm(370, generator=g)[:120].sort().values for _ in range(KVH)]).int()
    for _ in range(2):  # the second call is served by the layer's cached copy
        want = reference(st, q, 8, 4, "SEPARATE", (), allowed)
        assert rows_of(st.select(0, q, 8, "SEPARATE", (), allowed, rerank=4), KVH) == want
        out, lse, ids = st.select_attend(0, q, 8, "SEPARATE", (), allowed, rerank=4)
        assert rows_of(ids, KVH) == want
        o2, l2 = st.attend(0, q, ids)
        torch.testing.assert_close(out, o2, rtol=FP32_RTOL, atol=FP32_ATOL)
        torch.testing.assert_close(lse, l2, rtol=FP32_RTOL, atol=FP32_ATOL)
    # Every candidate kept (k >= candidates): no second stage, the same as rerank 1.
    assert torch.equal(st.select(0, q, 120, "SEPARATE", (), allowed, rerank=4),
                       st.select(0, q, 120, "SEPARATE", (), allowed))
    assert st.last_timing()["rerank_ms"] == 0


def test_dual_chunk_rotations():
    st, _ = make(1200)
    q3 = torch.randn(3, H, D, generator=torch.Generator().manual_seed(2))
    var = (40, 100)  # blocks before 40: inter, [40, 100): successive, from 100: intra
    got = rows_of(st.select(0, q3, 9, "SEPARATE", variants=var, rerank=3), KVH)
    assert got == reference(st, q3, 9, 3, "SEPARATE", variants=var)


def test_threads_do_not_change_the_picks():
    T = 5000
    g = torch.Generator().manual_seed(7)
    k, v, q = torch.randn(T, KVH, D, generator=g), torch.randn(T, KVH, D, generator=g), torch.randn(H, D, generator=g)
    picks = []
    for threads in (1, 2, 4):
        st = KVStore(1, KVH, D, T, block_size=BS, threads_num=threads)
        st.append(0, k, v)
        picks.append(st.select(0, q, 40, rerank=8))
    assert torch.equal(picks[0], picks[1]) and torch.equal(picks[0], picks[2])


def test_bad_widths_are_refused_by_name():
    st, q = make(800)
    for bad in (0, _C.MAX_RERANK + 1):
        with pytest.raises(ValueError, match="rerank"):
            st.select(0, q, 3, rerank=bad)
        with pytest.raises(ValueError, match="rerank"):
            st.select_attend(0, q, 3, rerank=bad)
    with pytest.raises(ValueError, match=r"rerank must be in \[1, 16\]"):
        st.native.select(0, q.numpy(), "SEPARATE", np.full(KVH, 3, np.int32), np.zeros((0, 2), np.int64), None,
                         np.empty((KVH, 3), np.int32), rerank=17)


def test_both_kernels_flush_a_dominated_run_alike():
    """A pick ~120 logits above the rest: the others' shares are below fp32's range. Both twins count a term
    past exp(-87.3) as 0 (attn_kernels.h tiles_lse, and the masses), so the rest tie at 0 and the lower ids win."""
    st, q = make(800, "FP32", seed=6)
    ks, vs = st.read(0)
    ks[400:408] = q.view(KVH, G, D).sum(1) * 4  # block 50, every KV head
    st.truncate(0, 0)
    st.append(0, ks, vs)
    picks = []
    try:
        for scalar in (False, True):
            _C.set_force_scalar(scalar)
            picks.append(st.select(0, q, 3, "SEPARATE", [(0, 1)], rerank=4))
    finally:
        _C.set_force_scalar(False)
    assert torch.equal(picks[0], picks[1])
    first = rows_of(st.select(0, q, 12, "SEPARATE", [(0, 1)]), KVH)
    assert rows_of(picks[0], KVH) == [sorted([50, *[b for b in r if b != 50][:2]]) for r in first]


def test_the_config_key_is_checked():
    from ktquest.config import ConfigError, LongContextConfig

    assert LongContextConfig(rerank=16).rerank == 16
    for bad in (0, 17, 2.0):
        with pytest.raises(ConfigError, match="long_context.rerank"):
            LongContextConfig(rerank=bad)


def test_the_benchmark_runs(capsys):
    """tools/bench_rerank.py end to end on a small store (with a SnapKV candidate list): a row per width."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "tools" / "bench_rerank.py"
    spec = importlib.util.spec_from_file_location("bench_rerank", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.main(["--shapes", "smollm2-135m", "--contexts", "8192", "--calls", "2", "--reranks", "3",
                       "--threads", "1", "--kv-type", "Q8_0", "--candidates", "96", "--k", "16"]) == 0
    rows = [r for r in capsys.readouterr().out.splitlines() if r.startswith("| smollm2-135m")]
    assert [r.split("|")[4].strip() for r in rows] == ["1", "3"]
    assert float(rows[1].split("|")[9]) > 0  # the second stage's time
