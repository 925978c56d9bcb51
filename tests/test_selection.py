"""Block scoring and top-k selection (cpp/select/, the store's candidate copies in cpp/kvstore/) against
torch: the torch references are test_sparse_attention.py's.

Contracts: selection equals a torch top-k (ties -> lower block id) of the torch scores; QUEST scores bound
every q.k of their block; cached and int8 candidates select what their bounds say; select_attend is select
then attend.
"""

from __future__ import annotations

import math
from fractions import Fraction

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_kv_store import ANCHOR_CASES, ref_anchor_lists
from test_sparse_attention import (
    FP32_ATOL,
    FP32_RTOL,
    SCORE_ATOL,
    SCORE_RTOL,
    make,
    ref_scores,
    ref_sparse,
    ref_topk,
    rows_of,
)

from ktquest import _C
from ktquest.native.store import KVStore

# ---- scores ----


@pytest.mark.parametrize("anchor_type,anchor_num", ANCHOR_CASES)
@pytest.mark.parametrize("mode", ["SHARED", "SEPARATE"])
@pytest.mark.parametrize("G,D", [(1, 64), (3, 128), (4, 64), (8, 128)])
def test_block_scores_match_reference(force_scalar, anchor_type, anchor_num, mode, G, D):
    T, KVH, bs = 150, 2, 16
    store, q, *_, imp = make(
        T, KVH, G, D, bs, anchor_type=anchor_type, anchor_num=anchor_num, importance=True
    )
    ks, _ = store.read(0)
    ref = ref_scores(q, ref_anchor_lists(ks, bs, anchor_type, anchor_num, imp, "FP16"), anchor_type, mode)
    got = store.block_scores(0, q, mode)
    torch.testing.assert_close(
        got.double(), ref[0] if mode == "SHARED" else ref, rtol=SCORE_RTOL, atol=SCORE_ATOL
    )


@pytest.mark.parametrize("centre", [0.25, 0.5, 1.0])
@pytest.mark.parametrize("mode", ["SHARED", "SEPARATE"])
@pytest.mark.parametrize("kv_type", ["FP32", "FP16"])
def test_quest_centre_scores_mix_the_bound_and_the_centre(force_scalar, centre, mode, kv_type):
    """quest_centre c: a block scores (1 - c) * its QUEST bound + c * q . (min + max) / 2, summed over the
    group (and the heads in SHARED mode); the picks are the torch top k of those scores."""
    T, KVH, G, D, bs = 150, 2, 3, 64, 8
    base, q, *_ = make(T, KVH, G, D, bs, kv_type=kv_type)
    ks, vs = base.read(0)
    store = KVStore(1, KVH, D, T, block_size=bs, kv_type=kv_type, threads_num=2, quest_centre=centre)
    store.append(0, ks, vs)
    anchors = ref_anchor_lists(ks, bs, "QUEST", 2, None, kv_type)
    bound = ref_scores(q, anchors, "QUEST", "SEPARATE")  # [KVH, nb]
    mid = ref_scores(q, [[((a[0] + a[1]) / 2)[None] for a in head] for head in anchors], "BLOCK_MEAN", "SEPARATE")
    ref = (1 - centre) * bound + centre * mid
    ref = ref.sum(0, keepdim=True) if mode == "SHARED" else ref
    got = store.block_scores(0, q, mode)
    torch.testing.assert_close(got.double(), ref[0] if mode == "SHARED" else ref, rtol=SCORE_RTOL, atol=SCORE_ATOL)
    assert (got.double() <= (bound.sum(0) if mode == "SHARED" else bound) + SCORE_ATOL).all()  # still <= the bound
    ids = store.select(0, q, 5, mode=mode).reshape(ref.shape[0], -1)
    for s in range(ids.shape[0]):
        assert ids[s].tolist() == ref_topk(ref[s], list(range(ref.shape[1])), 5)
    with pytest.raises(ValueError, match="quest_centre must be in"):
        KVStore(1, KVH, D, T, block_size=bs, quest_centre=float("nan"))
    with pytest.raises(ValueError, match="quest_centre needs anchor_type QUEST, got BLOCK_MEAN"):
        KVStore(1, KVH, D, T, block_size=bs, anchor_type="BLOCK_MEAN", anchor_num=1, quest_centre=centre)


