"""Sticky blocks (``sticky_blocks``, cpp/kvstore/sticky.cpp) against a torch reference.

After a decode step's select_attend, the R blocks of each set that took the largest share of its query heads'
attention (exp(block LSE - LSE), summed over the heads; equal shares: the lower id), and the block after
each, are forced into the layer's next step, the next token only: forced blocks that are candidates, at
most k, plus the best of the other picks by score (the lowest-scored ones give way); the same k blocks. The
first step, a step that is not the next token, and sticky_blocks 0 select as before.
"""

from __future__ import annotations

import pytest
import torch
from test_rerank import ref_masses
from test_sparse_attention import FP32_ATOL, FP32_RTOL, ref_sparse, rows_of

from ktquest import _C
from ktquest.config import MAX_STICKY_BLOCKS, ConfigError, LongContextConfig
from ktquest.native.store import KVStore

KVH, G, D, BS = 3, 3, 64, 8


def stores(T: int, R: int, kv_type="FP16", index_group=0, int8=False, seed=0):
    """A store with sticky_blocks=R and its twin without, the same T random tokens; the data and a generator."""
    g = torch.Generator().manual_seed(seed)
    k, v = torch.randn(T, KVH, D, generator=g), torch.randn(T, KVH, D, generator=g)
    made = [KVStore(1, KVH, D, T + 64, block_size=BS, kv_type=kv_type, threads_num=2, index_group=index_group,
                    int8_candidates=int8, sticky_blocks=r) for r in (R, 0)]
    for st in made:
        st.append(0, k, v)
    return made[0], made[1], g


def ref_forced(store: KVStore, q: torch.Tensor, ids: torch.Tensor, mode: str, R: int) -> list[list[int]]:
    """Each set's top R blocks by attention share among ``ids`` (the last step's), each then its successor."""
    rows = rows_of(ids, KVH)
    _, lse, bl = store.attend(0, q, ids, with_block_lse=True)  # bl [KVH, cols, G]
    share = torch.exp(bl.double() - lse.double().reshape(KVH, 1, G)).sum(-1)  # [KVH, cols]
    if mode == "SHARED":
        share = share.sum(0, keepdim=True)
        rows = rows[:1]
    nb = store.n_blocks(0)
    out = []
    for s, row in enumerate(rows):
        order = sorted(range(len(row)), key=lambda j: (-float(share[s, j]), row[j]))[:R]
        f: list[int] = []
        for j in order:
            for b in (row[j], row[j] + 1):
                if b < nb and b not in f:
                    f.append(b)
        out.append(f)
    return out


def ref_apply(store: KVStore, q: torch.Tensor, picks: torch.Tensor, forced: list[list[int]], mode: str, excl,
              allowed=None, scores=None) -> list[list[int]]:
    """The picks of a plain selection made to hold the forced blocks that are candidates (at most k), the
    lowest-scored other picks giving way (equal scores: the higher id first); scores [n_sets, nb]: the anchors'
    (by default), or the second stage's masses."""
    if scores is None:
        scores = store.block_scores(0, q, mode).reshape(-1, store.n_blocks(0))  # [n_sets, nb] fp32, as the kernel's
    rows = rows_of(picks, KVH)[: scores.shape[0]]
    out = []
    for s, row in enumerate(rows):
        cand = [b for b in forced[s] if not any(a <= b < e for a, e in excl)
                and (allowed is None or b in allowed[s])][: len(row)]
        missing = [b for b in cand if b not in row]
        rest = sorted((b for b in row if b not in cand), key=lambda b: (float(scores[s, b]), -b))
        out.append(sorted(rest[len(missing):] + cand))
    return out


def step(store, twin, q, k, mode, excl, allowed=None, rerank=1):
    """select_attend on both stores (the twin without sticky blocks); checks the output against torch."""
    out, lse, ids = store.select_attend(0, q, k, mode, exclude_ranges=excl, allowed=allowed, rerank=rerank)
    _, _, plain = twin.select_attend(0, q, k, mode, exclude_ranges=excl, allowed=allowed, rerank=rerank)
    ks, vs = store.read(0)
    ref_out, ref_lse = ref_sparse(q, ks, vs, rows_of(ids, KVH), BS)
    torch.testing.assert_close(out, ref_out, rtol=FP32_RTOL, atol=FP32_ATOL)
    torch.testing.assert_close(lse, ref_lse, rtol=FP32_RTOL, atol=FP32_ATOL)
    return ids, plain


