"""SnapKV preselection (ktquest/kv/selection.py) and its Ada-KV budgets against naive torch references."""

import math
from fractions import Fraction

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ktquest.config import LongContextConfig
from ktquest.kv.selection import (
    ada_budgets,
    block_scores_from_tokens,
    merge_group_scores,
    preselect_blocks,
    snapkv_preselect,
    snapkv_token_scores,
)

NEG_INF = float("-inf")


def snapkv_reference(q_win, k, start, pool_kernel=7, how="mean"):
    """Naive SnapKV: the whole [H, W, N] attention at once, pooled by an explicit loop."""
    W, H, D = q_win.shape
    N, KVH, _ = k.shape
    kk = k.double().repeat_interleave(H // KVH, dim=1)  # [N, H, D]
    s = torch.einsum("whd,nhd->hwn", q_win.double(), kk) / math.sqrt(D)  # [H, W, N]
    future = torch.arange(N)[None, :] > (start + torch.arange(W))[:, None]  # [W, N]
    p = torch.softmax(s.masked_fill(future, NEG_INF), dim=-1).sum(1)  # [H, N]
    r = pool_kernel // 2
    pooled = torch.stack([p[:, max(0, j - r): j + r + 1].amax(1) for j in range(N)], dim=1)
    grouped = pooled.view(KVH, H // KVH, N)
    return (grouped.mean(1) if how == "mean" else grouped.amax(1)).float()


def exact_floor(alpha, total, kvh):
    return math.floor(Fraction(alpha).limit_denominator(10**6) * total / kvh)


# Two fp32 passes of exp/logsumexp against fp64; scores are sums of W probabilities.
SCORE_RTOL = 1e-5
SCORE_ATOL = 1e-6


# ---- SnapKV token scores ----


@pytest.mark.parametrize("group", [1, 3, 4])
@pytest.mark.parametrize("N,W", [(1, 1), (7, 3), (19, 5), (129, 32), (200, 8)])
@pytest.mark.parametrize("chunk", [5, 64, 4096])
@pytest.mark.parametrize("how", ["mean", "max"])
def test_snapkv_chunked_matches_naive(group, N, W, chunk, how):
    g = torch.Generator().manual_seed(N * 100 + W * 10 + group)
    KVH, D = 2, 16
    q = torch.randn(W, KVH * group, D, generator=g) * 2
    k = torch.randn(N, KVH, D, generator=g) * 2
    got = snapkv_token_scores(q, k, N - W, gqa_merge=how, chunk_size=chunk)
    assert got.shape == (KVH, N)
    torch.testing.assert_close(got, snapkv_reference(q, k, N - W, how=how), rtol=SCORE_RTOL, atol=SCORE_ATOL)


def test_snapkv_one_key_chunks():
    g = torch.Generator().manual_seed(7)
    q, k = torch.randn(5, 6, 16, generator=g), torch.randn(19, 2, 16, generator=g)
    got = snapkv_token_scores(q, k, 14, gqa_merge="max", chunk_size=1)
    torch.testing.assert_close(got, snapkv_reference(q, k, 14, how="max"), rtol=SCORE_RTOL, atol=SCORE_ATOL)


@pytest.mark.parametrize("pool_kernel", [1, 3, 7, 9])
def test_snapkv_window_inside_context(pool_kernel):
    # the window need not be the last W tokens: later keys are unseen by every window query
    g = torch.Generator().manual_seed(pool_kernel)
    q, k = torch.randn(4, 6, 8, generator=g), torch.randn(50, 2, 8, generator=g)
    got = snapkv_token_scores(q, k, 30, pool_kernel=pool_kernel, chunk_size=7)
    torch.testing.assert_close(got, snapkv_reference(q, k, 30, pool_kernel), rtol=SCORE_RTOL, atol=SCORE_ATOL)
    if pool_kernel == 1:
        assert (got[:, 34:] == 0).all()
    # each query row is a softmax; before pooling the W rows sum to W per query head
    torch.testing.assert_close(snapkv_token_scores(q, k, 30, pool_kernel=1).sum(1), torch.full((2,), 4.0))


def test_snapkv_max_pool_edges_and_chunk_seams():
    # one key per spike: a query that matches only key j puts (nearly) all its mass there
    N, D = 40, 8
    k = torch.zeros(N, 1, D)
    spikes = [0, 15, 16, N - 1]  # the ends, and both sides of a chunk seam at 16
    for n, j in enumerate(spikes):
        k[j, 0, n] = 1.0
    q = torch.zeros(len(spikes), 1, D)
    for n in range(len(spikes)):
        q[n, 0, n] = 200.0
    got = snapkv_token_scores(q, k, N - len(spikes), pool_kernel=7, chunk_size=16)[0]
    high = torch.zeros(N, dtype=torch.bool)
    for j in spikes:
        high[max(0, j - 3): j + 4] = True
    assert (got[high] > 0.99).all() and (got[~high] < 1e-6).all()


def test_snapkv_half_precision_inputs_score_in_fp32():
    g = torch.Generator().manual_seed(1)
    q, k = torch.randn(8, 4, 16, generator=g), torch.randn(33, 2, 16, generator=g)
    got = snapkv_token_scores(q.half(), k.half(), 25, chunk_size=10)
    assert got.dtype == torch.float32
    ref = snapkv_reference(q.half().float(), k.half().float(), 25)
    torch.testing.assert_close(got, ref, rtol=SCORE_RTOL, atol=SCORE_ATOL)


def test_snapkv_rejects_bad_shapes():
    q, k = torch.randn(4, 6, 8), torch.randn(20, 4, 8)
    with pytest.raises(ValueError, match="multiple of KVH"):
        snapkv_token_scores(q, k, 16)
    with pytest.raises(ValueError, match="window_start_pos"):
        snapkv_token_scores(torch.randn(4, 4, 8), k, 17)
    with pytest.raises(ValueError, match="pool_kernel"):
        snapkv_token_scores(torch.randn(4, 4, 8), k, 16, pool_kernel=4)


def test_merge_group_scores():
    s = torch.arange(24.0).view(6, 4)  # 6 query heads, 2 KV heads: groups {0,1,2}, {3,4,5}
    torch.testing.assert_close(merge_group_scores(s, 2, "mean"), s.view(2, 3, 4).mean(1))
    torch.testing.assert_close(merge_group_scores(s, 2, "max"), s[[2, 5]])
    torch.testing.assert_close(merge_group_scores(s, 6), s)
    with pytest.raises(ValueError):
        merge_group_scores(s, 4)
    with pytest.raises(ValueError, match="how"):
        merge_group_scores(s, 2, "sum")


# ---- block scores ----


@pytest.mark.parametrize("N,bs", [(1, 4), (7, 4), (8, 4), (19, 7), (129, 64)])
def test_block_scores_sum_tokens(N, bs):
    t = torch.rand(3, N, generator=torch.Generator().manual_seed(N))
    got = block_scores_from_tokens(t, bs)
    ref = torch.stack([t[:, b * bs: (b + 1) * bs].sum(1) for b in range(-(-N // bs))], dim=1)
    torch.testing.assert_close(got, ref)
    # explicit n_blocks: extra blocks score 0, fewer blocks drop the tail
    assert (block_scores_from_tokens(t, bs, got.shape[1] + 2)[:, -2:] == 0).all()
    torch.testing.assert_close(block_scores_from_tokens(t, bs, N // bs), ref[:, : N // bs])


# ---- Ada-KV budgets ----


def test_ada_flat_head_gets_more_than_peaked_head():
    NB = 16
    flat = torch.full((NB,), 1.0 / NB)
    peaked = torch.full((NB,), 0.1 / (NB - 1))
    peaked[5] = 0.9
    b = ada_budgets(torch.stack([peaked, flat]), total=8, alpha=0.2)
    # shares: peaked 1 (its 0.9), flat 7; 1*0.8 + 0.8 = 1.6 -> 2, 7*0.8 + 0.8 = 6.4 -> 6
    assert b.tolist() == [2, 6]
    assert b.dtype == torch.long


def test_ada_alpha_one_is_uniform_and_zero_is_shares():
    g = torch.Generator().manual_seed(0)
    s = torch.rand(4, 10, generator=g) * torch.tensor([[1.0], [10.0], [0.1], [3.0]])
    assert ada_budgets(s, 12, 1.0).tolist() == [3, 3, 3, 3]
    assert ada_budgets(s, 14, 1.0).tolist() == [4, 4, 3, 3]  # remainder ties: lower head first
    top = s.reshape(-1).topk(14).indices // 10
    assert ada_budgets(s, 14, 0.0).tolist() == torch.bincount(top, minlength=4).tolist()


def test_ada_cap_redistributes_to_other_heads():
    # head 0 has 3 candidate blocks; uniform 5 each is more than it can take
    s = torch.rand(3, 8, generator=torch.Generator().manual_seed(2))
    s[0, 3:] = NEG_INF
    b = ada_budgets(s, 15, 1.0)
    assert b.tolist() == [3, 6, 6]
    assert ada_budgets(s, 100, 0.2).tolist() == [3, 8, 8]  # more than exists: every candidate


def test_ada_ties_are_deterministic():
    s = torch.ones(3, 4)
    # global top 5 of equal scores: head 0's four blocks, then head 1's first
    assert ada_budgets(s, 5, 0.0).tolist() == [4, 1, 0]
    assert ada_budgets(s, 5, 0.5).tolist() == [3, 1, 1]  # 2.83, 1.33, 0.83: fractions decide
    assert preselect_blocks(s, 2)[1].tolist() == [0, 1]
    # large enough that an unstable sort would scramble the ties
    big = torch.ones(8, 512)
    assert ada_budgets(big, 700, 0.0).tolist() == [512, 188, 0, 0, 0, 0, 0, 0]
    assert all(p.tolist() == list(range(20)) for p in preselect_blocks(big, 20))


def test_ada_rejects_bad_input():
    with pytest.raises(ValueError, match="alpha"):
        ada_budgets(torch.ones(2, 2), 2, 1.5)
    with pytest.raises(ValueError, match="NaN"):
        ada_budgets(torch.tensor([[0.0, float("nan")]]), 1, 0.2)


@st.composite
def scores_and_budget(draw):
    kvh = draw(st.integers(1, 8))
    nb = draw(st.integers(0, 12))
    vals = draw(st.lists(st.sampled_from([NEG_INF, 0.0, 0.25, 1.0, 2.0, 7.5]), min_size=kvh * nb,
                         max_size=kvh * nb))  # few distinct values: many ties
    scores = torch.tensor(vals, dtype=torch.float32).view(kvh, nb)
    return scores, draw(st.integers(0, 120)), draw(st.floats(0.0, 1.0))


@settings(max_examples=150, deadline=None)
@given(scores_and_budget())
def test_ada_budget_invariants(case):
    scores, total, alpha = case
    kvh = scores.shape[0]
    caps = (scores != NEG_INF).sum(1)
    T = min(total, int(caps.sum()))
    b = ada_budgets(scores, total, alpha)
    assert b.shape == (kvh,) and int(b.sum()) == T
    assert (b >= 0).all() and (b <= caps).all()
    floor = exact_floor(alpha, T, kvh)
    assert (b >= caps.clamp(max=floor)).all()
    assert torch.equal(b, ada_budgets(scores.clone(), total, alpha))  # deterministic


# ---- preselection ----


@settings(max_examples=100, deadline=None)
@given(scores_and_budget(), st.integers(0, 6), st.booleans(),
       st.lists(st.tuples(st.integers(0, 12), st.integers(0, 4)), max_size=3))
def test_preselect_invariants(case, count, ada, ranges):
    scores, _, alpha = case
    kvh, nb = scores.shape
    exclude = [(b0, b0 + n) for b0, n in ranges]
    excluded = {b for b0, b1 in exclude for b in range(b0, b1)}
    picked = preselect_blocks(scores, count, ada=ada, alpha=alpha, exclude=exclude)
    assert len(picked) == kvh
    avail = [[b for b in range(nb) if b not in excluded and scores[h, b] != NEG_INF] for h in range(kvh)]
    for h, p in enumerate(picked):
        ids = p.tolist()
        assert p.dtype == torch.long and ids == sorted(set(ids))
        assert set(ids) <= set(avail[h])
        if not ada:
            assert len(ids) == min(count, len(avail[h]))
        # a head's picks are its best: nothing left out scores higher than something kept
        if ids and len(ids) < len(avail[h]):
            left_out = max(scores[h, b] for b in avail[h] if b not in ids)
            assert left_out <= min(scores[h, b] for b in ids)
    if ada:
        assert sum(len(p) for p in picked) == min(count * kvh, sum(len(a) for a in avail))


def test_preselect_uniform_and_ada():
    NB = 12
    s = torch.full((2, NB), 0.01)
    s[0, 7] = 1.0  # head 0: peaked
    s[1] = torch.linspace(0.2, 0.3, NB)  # head 1: flat
    exclude = [(0, 1), (10, 12)]  # sink block, local window
    uniform = preselect_blocks(s, 3, exclude=exclude)
    assert uniform[0].tolist() == [1, 2, 7] and uniform[1].tolist() == [7, 8, 9]
    ada = preselect_blocks(s, 3, ada=True, alpha=0.2, exclude=exclude)
    assert len(ada[0]) + len(ada[1]) == 6 and len(ada[1]) > len(ada[0])
    assert 7 in ada[0].tolist() and not {0, 10, 11} & set(ada[0].tolist() + ada[1].tolist())


def test_snapkv_preselect_from_config():
    g = torch.Generator().manual_seed(3)
    N, bs = 300, 16  # 19 blocks, the last one partial
    q, k = torch.randn(32, 8, 16, generator=g), torch.randn(N, 2, 16, generator=g)
    lc = LongContextConfig(block_size=bs, preselect_block=True, preselect_block_count=5, ada_budget=True)
    picked = snapkv_preselect(block_scores_from_tokens(snapkv_token_scores(q, k, N - 32), bs), lc,
                              exclude=[(0, 1), (16, 19)])
    assert sum(len(p) for p in picked) == 10
    blocks = block_scores_from_tokens(snapkv_reference(q, k, N - 32), bs)
    want = preselect_blocks(blocks, 5, ada=True, alpha=lc.ada_alpha, exclude=[(0, 1), (16, 19)])
    assert [p.tolist() for p in picked] == [w.tolist() for w in want]
    shared = LongContextConfig(block_size=bs, preselect_block=True, preselect_block_count=5, head_select_mode="SHARED")
    (one,) = snapkv_preselect(blocks, shared, exclude=[(0, 1)])
    assert one.tolist() == preselect_blocks(blocks.sum(0, keepdim=True), 5, exclude=[(0, 1)])[0].tolist()