@settings(max_examples=40, deadline=None)
@given(
    KVH=st.integers(1, 2),
    G=st.integers(1, 3),
    D=st.sampled_from([8, 19, 32, 64]),
    bs=st.integers(1, 20),
    T=st.integers(1, 90),
    kv_type=st.sampled_from(["FP32", "FP16", "Q8_0"]),
    scale=st.floats(0.01, 100.0),
    seed=st.integers(0, 2**16),
    scalar=st.booleans(),
)
def test_quest_scores_bound_every_dot_product(KVH, G, D, bs, T, kv_type, scale, seed, scalar):
    if kv_type == "Q8_0" and D % 32:
        kv_type = "FP16"
    _C.set_force_scalar(scalar)
    try:
        store, q, *_ = make(T, KVH, G, D, bs, kv_type=kv_type, seed=seed)
        q = q * scale
        ks, _ = store.read(0)
        scores = store.block_scores(0, q, "SEPARATE")  # [KVH, nb]
    finally:
        _C.set_force_scalar(False)
    for h in range(KVH):
        qh = q[h * G : (h + 1) * G].double()
        for b in range(scores.shape[1]):
            kb = ks[b * bs : (b + 1) * bs, h].double()  # [n, D]
            dots = (qh[:, None, :] * kb[None]).sum(-1)  # [G, n] q.k of every query head and token
            best = dots.max(-1).values.sum()  # for each query head the largest q.k in the block
            slack = 1e-5 * (qh.abs() * kb.abs().max(0).values).sum() + 1e-6  # fp32 rounding of the score
            assert scores[h, b] >= best - slack


# ---- selection ----


@pytest.mark.parametrize("anchor_type,anchor_num", ANCHOR_CASES)
@pytest.mark.parametrize("mode", ["SHARED", "SEPARATE"])
@pytest.mark.parametrize("bs", [8, 2])
def test_selection_equals_torch_topk(force_scalar, anchor_type, anchor_num, mode, bs):
    """Integer data: every score is exact in fp32, so ties are real and the tie rule is checked exactly.
    k = 2 of 151 blocks (bs 2) takes the streaming k-heap, the other k the k-th-value partition; a k that
    covers every candidate takes them all without scoring."""
    T, KVH, G, D = 301, 3, 3, 64
    if anchor_type in ("FIXED", "DYNAMIC"):
        anchor_num = min(anchor_num, bs)  # at most a block's tokens
    store, q, *_, imp = make(
        T,
        KVH,
        G,
        D,
        bs,
        kv_type="BF16",
        anchor_type=anchor_type,
        anchor_num=anchor_num,
        integer=True,
        importance=True,
    )
    ks, _ = store.read(0)
    ref = ref_scores(q, ref_anchor_lists(ks, bs, anchor_type, anchor_num, imp), anchor_type, mode)
    nb, n_sets = store.n_blocks(0), ref.shape[0]
    # BLOCK_MEAN anchors are rounded means: fp32 products may break exact ties differently than fp64.
    tol = 1e-4 if anchor_type == "BLOCK_MEAN" else 0.0
    gen = torch.Generator().manual_seed(1)
    allowed = [sorted(torch.randperm(nb, generator=gen)[:20].tolist()) for _ in range(n_sets)]
    shuffled = [a[::-1] + a[:3] for a in allowed]  # the same candidates, unsorted and repeated
    per_head_k = [5, 0, 40] if mode == "SEPARATE" else 7
    cases = [
        {"k": 7},
        {"k": 7, "exclude_ranges": [(0, 1), (nb - 4, nb + 10), (2, 2)]},
        {"k": 6, "allowed": allowed},
        {"k": per_head_k, "exclude_ranges": [(3, 9)]},
        {"k": nb + 5},
        {"k": 25, "allowed": allowed, "exclude_ranges": [(3, 9)]},
        {"k": 6, "allowed": shuffled},
        {"k": 2},
        {"k": 0},
    ]
    for case in cases:
        got = store.select(0, q, mode=mode, **case)
        got_rows = [got.tolist()] if mode == "SHARED" else got.tolist()
        for s in range(n_sets):
            cand = allowed[s] if "allowed" in case else list(range(nb))
            cand = [b for b in cand if not any(b0 <= b < b1 for b0, b1 in case.get("exclude_ranges", []))]
            k = case["k"] if isinstance(case["k"], int) else case["k"][s]
            want = ref_topk(ref[s], cand, k)
            sel = [b for b in got_rows[s] if b >= 0]
            assert len(sel) == len(want), case
            if tol == 0 or sel == want:
                assert sel == want, case
            else:  # only blocks tied (within tol) with the k-th score may differ
                kth = sorted(ref[s][cand].tolist(), reverse=True)[k - 1]
                assert all(abs(ref[s][b] - kth) <= tol for b in set(sel) ^ set(want)), case


def _append_small_ints(store, g: torch.Generator, T: int, KVH: int, D: int) -> None:
    """T tokens into layer 0, keys of small integers: every QUEST score is exact in fp32 and fp16, so ties
    follow the id rule."""
    store.append(0, torch.randint(-3, 4, (T, KVH, D), generator=g).float(), torch.randn(T, KVH, D, generator=g))