def decode_token(stores_, g):
    """Append one token to each store (a decode step writes its K/V after attending)."""
    k, v = torch.randn(1, KVH, D, generator=g), torch.randn(1, KVH, D, generator=g)
    for st in stores_:
        st.append(0, k, v)


def near(k_all: torch.Tensor, t: int, g) -> torch.Tensor:
    """Queries close to the keys of token t (one per query head): a step that attends one stretch hard."""
    return k_all[t].repeat_interleave(G, 0) * 3 + 0.3 * torch.randn(KVH * G, D, generator=g)


@pytest.mark.parametrize("with_list", [False, True])
def test_after_a_second_stage_the_lightest_picks_give_way(force_scalar, with_list):
    """With rerank (cpp/kvstore/rerank.h) the forced blocks displace the picks of least attention mass, the order
    the second stage kept them by, over the store's blocks or a candidate list's copy."""
    R, k, T, W = 3, 8, 1000, 3
    store, twin, g = stores(T, R)
    ks, _ = store.read(0)
    nb = store.n_blocks(0)
    excl = [(0, 2), (nb - 8, nb)]
    allowed = [sorted(torch.randperm(nb - 10, generator=g)[:60].add(2).tolist()) for _ in range(KVH)]
    a = torch.tensor(allowed, dtype=torch.int32) if with_list else None
    q = near(ks, 8 * allowed[0][5], g)
    ids, _ = step(store, twin, q, k, "SEPARATE", excl, a, rerank=W)
    kept_any = False
    for t in (allowed[1][50], allowed[2][12], allowed[0][30], allowed[1][3]):
        forced = ref_forced(store, q, ids, "SEPARATE", R)
        decode_token((store, twin), g)
        q = near(ks, 8 * t, g)
        ids, plain = step(store, twin, q, k, "SEPARATE", excl, a, rerank=W)
        first = twin.select(0, q, k * W, "SEPARATE", excl, a)  # the first stage, then the masses of its picks
        scores = torch.full((KVH, store.n_blocks(0)), float("-inf"), dtype=torch.float64)
        for s, row in enumerate(ref_masses(twin, q, first, "SEPARATE")):
            for m, b in row:
                scores[s, b] = m
        want = ref_apply(store, q, plain, forced, "SEPARATE", excl, allowed if with_list else None, scores)
        assert rows_of(ids, KVH) == want
        kept_any |= not torch.equal(ids, plain)
    assert kept_any  # some step kept a block the second stage alone would have dropped


@pytest.mark.parametrize("mode", ["SEPARATE", "SHARED"])
@pytest.mark.parametrize("index_group", [0, 4])
def test_the_next_step_keeps_the_blocks_with_the_largest_share(force_scalar, mode, index_group):
    R, k, T = 3, 12, 1200
    store, twin, g = stores(T, R, index_group=index_group)
    ks, _ = store.read(0)
    excl = lambda: [(0, 2), (store.n_blocks(0) - 8, store.n_blocks(0))]  # noqa: E731 (the windows move)
    q = near(ks, 500, g)
    ids, plain = step(store, twin, q, k, mode, excl())
    assert torch.equal(ids, plain)  # the first step: nothing to keep yet
    kept_any = False
    for t in (900, 100, 1100, 300):  # each step reads elsewhere: the last step's blocks must be forced in
        forced = ref_forced(store, q, ids, mode, R)
        decode_token((store, twin), g)
        q = near(ks, t, g)
        ids, plain = step(store, twin, q, k, mode, excl())
        want = ref_apply(store, q, plain, forced, mode, excl())
        assert rows_of(ids, KVH)[: len(want)] == want
        assert all(len(r) == k for r in want)  # the same budget
        kept_any |= not torch.equal(ids, plain)
    assert kept_any  # some step kept a block its bounds alone would have dropped