def _check_candidates(store, g: torch.Generator, mode: str, G: int, KVH: int, D: int, bs: int,
                      allowed: list[list[int]], k: int, excl=()) -> None:
    """A new small-integer query: layer 0's selection over the allowed candidates (less the excluded
    ranges) equals torch's top k on QUEST scores of what the store holds now."""
    q = torch.randint(-3, 4, (G * KVH, D), generator=g).float()
    ks, _ = store.read(0)
    ref = ref_scores(q, ref_anchor_lists(ks, bs, "QUEST", 2, None), "QUEST", mode)
    got = store.select(0, q, k, mode, exclude_ranges=excl, allowed=allowed)
    rows = [got.tolist()] if mode == "SHARED" else got.tolist()
    for s in range(len(rows)):
        cand = [b for b in allowed[s] if not any(b0 <= b < b1 for b0, b1 in excl)]
        assert [b for b in rows[s] if b >= 0] == ref_topk(ref[s], cand, k)


@pytest.mark.parametrize("mode", ["SHARED", "SEPARATE"])
@pytest.mark.parametrize("kv_type", ["FP16", "FP32"])  # fp16 and fp32 anchors
def test_repeated_candidates_follow_the_store(force_scalar, mode, kv_type):
    """The decode loop passes the same candidates every step, and the store keeps their anchors in a compact
    copy between calls: selections must still equal torch's on what the store holds now, through appends
    (also into a partial candidate block) and a truncate whose blocks are then written again."""
    KVH, G, D, bs = 3, 3, 64, 8
    n_sets = 1 if mode == "SHARED" else KVH
    g = torch.Generator().manual_seed(5)
    store = KVStore(1, KVH, D, 1024, block_size=bs, kv_type=kv_type, threads_num=2)

    def append(T):
        _append_small_ints(store, g, T, KVH, D)

    def check(allowed, k, excl=()):
        _check_candidates(store, g, mode, G, KVH, D, bs, allowed, k, excl)

    append(400)  # 50 full blocks
    allowed = [sorted(torch.randperm(50, generator=g)[:24].tolist()) for _ in range(n_sets)]
    for _ in range(3):  # new queries, the same candidates
        check(allowed, 7)
    check(allowed, 7, excl=[(0, 10)])
    append(16)  # the store grows: the candidates' anchors stay
    check(allowed, 5)
    with_last = [a + [50, 51] for a in allowed]
    append(3)  # block 52 is partial; 50 and 51 are full
    check(with_last, 9)
    partial = [a + [52] for a in with_last]
    check(partial, 9)
    append(5)  # block 52 fills up
    check(partial, 9)
    check(partial, 9)
    store.truncate(0, 203)  # blocks 25.. are dropped (25 keeps 3 rows), then written with new keys
    append(240)
    for _ in range(2):
        check(partial, 9)
    got = store.select(0, torch.zeros(G * KVH, D), 100, mode, allowed=partial)  # k covers them: every one
    assert ([got.tolist()] if mode == "SHARED" else got.tolist()) == [sorted(a) for a in partial]


@pytest.mark.parametrize("mode", ["SHARED", "SEPARATE"])
def test_candidates_that_grow_like_a_decode(force_scalar, mode):
    """Decode after a preselection: every block that leaves the local window joins the candidates (after all
    of them) and the exclusion of the window moves on. The store then extends its compact copy of their
    anchors instead of copying it again, past its spare room too (80 blocks join); a changed list is
    copied anew. Every selection must equal torch's on what the store holds."""
    KVH, G, D, bs = 3, 3, 64, 8
    n_sets = 1 if mode == "SHARED" else KVH
    g = torch.Generator().manual_seed(9)
    store = KVStore(1, KVH, D, 2048, block_size=bs, kv_type="FP16", threads_num=2)

    def append(T):
        _append_small_ints(store, g, T, KVH, D)

    def check(allowed, k, excl):
        _check_candidates(store, g, mode, G, KVH, D, bs, allowed, k, excl)

    append(100 * bs)
    lb = 90  # blocks [90, ...) are the local window
    allowed = [sorted(torch.randperm(lb, generator=g)[:30].tolist()) for _ in range(n_sets)]
    for step in range(80):
        check(allowed, 12, [(0, 1), (lb, 10_000)])
        append(bs)  # a block's worth of tokens: one block leaves the window and joins every set
        allowed = [a + [lb] for a in allowed]
        lb += 1
        if step == 40:  # a different list (not the old one plus new blocks): a fresh copy
            allowed = [a[1:] for a in allowed]
    check(allowed, 12, [(0, 1), (lb, 10_000)])