def test_only_the_next_token_gets_them(force_scalar):
    """Without a token appended since (a second call at the same length), after a truncate, or with
    sticky_blocks 0, a step selects as a plain one does."""
    R, k, T = 2, 10, 800
    store, twin, g = stores(T, R)
    ks, _ = store.read(0)
    excl = [(0, 2), (90, 101)]
    step(store, twin, near(ks, 300, g), k, "SEPARATE", excl)
    q = near(ks, 700, g)
    ids, plain = step(store, twin, q, k, "SEPARATE", excl)  # same length: not the next token
    assert torch.equal(ids, plain)
    decode_token((store, twin), g)
    for st in (store, twin):
        st.truncate(0, T)  # rewound: what was taken before no longer follows
    decode_token((store, twin), g)
    ids, plain = step(store, twin, near(ks, 100, g), k, "SEPARATE", excl)
    assert torch.equal(ids, plain)


@pytest.mark.parametrize("int8", [False, True])
def test_candidate_lists_keep_only_candidates(force_scalar, int8):
    """With SnapKV's candidate lists (and their int8 copy), only forced blocks that are candidates are kept."""
    R, k, T = 3, 8, 1000
    store, twin, g = stores(T, R, int8=int8)
    ks, _ = store.read(0)
    nb = store.n_blocks(0)
    excl = [(0, 2), (nb - 8, nb)]
    allowed = [sorted(torch.randperm(nb - 10, generator=g)[:40].add(2).tolist()) for _ in range(KVH)]
    a = torch.tensor(allowed, dtype=torch.int32)
    q = near(ks, 8 * allowed[0][5], g)
    ids, _ = step(store, twin, q, k, "SEPARATE", excl, a)
    kept_any = False
    for t in (allowed[1][30], allowed[2][12], allowed[0][20]):
        forced = ref_forced(store, q, ids, "SEPARATE", R)
        decode_token((store, twin), g)
        q = near(ks, 8 * t, g)
        ids, plain = step(store, twin, q, k, "SEPARATE", excl, a)
        want = ref_apply(store, q, plain, forced, "SEPARATE", excl, allowed)
        if int8:  # the picks that give way are the lowest by the int8 copy's scores (that chose them): the
            # same forced blocks, and the rest from the plain picks
            for got, w, p in zip(rows_of(ids, KVH), want, rows_of(plain, KVH)):
                kept = [b for b in w if b not in p]
                assert len(got) == len(p) and set(kept) <= set(got) and set(got) <= set(p) | set(kept)
        else:
            assert rows_of(ids, KVH) == want
        assert all(b in allowed[s] for s, r in enumerate(want) for b in r)
        kept_any |= not torch.equal(ids, plain)
    assert kept_any


@pytest.mark.parametrize("mode", ["SEPARATE", "SHARED"])
@pytest.mark.parametrize("allow", [False, True])
def test_thread_counts_give_the_same_picks(mode, allow):
    """1 or 3 threads, with candidate lists large enough that their sets are selected (and the sticky blocks
    put in) by several threads at once inside the attention's dispatch: the same picks, and not the picks
    without sticky blocks."""
    R, k, T = 4, 64, 12000
    nb = T // BS
    out = []
    for threads in (1, 3):
        g = torch.Generator().manual_seed(9)
        kk, vv = torch.randn(T, KVH, D, generator=g), torch.randn(T, KVH, D, generator=g)
        rows = [torch.sort(torch.randperm(nb - 20, generator=g)[:900].add(2)).values for _ in range(KVH)]
        allowed = torch.stack(rows).int() if allow else None  # 900 candidates x 3 heads: threads split them
        if allow and mode == "SHARED":
            allowed = allowed[:1]  # one list for every head
        ids_all = []
        for r in (R, 0):
            st = KVStore(1, KVH, D, T + 16, block_size=BS, threads_num=threads, sticky_blocks=r)
            st.append(0, kk, vv)
            ids = []
            for t in (100, 8000, 3900, 10500, 6000):
                ids.append(st.select_attend(0, near(kk, t, g), k, mode, exclude_ranges=[(0, 2), (nb - 16, nb)],
                                            allowed=allowed)[2])
                st.append(0, kk[:1], vv[:1])
            ids_all.append(torch.stack(ids))
        assert not torch.equal(ids_all[0], ids_all[1])  # sticky blocks changed some step's picks
        out.append(ids_all[0])
    assert torch.equal(out[0], out[1])