def ref_int8_anchors(a: torch.Tensor, anchor_type: str) -> torch.Tensor:
    """int8_candidates' copy of anchor rows a [..., A, D] (fp32), returned dequantised (q * scale, fp64): per
    row scale = max |a| / 127 nudged up until 127 * scale covers it; QUEST's min row rounded down and max row
    up (checked in fp32), BLOCK_MAX / BLOCK_MEAN to nearest."""
    flat = a.reshape(*a.shape[:-2], -1).float()  # [..., A*D]
    amax = flat.abs().amax(-1, keepdim=True)
    s = amax / 127
    while bool((s * 127 < amax).any()):
        s = torch.where(s * 127 < amax, torch.nextafter(s, torch.tensor(float("inf"))), s)
    safe = torch.where(s == 0, torch.ones_like(s), s)
    r = flat / safe
    if anchor_type == "QUEST":
        D = a.shape[-1]
        lo, hi = r[..., :D].floor(), r[..., D:].ceil()
        x_lo, x_hi, s_b = flat[..., :D], flat[..., D:], safe.expand_as(lo)
        while bool(((lo > -127) & (lo * s_b > x_lo)).any()):
            lo = torch.where((lo > -127) & (lo * s_b > x_lo), lo - 1, lo)
        while bool(((hi < 127) & (hi * s_b < x_hi)).any()):
            hi = torch.where((hi < 127) & (hi * s_b < x_hi), hi + 1, hi)
        r = torch.cat([lo, hi], -1)
    else:
        r = r.round()
    r = torch.where(s == 0, torch.zeros_like(r), r.clamp(-127, 127))
    return (r.double() * s.double()).reshape(a.shape)


@pytest.mark.parametrize("mode", ["SHARED", "SEPARATE"])
@pytest.mark.parametrize("anchor_type,kv_type", [("QUEST", "FP16"), ("QUEST", "FP32"), ("BLOCK_MAX", "FP16"),
                                                 ("BLOCK_MEAN", "FP32")])
def test_int8_candidates_select_by_their_int8_bounds(force_scalar, mode, anchor_type, kv_type):
    """int8_candidates: the cached candidates are scored from an int8 copy of their anchors (one scale per
    block and head). Selections equal torch's top k over the same int8 anchors (only blocks tied with the k-th
    score within fp32 rounding may differ), through blocks joining the list as in a decode; they differ from
    the selections over the exact anchors (so the copy is what is scored), and QUEST's int8 scores are upper
    bounds of the exact ones."""
    KVH, G, D, bs = 3, 3, 64, 8
    g = torch.Generator().manual_seed(13)
    store = KVStore(1, KVH, D, 4096, block_size=bs, kv_type=kv_type, anchor_type=anchor_type,
                    anchor_num=2 if anchor_type == "QUEST" else 1, threads_num=2, int8_candidates=True)
    store.append(0, torch.randn(300 * bs, KVH, D, generator=g), torch.randn(300 * bs, KVH, D, generator=g))
    n_sets = 1 if mode == "SHARED" else KVH
    allowed = [sorted(torch.randperm(250, generator=g)[:120].tolist()) for _ in range(n_sets)]
    k, differs = 40, 0
    for step in range(12):
        q = torch.randn(G * KVH, D, generator=g)
        anchors, _ = store.anchors(0)  # [KVH, nb, A, D] as stored
        lists = [list(anchors[h]) for h in range(KVH)]
        exact = ref_scores(q, lists, anchor_type, mode)
        ref = ref_scores(q, [list(ref_int8_anchors(anchors[h], anchor_type)) for h in range(KVH)], anchor_type, mode)
        if anchor_type == "QUEST":
            assert bool((ref >= exact - 1e-9 * exact.abs().max()).all())
        got = store.select(0, q, k, mode, exclude_ranges=[(0, 1)], allowed=allowed)
        rows = [got.tolist()] if mode == "SHARED" else got.tolist()
        for s in range(n_sets):
            cand = [b for b in allowed[s] if b >= 1]
            sel, want = [b for b in rows[s] if b >= 0], ref_topk(ref[s], cand, k)
            kth = sorted(ref[s][cand].tolist(), reverse=True)[k - 1]
            tol = 1e-5 * ref[s][cand].abs().max().item()
            assert all(abs(ref[s][b] - kth) <= tol for b in set(sel) ^ set(want)), (step, s)
            differs += sel != ref_topk(exact[s], cand, k)
        store.append(0, torch.randn(bs, KVH, D, generator=g), torch.randn(bs, KVH, D, generator=g))
        allowed = [a + [300 + step] for a in allowed]  # a block joins every set: the copy is extended
    assert differs > 0


@pytest.mark.parametrize("mode", ["SHARED", "SEPARATE"])
def test_top_k_over_many_tied_candidates(force_scalar, mode):
    """Hundreds of candidates (not a multiple of the 8-lane vectors) whose scores tie in large groups, zero
    included: the top-k cut keeps exactly torch's top k, ties to the lower block id, through the cached
    candidates (SnapKV's path: score and cut in one pass per set) and the uncached one."""
    KVH, G, D, bs, nb = 3, 3, 64, 8, 700
    n_sets = 1 if mode == "SHARED" else KVH
    g = torch.Generator().manual_seed(11)
    store = KVStore(1, KVH, D, nb * bs, block_size=bs, kv_type="FP16", threads_num=2)
    store.append(0, torch.randint(-1, 2, (nb * bs, KVH, D), generator=g).float(), torch.randn(nb * bs, KVH, D))
    ks, _ = store.read(0)
    anchors = ref_anchor_lists(ks, bs, "QUEST", 2, None)
    allowed = [sorted(torch.randperm(nb, generator=g)[:517].tolist()) for _ in range(n_sets)]
    for q_hi in (2, 1):  # q in {-1, 0, 1}: a few distinct scores, most of them shared by many blocks
        q = torch.randint(-q_hi + 1, q_hi, (G * KVH, D), generator=g).float()
        q[:, : D // 2] = 0  # half the dimensions never count: fewer distinct scores
        ref = ref_scores(q, anchors, "QUEST", mode)
        for k in (1, 13, 100, 172, 516):
            for cand_lists in (allowed, None):
                got = store.select(0, q, k, mode, allowed=cand_lists)
                rows = [got.tolist()] if mode == "SHARED" else got.tolist()
                for s in range(n_sets):
                    cand = allowed[s] if cand_lists else list(range(nb))
                    assert [b for b in rows[s] if b >= 0] == ref_topk(ref[s], cand, k), (q_hi, k, s)
        assert len(set(ref[0].tolist())) < nb // 4  # the ties are real


def test_select_attend_is_select_then_attend(force_scalar):
    store, q, *_ = make(700, 2, 4, 64, 16)
    for mode in ("SHARED", "SEPARATE"):
        out, lse, blocks = store.select_attend(0, q, 9, mode, exclude_ranges=[(0, 1)])
        assert torch.equal(blocks, store.select(0, q, 9, mode, exclude_ranges=[(0, 1)]))
        out2, lse2 = store.attend(0, q, blocks)
        assert torch.equal(out, out2) and torch.equal(lse, lse2)



@pytest.mark.parametrize("threads", [1, 2, 3])
def test_select_attend_over_cached_candidates_is_select_then_attend(force_scalar, threads):
    # Preselected candidates (SnapKV): each set's scores and top k run inside the attention's own dispatch,
    # and a head's attention starts when its set is done. Same ids and the same bits as the two calls.
    # Per-set k: some sets select, one keeps every candidate, one keeps none.
    store, q, *_ = make(3000, 3, 3, 64, 8, threads=threads, seed=threads)
    nb = store.n_blocks(0)
    g = torch.Generator().manual_seed(7)
    allowed = [sorted(torch.randperm(nb - 1, generator=g)[:200].tolist()) for _ in range(3)]
    for mode, k in (("SEPARATE", 64), ("SEPARATE", [64, 200, 0]), ("SEPARATE", [5, 150, 199]), ("SHARED", 64),
                    ("SHARED", 300)):
        cand = allowed[:1] if mode == "SHARED" else allowed
        for _ in range(2):  # the first call builds the candidate cache, the second uses it
            out, lse, blocks = store.select_attend(0, q, k, mode, allowed=cand)
            ref_blocks = store.select(0, q, k, mode, allowed=cand)
            assert torch.equal(blocks, ref_blocks), (mode, k)
            out2, lse2 = store.attend(0, q, blocks)
            assert torch.equal(out, out2) and torch.equal(lse, lse2), (mode, k)
        ks = [k] * len(cand) if isinstance(k, int) else k
        for s, row in enumerate(blocks.reshape(len(cand), -1).tolist()):
            assert len([b for b in row if b >= 0]) == min(ks[s], len(cand[s]))


@pytest.mark.parametrize("mode", ["SHARED", "SEPARATE"])
@pytest.mark.parametrize("kv_type", ["FP16", "Q8_0", "FP32"])
def test_cached_candidates_attend_to_what_the_store_holds(force_scalar, mode, kv_type):
    """select_attend over cached candidates reads their K/V from the store's compact copy of them: every
    output must still be torch's attention over the selected blocks of what the store holds now (and bit for
    bit attend's over the store's own tiles), while blocks join the list as in a decode (the copy is
    extended, past its spare room too), after a changed list, and after a truncate whose blocks are then
    written with new keys and values (a stale copy would attend to the old ones)."""
    KVH, G, D, bs = 3, 3, 64, 8
    n_sets = 1 if mode == "SHARED" else KVH
    g = torch.Generator().manual_seed(21)
    store = KVStore(1, KVH, D, 2048, block_size=bs, kv_type=kv_type, threads_num=2)

    def append(T):
        store.append(0, torch.randn(T, KVH, D, generator=g), torch.randn(T, KVH, D, generator=g))

    append(100 * bs)
    lb = 90  # blocks [lb, ...) are the local window
    allowed = [sorted(torch.randperm(lb, generator=g)[:30].tolist()) for _ in range(n_sets)]
    for step in range(110):
        q = torch.randn(G * KVH, D, generator=g)
        out, lse, blocks = store.select_attend(0, q, 12, mode, exclude_ranges=[(0, 1), (lb, 10_000)],
                                               allowed=allowed)
        ks, vs = store.read(0)
        rows = rows_of(blocks, KVH)
        assert all(len(r) == 12 for r in rows)
        ref_out, ref_l = ref_sparse(q, ks, vs, rows, bs)
        torch.testing.assert_close(out, ref_out, rtol=FP32_RTOL, atol=FP32_ATOL)
        torch.testing.assert_close(lse, ref_l, rtol=FP32_RTOL, atol=FP32_ATOL)
        out2, lse2 = store.attend(0, q, blocks)
        assert torch.equal(out, out2) and torch.equal(lse, lse2), step
        if step == 31:  # right after the copy of step 30's new list, the same list and length again, but
            n = store.length(0)  # blocks from 40 on dropped and written with new keys and values
            store.truncate(0, 40 * bs + 3)
            append(n - (40 * bs + 3))
            continue
        append(bs)  # one block leaves the window and joins every set
        allowed = [a + [lb] for a in allowed]
        lb += 1
        if step == 30:  # a changed list: copied anew
            allowed = [a[2:] for a in allowed]


# ---- Ada-KV budgets (cpp/select/ada.h) ----


def ada_budgets_reference(block_scores: torch.Tensor, total: int, alpha: float) -> torch.Tensor:
    """The Ada-KV rule in exact fractions, the reference of cpp/select/ada.h: blocks per KV head.  block_scores: [KVH, NB] (-inf = not a candidate) -> LongTensor [KVH].

    With cap_i the candidate blocks of head i and T = min(total, sum cap_i):
    1. share s_i = head i's blocks among the global top T of all heads' scores (ties: lower head,
       then lower block first);
    2. b_i = s_i (1 - alpha) + u_i, where the uniform part alpha T is split evenly (u_i = alpha T / KVH)
       except that a head never exceeds its cap: what a capped head cannot take is spread evenly over
       the others (water-filling). Since s_i <= cap_i and sum cap_i >= T this always fits;
    3. rounding (largest remainder): every head gets floor(b_i); the T - sum floor(b_i) blocks left
       go one each to the heads with the largest fractional parts, ties to the lower head index.
    The budgets sum to exactly T, each lies in [min(cap_i, floor(alpha T / KVH)), cap_i], alpha = 1 is
    uniform and alpha = 0 the shares. The arithmetic is exact (fractions; alpha read as the nearest
    fraction with denominator <= 10^6), so rounding never depends on float error.
    """
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"ada_budgets: alpha={alpha!r} is not allowed: a number in [0, 1]")
    if total < 0:
        raise ValueError(f"ada_budgets: total={total} is not allowed: an integer >= 0")
    if torch.isnan(block_scores).any():
        raise ValueError("ada_budgets: block_scores contain NaN")
    KVH, NB = block_scores.shape
    candidate = block_scores != float("-inf")  # [KVH, NB]
    caps = candidate.sum(1).tolist()
    T = min(total, sum(caps))
    if T == 0:
        return torch.zeros(KVH, dtype=torch.long)

    flat = block_scores.detach().float().reshape(-1).cpu()  # [KVH * NB], head-major
    top = torch.sort(flat, descending=True, stable=True).indices[:T]  # stable: lower flat index first on ties
    shares = torch.bincount(top // NB, minlength=KVH).tolist()

    a = Fraction(float(alpha)).limit_denominator(10**6)
    base = [s * (1 - a) for s in shares]
    room = [c - b for c, b in zip(caps, base)]
    uniform = [Fraction(0)] * KVH
    left, n_left = a * T, KVH
    for i in sorted(range(KVH), key=lambda i: (room[i], i)):  # fill the smallest rooms first
        uniform[i] = min(room[i], left / n_left)
        left -= uniform[i]
        n_left -= 1
    b = [x + u for x, u in zip(base, uniform)]

    budgets = [math.floor(x) for x in b]
    rest = T - sum(budgets)  # in [0, KVH); the heads with the largest fractions have room for one more
    for i in sorted(range(KVH), key=lambda i: (-(b[i] - budgets[i]), i))[:rest]:
        budgets[i] += 1
    return torch.tensor(budgets, dtype=torch.long)


def _ada_reference(scores: torch.Tensor, counts: list[int], total: int, alpha) -> list[int]:
    """ada_budgets_reference on set s's first counts[s] scores (-inf after them)."""
    s = scores.clone()
    for i, c in enumerate(counts):
        s[i, c:] = float("-inf")
    return ada_budgets_reference(s, total, alpha).tolist()


@settings(max_examples=300, deadline=None)
@given(
    n_sets=st.integers(1, 8),
    N=st.integers(1, 40),
    total=st.integers(0, 120),
    alpha=st.sampled_from([0.0, 0.2, 0.5, 1.0, 1 / 3, 0.123457, 0.9]),
    tied=st.booleans(),
    seed=st.integers(0, 10**6),
)
def test_ada_budgets_equal_the_exact_python_rule(n_sets, N, total, alpha, tied, seed):
    """Random scores (small integers when tied: many equal scores, the share rule's ties), per-set candidate
    counts from 0 to N (small ones cap sets: the water-filling), totals below and past every candidate."""
    from fractions import Fraction

    g = torch.Generator().manual_seed(seed)
    scores = torch.randint(-2, 3, (n_sets, N), generator=g).float() if tied else torch.randn(n_sets, N, generator=g)
    counts = torch.randint(0, N + 1, (n_sets,), generator=g).tolist()
    if sum(counts) == 0:
        counts[0] = N
    f = Fraction(alpha).limit_denominator(10**6)
    got = _C.ada_budgets(scores.numpy(), torch.tensor(counts).numpy(), total, f.numerator, f.denominator).tolist()
    assert got == _ada_reference(scores, counts, total, alpha)
    assert sum(got) == min(total, sum(counts)) and all(0 <= b <= c for b, c in zip(got, counts))


@settings(max_examples=200, deadline=None)
@given(n_sets=st.integers(1, 8), N=st.integers(1, 40), total=st.integers(0, 120),
       alpha=st.sampled_from([0.0, 0.2, 0.5, 1.0, 1 / 3]), seed=st.integers(0, 10**6))
def test_ada_budgets_of_the_facade_mark_non_candidates_by_minus_inf(n_sets, N, total, alpha, seed):
    """native.ada.ada_budgets (what SnapKV's preselection splits by): -inf marks a non-candidate anywhere in a
    row, as the reference reads it; the facade packs each row's candidates in order for the store's rule."""
    from ktquest.native.ada import ada_budgets

    g = torch.Generator().manual_seed(seed)
    scores = torch.randint(-2, 3, (n_sets, N), generator=g).float()
    scores[torch.rand(n_sets, N, generator=g) < 0.3] = float("-inf")
    assert ada_budgets(scores, total, alpha).tolist() == ada_budgets_reference(scores, total, alpha).tolist()


def test_ada_budgets_refuse_bad_arguments():
    s = torch.zeros(2, 4).numpy()
    c = torch.tensor([4, 4]).numpy()
    with pytest.raises(ValueError, match=r"alpha = 3/2 must lie in \[0, 1\]"):
        _C.ada_budgets(s, c, 4, 3, 2)
    with pytest.raises(ValueError, match="total must be >= 0"):
        _C.ada_budgets(s, c, -1, 1, 5)
    with pytest.raises(ValueError, match=r"counts\[1\] = 5 must lie in \[0, 4\]"):
        _C.ada_budgets(s, torch.tensor([4, 5]).numpy(), 4, 1, 5)
    store, q, *_ = make(200, 2, 2, 64, 8)
    with pytest.raises(ValueError, match="ada_alpha=1.5 is not allowed"):
        store.select(0, q, 4, ada_alpha=1.5)
    with pytest.raises(ValueError, match="ada: expected None or"):
        store._st.select(0, q.numpy(), "SEPARATE", torch.tensor([4, 4], dtype=torch.int32).numpy(),
                         torch.zeros(0, 2, dtype=torch.int64).numpy(), None,
                         torch.zeros(2, 8, dtype=torch.int32).numpy(), (1, 2, 3))
    with pytest.raises(ValueError, match="ada: expected None or"):
        store._st.select(0, q.numpy(), "SEPARATE", torch.tensor([4, 4], dtype=torch.int32).numpy(),
                         torch.zeros(0, 2, dtype=torch.int64).numpy(), None,
                         torch.zeros(2, 8, dtype=torch.int32).numpy(), 0.2)


@pytest.mark.parametrize("cached", [False, True])
@pytest.mark.parametrize("index_group", [0, 4])
@pytest.mark.parametrize("threads", [1, 2])
def test_ada_selection_is_the_top_of_python_budgets(force_scalar, cached, index_group, threads):
    """select(ada_alpha=a) keeps, per KV head, the top b_h blocks where b = ada_budgets of this query's block
    scores over the candidates (the layer's total = the sum of k): over every block (the flat scan: Ada-KV
    needs every score, the index is not walked), over cached candidates, and in select_attend (then the
    same ids and bits as attend over them)."""
    T, KVH, G, D, bs = 2400, 4, 2, 64, 8
    store, q, *_ = make(T, KVH, G, D, bs, threads=threads, seed=threads)
    if index_group:
        ks, vs = store.read(0)
        store = KVStore(1, KVH, D, T + 8, block_size=bs, threads_num=threads, index_group=index_group)
        store.append(0, ks, vs)
    nb = store.n_blocks(0)
    excl = [(0, 2), (nb - 20, nb)]
    g = torch.Generator().manual_seed(3)
    # per-head candidates of different sizes: a small set caps its head (the water-filling)
    allowed = [sorted(torch.randperm(nb - 1, generator=g)[:n].tolist()) for n in (150, 12, 90, 200)]
    scores = store.block_scores(0, q, "SEPARATE").double()  # [KVH, nb]
    for k, alpha in ((16, 0.2), ([10, 20, 30, 5], 0.5), (16, 0.0), (16, 1.0), (400, 0.2)):
        cand = []
        for h in range(KVH):
            c = allowed[h] if cached else list(range(nb))
            cand.append([b for b in c if not any(b0 <= b < b1 for b0, b1 in excl)])
        masked = torch.full_like(scores, float("-inf"))
        for h in range(KVH):
            masked[h, cand[h]] = scores[h, cand[h]]
        total = k * KVH if isinstance(k, int) else sum(k)
        budgets = ada_budgets_reference(masked, total, alpha).tolist()
        kw = dict(exclude_ranges=excl, allowed=allowed if cached else None, ada_alpha=alpha)
        for _ in range(2):  # (cached: the first call builds the copy, the second uses it)
            got = store.select(0, q, k, **kw)
            for h in range(KVH):
                row = [b for b in got[h].tolist() if b >= 0]
                assert row == ref_topk(scores[h], cand[h], budgets[h]), (k, alpha, h)
            out, lse, blocks = store.select_attend(0, q, k, **kw)
            assert torch.equal(blocks, got)
            out2, lse2 = store.attend(0, q, blocks)
            assert torch.equal(out, out2) and torch.equal(lse, lse2)


def test_ada_budgets_over_int8_candidates_rank_the_int8_scores(force_scalar):
    """With int8_candidates the budgets come from the scores the cut uses, the int8 copy's: per head, the top
    b_h of those scores with b = ada_budgets over them (only blocks tied with a k-th score within fp32
    rounding may differ), through a first call that builds the copy and a second that reads it."""
    KVH, G, D, bs = 3, 3, 64, 8
    g = torch.Generator().manual_seed(17)
    store = KVStore(1, KVH, D, 4096, block_size=bs, kv_type="FP16", threads_num=2, int8_candidates=True)
    store.append(0, torch.randn(300 * bs, KVH, D, generator=g), torch.randn(300 * bs, KVH, D, generator=g))
    allowed = [sorted(torch.randperm(299, generator=g)[:n].tolist()) for n in (150, 30, 220)]
    from ktquest.kv.selection import ada_budgets

    for _ in range(2):
        q = torch.randn(G * KVH, D, generator=g)
        anchors, _ = store.anchors(0)
        ref = ref_scores(q, [list(ref_int8_anchors(anchors[h], "QUEST")) for h in range(KVH)], "QUEST", "SEPARATE")
        cand = [[b for b in allowed[h] if b >= 1] for h in range(KVH)]
        masked = torch.full_like(ref, float("-inf"))
        for h in range(KVH):
            masked[h, cand[h]] = ref[h, cand[h]]
        budgets = ada_budgets(masked, 3 * 40, 0.2).tolist()
        assert len(set(budgets)) > 1
        for _ in range(2):
            got = store.select(0, q, 40, "SEPARATE", exclude_ranges=[(0, 1)], allowed=allowed, ada_alpha=0.2)
            for h in range(KVH):
                sel, want = [b for b in got[h].tolist() if b >= 0], ref_topk(ref[h], cand[h], budgets[h])
                assert len(sel) == budgets[h]
                kth = sorted(ref[h][cand[h]].tolist(), reverse=True)[budgets[h] - 1]
                tol = 1e-5 * ref[h][cand[h]].abs().max().item()
                assert all(abs(ref[h][b] - kth) <= tol for b in set(sel) ^ set(want)), h