def test_a_refused_step_or_a_rolled_back_token_changes_nothing(force_scalar):
    """A step whose token is never appended leaves the layer's sticky blocks as they were; so does a token
    appended and then truncated away (a refused token's rollback): the next step picks what it would have."""
    R, k, T = 3, 10, 1500
    store, _, g = stores(T, R)
    ks, _ = store.read(0)
    nb = lambda: store.n_blocks(0)  # noqa: E731
    excl = lambda: [(0, 2), (nb() - 8, nb())]  # noqa: E731
    qs = [near(ks, t, g) for t in (200, 1000, 600, 1300)]
    kv = torch.randn(1, KVH, D, generator=g)

    def run(detour: str) -> torch.Tensor:
        st = KVStore(1, KVH, D, T + 64, block_size=BS, kv_type="FP16", threads_num=2, sticky_blocks=R)
        st.append(0, *store.read(0))
        st.select_attend(0, qs[0], k, "SEPARATE", exclude_ranges=excl())
        st.append(0, kv, kv)
        if detour == "refused":  # a step at the same length whose token is never appended
            st.select_attend(0, qs[2], k, "SEPARATE", exclude_ranges=excl())
        elif detour == "rolled back":  # a step whose token is appended, then truncated away
            st.select_attend(0, qs[2], k, "SEPARATE", exclude_ranges=excl())
            st.append(0, kv, kv)
            st.truncate(0, T + 1)
        return st.select_attend(0, qs[1], k, "SEPARATE", exclude_ranges=excl())[2]

    want = run("")
    assert not torch.equal(want, store.select(0, qs[1], k, "SEPARATE", exclude_ranges=excl()))  # some forced
    assert torch.equal(run("refused"), want)
    assert torch.equal(run("rolled back"), want)


def test_sticky_blocks_is_checked():
    assert _C.MAX_STICKY_BLOCKS == MAX_STICKY_BLOCKS
    assert LongContextConfig().sticky_blocks == 0
    for bad in (-1, MAX_STICKY_BLOCKS + 1):
        with pytest.raises(ConfigError, match=rf"long_context.sticky_blocks={bad} is not allowed: an integer in \[0, "):
            LongContextConfig(sticky_blocks=bad)
    with pytest.raises(ConfigError, match="long_context.sticky_blocks='2' has the wrong type"):
        LongContextConfig(sticky_blocks="2")
    with pytest.raises(ConfigError, match="long_context.sticky_blocks=2 is not allowed: 0 with token_step 2"):
        LongContextConfig(sticky_blocks=2, token_step=2)
    with pytest.raises(ValueError, match="sticky_blocks"):
        KVStore(1, 1, 64, 100, block_size=8, sticky_blocks=MAX_STICKY_BLOCKS + 1)


def test_set_sticky_blocks_is_the_constructors(force_scalar):
    """A store given sticky_blocks later (set_sticky_blocks: a decode-time knob) picks as one made with it, from
    the step after the call; set back to 0 it picks as a plain store; a bad value is refused, naming it."""
    R, k, T = 3, 12, 1000
    store, twin, g = stores(T, R)
    late, _, _ = stores(T, 0)
    ks, _ = store.read(0)
    excl = [(0, 2), (110, 126)]
    late.set_sticky_blocks(R)
    for t in (300, 800, 150, 600):
        q = near(ks, t, g)
        ids, plain = step(store, twin, q, k, "SEPARATE", excl)
        late_ids, _ = step(late, twin, q, k, "SEPARATE", excl)
        assert torch.equal(late_ids, ids)
        decode_token((store, twin, late), g)
    assert not torch.equal(ids, plain)  # the last step kept blocks: the comparison had something to see
    store.set_sticky_blocks(R)  # the same R again: what the last step kept is dropped
    ids, plain = step(store, twin, near(ks, 200, g), k, "SEPARATE", excl)
    assert torch.equal(ids, plain)
    late.set_sticky_blocks(0)
    q = near(ks, 400, g)
    late_ids, plain = step(late, twin, q, k, "SEPARATE", excl)
    assert torch.equal(late_ids, plain) and late.sticky_blocks == 0
    for bad in (-1, MAX_STICKY_BLOCKS + 1):
        with pytest.raises(ValueError, match="sticky_blocks"):
            late.set_sticky_blocks(bad)
