"""Sparse attention over the store's blocks (cpp/kvstore/sparse_attn.cpp, cpp/attn/) against torch, and the
torch references test_selection.py shares.

Contracts: a budget covering every block equals torch dense SDPA; the LSE merge of two disjoint parts
equals attention over their union; 1, 2 and 8 threads give the same bits; the scalar and AVX2 kernels
agree. (Block scoring and top-k: test_selection.py.)
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from ktquest import _C
from ktquest.kv.attention import merge_attention
from ktquest.native.store import KVStore

# ---- torch references ----


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Dense torch SDPA for one decode query. q: [H, D], k, v: [T, KVH, D] -> [H, D] (GQA groups of H/KVH)."""
    H, D = q.shape
    KVH = k.shape[1]
    out = F.scaled_dot_product_attention(
        q.reshape(1, KVH, H // KVH, D), k.permute(1, 0, 2)[None], v.permute(1, 0, 2)[None]
    )
    return out.reshape(H, D)


def ref_lse(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """logsumexp of the scaled logits per query head [H] (fp64 math)."""
    H, D = q.shape
    KVH = k.shape[1]
    logits = torch.einsum("hgd,thd->hgt", q.double().reshape(KVH, H // KVH, D), k.double()) / math.sqrt(D)
    return torch.logsumexp(logits, -1).reshape(H).float()


def ref_scores(
    q: torch.Tensor, anchors: list[list[torch.Tensor]], anchor_type: str, mode: str
) -> torch.Tensor:
    """Block scores in fp64: per KV head the sum over its query group; SHARED sums every head -> [n_sets, nb]."""
    KVH = len(anchors)
    G = q.shape[0] // KVH
    out = torch.zeros(KVH, len(anchors[0]), dtype=torch.float64)
    for h in range(KVH):
        qg = q[h * G : (h + 1) * G].double()  # [G, D]
        for b, a in enumerate(anchors[h]):
            prod = qg[:, None, :] * a.double()[None]  # [G, A_b, D]; elementwise, no tiny BLAS call per block
            if anchor_type == "QUEST":  # sum_d max(q_d min_d, q_d max_d): an upper bound of q.k in the block
                out[h, b] = torch.maximum(prod[:, 0], prod[:, 1]).sum()
            elif anchor_type in ("BLOCK_MAX", "BLOCK_MEAN"):
                out[h, b] = prod[:, 0].sum()
            else:  # FIXED / DYNAMIC: the best anchor per query head
                out[h, b] = prod.sum(-1).max(-1).values.sum()
    return out.sum(0, keepdim=True) if mode == "SHARED" else out


def ref_topk(scores: torch.Tensor, candidates: list[int], k: int) -> list[int]:
    """torch top-k with the kernel's tie rule (equal scores: the lower block id), ids ascending."""
    cand = torch.tensor(candidates, dtype=torch.long)
    order = torch.sort(-scores[cand], stable=True).indices  # stable: ties stay in ascending-id order
    return sorted(cand[order[:k]].tolist())


# Tolerances. Against SDPA on the stored (dequantised) K/V only fp32 summation order differs:
FP32_RTOL, FP32_ATOL = 1e-5, 1e-6
# Against the original fp32 K/V (N(0, 1) data), the storage rounding dominates; per element it is at most
# FP16 2^-11 and BF16 2^-8 relative, Q8_0 absmax/254 and Q4_0 absmax/16 absolute per group of 32 (absmax
# of 32 normals is ~2.5), then averaged by the softmax. Bounds ~3-5x the worst error measured on these sizes:
STORAGE_ATOL = {"FP32": 1e-5, "FP16": 2e-3, "BF16": 1.5e-2, "Q8_0": 3e-2, "Q4_0": 0.3}
SCORE_RTOL, SCORE_ATOL = 1e-5, 1e-4  # fp32 anchor dot products vs fp64


# ---- helpers ----


def make(
    T,
    KVH,
    G,
    D,
    bs,
    kv_type="FP16",
    anchor_type="QUEST",
    anchor_num=2,
    threads=2,
    seed=0,
    integer=False,
    importance=False,
):
    """A store with T random tokens; integer=True draws small integers (every score exact in fp32)."""
    g = torch.Generator().manual_seed(seed)
    if integer:
        k = torch.randint(-3, 4, (T, KVH, D), generator=g).float()
        q = torch.randint(-3, 4, (G * KVH, D), generator=g).float()
    else:
        k = torch.randn(T, KVH, D, generator=g)
        q = torch.randn(G * KVH, D, generator=g)
    v = torch.randn(T, KVH, D, generator=g)
    imp = torch.randint(0, 5, (T, KVH), generator=g).float() if importance else None
    store = KVStore(
        1,
        KVH,
        D,
        T + 8,
        block_size=bs,
        kv_type=kv_type,
        anchor_type=anchor_type,
        anchor_num=anchor_num,
        threads_num=threads,
    )
    half = T // 2
    store.append(0, k[:half], v[:half], None if imp is None else imp[:half])
    store.append(0, k[half:], v[half:], None if imp is None else imp[half:])
    return store, q, k, v, imp


def block_tokens(blocks: list[int], bs: int, T: int) -> list[int]:
    return [t for b in blocks for t in range(b * bs, min(T, (b + 1) * bs))]


def ref_sparse(q, ks, vs, rows: list[list[int]], bs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of each KV head's query group to the tokens of its blocks (rows: one list per KV head)."""
    T, KVH, _ = ks.shape
    G = q.shape[0] // KVH
    out, lse = torch.zeros(q.shape), torch.full((q.shape[0],), float("-inf"))
    for h in range(KVH):
        idx = block_tokens(rows[h], bs, T)
        if idx:
            qh = q[h * G : (h + 1) * G]
            kh, vh = ks[idx, h : h + 1], vs[idx, h : h + 1]
            out[h * G : (h + 1) * G] = sdpa(qh, kh, vh)
            lse[h * G : (h + 1) * G] = ref_lse(qh, kh)
    return out, lse


def rows_of(blocks: torch.Tensor, KVH: int) -> list[list[int]]:
    rows = [blocks.tolist()] * KVH if blocks.dim() == 1 else blocks.tolist()
    return [[b for b in r if b >= 0] for r in rows]


# ---- attention ----

FULL_CASES = [  # kv_type, G, D, block_size, T
    ("FP32", 1, 64, 1, 7),
    ("FP32", 3, 128, 16, 129),
    ("FP32", 4, 64, 64, 150),
    ("FP32", 8, 128, 128, 300),
    ("FP16", 3, 64, 64, 1000),
    ("FP16", 8, 128, 16, 19),
    ("FP16", 12, 64, 16, 77),  # G > 8: heads in batches
    ("FP16", 2, 64, 8, 77),  # an even group: both heads' logits from one hadd tree, 5-row last block
    ("BF16", 4, 64, 128, 129),
    ("BF16", 1, 128, 1, 19),
    ("Q8_0", 3, 64, 64, 150),
    ("Q8_0", 8, 128, 16, 129),
    ("Q4_0", 4, 128, 64, 200),
    ("Q4_0", 1, 64, 128, 129),
    ("FP32", 3, 20, 16, 50),  # D % 8 != 0: scalar kernels
    # G >= 2 D + 6 (a prefill chunk's queries): the AVX2 kernel's wide path, fp32 K/V scratch and 6-row tiles;
    # row counts not a multiple of 6, D and run lengths with an 8-wide remainder, partial last blocks
    ("FP32", 59, 24, 8, 203),
    ("FP16", 140, 64, 64, 300),
    ("BF16", 134, 64, 128, 129),
    ("Q8_0", 135, 64, 16, 150),
    ("Q4_0", 70, 32, 32, 77),
]


@pytest.mark.parametrize("kv_type,G,D,bs,T", FULL_CASES)
@pytest.mark.parametrize("mode", ["SHARED", "SEPARATE"])
def test_full_budget_equals_dense_sdpa(force_scalar, kv_type, G, D, bs, T, mode):
    KVH = 2
    store, q, k, v, _ = make(T, KVH, G, D, bs, kv_type=kv_type)
    ks, vs = store.read(0)
    nb = store.n_blocks(0)
    out, lse, blocks = store.select_attend(0, q, nb, mode)
    assert rows_of(blocks, KVH) == [list(range(nb))] * KVH
    torch.testing.assert_close(out, sdpa(q, ks, vs), rtol=FP32_RTOL, atol=FP32_ATOL)
    torch.testing.assert_close(lse, ref_lse(q, ks), rtol=FP32_RTOL, atol=FP32_ATOL)
    torch.testing.assert_close(out, sdpa(q, k, v), rtol=0, atol=STORAGE_ATOL[kv_type])


@pytest.mark.parametrize("mode", ["SHARED", "SEPARATE"])
@pytest.mark.parametrize("kv_type,bs,T", [("FP16", 16, 999), ("Q4_0", 64, 1000), ("FP32", 1, 90)])
def test_sparse_output_is_attention_over_the_selected_blocks(force_scalar, mode, kv_type, bs, T):
    KVH, G, D = 3, 3, 64
    store, q, *_ = make(T, KVH, G, D, bs, kv_type=kv_type)
    ks, vs = store.read(0)
    nb = store.n_blocks(0)
    k = [5, 1, 9] if mode == "SEPARATE" else 6
    out, lse, blocks = store.select_attend(0, q, k, mode, exclude_ranges=[(0, 1), (nb - 2, nb)])
    rows = rows_of(blocks, KVH)
    assert all(0 not in r and nb - 1 not in r for r in rows)  # the partial last block was excluded...
    ref_out, ref_l = ref_sparse(q, ks, vs, rows, bs)
    torch.testing.assert_close(out, ref_out, rtol=FP32_RTOL, atol=FP32_ATOL)
    torch.testing.assert_close(lse, ref_l, rtol=FP32_RTOL, atol=FP32_ATOL)
    rows = [[0, nb - 1]] * KVH  # ...so attend to it (and block 0) explicitly
    out, lse = store.attend(0, q, torch.tensor(rows, dtype=torch.int32))
    ref_out, ref_l = ref_sparse(q, ks, vs, rows, bs)
    torch.testing.assert_close(out, ref_out, rtol=FP32_RTOL, atol=FP32_ATOL)
    torch.testing.assert_close(lse, ref_l, rtol=FP32_RTOL, atol=FP32_ATOL)


@pytest.mark.parametrize("kv_type,G,D,bs,T", [("FP32", 1, 64, 8, 77), ("FP16", 3, 64, 8, 1000),
                                              ("FP16", 12, 64, 16, 300), ("Q8_0", 4, 128, 16, 150),
                                              ("BF16", 140, 64, 64, 300), ("FP32", 3, 20, 16, 50)])
@pytest.mark.parametrize("mode", ["SHARED", "SEPARATE"])
def test_block_lse_is_each_blocks_own_logsumexp(force_scalar, kv_type, G, D, bs, T, mode):
    """with_block_lse: each attended block's log-sum-exp of its rows' logits per query head ([KVH, N, G],
    -inf past a head's blocks), and the output unchanged: exp(block_lse - lse) sums to 1 over a head's blocks.
    G 12 takes the AVX2 heads in two batches, G 140 the row-by-row path instead of the wide one."""
    KVH = 2
    store, q, *_ = make(T, KVH, G, D, bs, kv_type=kv_type, seed=3)
    ks, _ = store.read(0)
    nb = store.n_blocks(0)
    g = torch.Generator().manual_seed(5)
    if mode == "SHARED":
        blocks = torch.sort(torch.randperm(nb, generator=g)[: max(1, nb // 2)].int()).values
    else:
        blocks = torch.full((KVH, nb), -1, dtype=torch.int32)
        for h, n in enumerate((max(1, nb // 3), nb)):  # rows of different lengths: -inf past the shorter
            blocks[h, :n] = torch.sort(torch.randperm(nb, generator=g)[:n].int()).values
    out0, lse0 = store.attend(0, q, blocks)
    out, lse, bl = store.attend(0, q, blocks, with_block_lse=True)
    if G < 2 * D + 6:  # the same kernels: the same bits
        assert torch.equal(out, out0) and torch.equal(lse, lse0)
    else:  # the row-by-row kernel instead of the wide one: equal up to summation order
        torch.testing.assert_close(out, out0, rtol=FP32_RTOL, atol=FP32_ATOL)
        torch.testing.assert_close(lse, lse0, rtol=FP32_RTOL, atol=FP32_ATOL)
    rows = rows_of(blocks, KVH)
    assert bl.shape == (KVH, blocks.shape[-1], G)
    for h in range(KVH):
        for j in range(bl.shape[1]):
            if j >= len(rows[h]):
                assert bool((bl[h, j] == float("-inf")).all())
                continue
            idx = block_tokens([rows[h][j]], bs, T)
            want = ref_lse(q[h * G:(h + 1) * G], ks[idx, h:h + 1])
            torch.testing.assert_close(bl[h, j], want, rtol=1e-5, atol=1e-5)
        share = torch.exp(bl[h, : len(rows[h])] - lse[h * G:(h + 1) * G]).sum(0)  # [G]
        torch.testing.assert_close(share, torch.ones(G), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kv_type", ["FP32", "FP16", "Q8_0"])
def test_lse_merge_of_disjoint_parts_equals_the_union(force_scalar, kv_type):
    T, KVH, G, D, bs = 1100, 2, 4, 128, 64
    store, q, *_ = make(T, KVH, G, D, bs, kv_type=kv_type)
    ks, vs = store.read(0)
    nb = store.n_blocks(0)
    gen = torch.Generator().manual_seed(3)
    part1 = [sorted(torch.randperm(nb, generator=gen)[: nb // 3].tolist()) for _ in range(KVH)]
    part1[1] = []  # an empty part for head 1: lse = -inf
    part2 = [sorted(set(range(nb)) - set(p)) for p in part1]
    o1, l1 = store.attend(0, q, part1)
    o2, l2 = store.attend(0, q, part2)
    assert torch.all(l1[G : 2 * G] == float("-inf")) and torch.all(o1[G : 2 * G] == 0)
    out, lse = merge_attention(o1, l1, o2, l2)
    torch.testing.assert_close(out, sdpa(q, ks, vs), rtol=FP32_RTOL, atol=FP32_ATOL)
    torch.testing.assert_close(lse, ref_lse(q, ks), rtol=FP32_RTOL, atol=FP32_ATOL)
    # merging with attention computed elsewhere (torch, on the tokens outside the store's blocks)
    split = 5 * bs
    o_a, l_a = store.attend(0, q, [list(range(5, nb))] * KVH)
    o_b, l_b = sdpa(q, ks[:split], vs[:split]), ref_lse(q, ks[:split])
    out, lse = merge_attention(o_a, l_a, o_b, l_b)
    torch.testing.assert_close(out, sdpa(q, ks, vs), rtol=FP32_RTOL, atol=FP32_ATOL)


def test_merge_attention_of_two_empty_parts_is_empty():
    o = torch.zeros(2, 4)
    ninf = torch.full((2,), float("-inf"))
    out, lse = merge_attention(o, ninf, o, ninf)
    assert torch.equal(out, o) and torch.equal(lse, ninf)


def test_no_block_gives_zero_output_and_minus_inf_lse():
    store, q, *_ = make(100, 2, 3, 64, 16)
    out, lse, blocks = store.select_attend(0, q, 0, "SEPARATE")
    assert blocks.shape == (2, 0) and torch.all(out == 0) and torch.all(lse == float("-inf"))
    out, lse = store.attend(0, q, [])
    assert torch.all(out == 0) and torch.all(lse == float("-inf"))


def test_large_logits_do_not_overflow(force_scalar):
    store, q, *_ = make(500, 2, 3, 64, 16, kv_type="FP32")
    q = q * 400.0  # logits in the thousands: exp would overflow without the running max
    ks, vs = store.read(0)
    out, lse, _ = store.select_attend(0, q, store.n_blocks(0))
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    torch.testing.assert_close(out, sdpa(q.double(), ks.double(), vs.double()).float(), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(lse, ref_lse(q, ks), rtol=FP32_RTOL, atol=1e-3)


# ---- threads and kernels ----


# Big enough that scoring, top-k (>= 64K scores) and attention all run on the pool's threads.
@pytest.mark.parametrize(
    "anchor_type,anchor_num,T,bs", [("QUEST", 2, 20000, 16), ("FIXED", 4, 20000, 16), ("QUEST", 2, 33000, 1)]
)
def test_thread_counts_give_identical_bits(anchor_type, anchor_num, T, bs):
    results = []
    for threads in (1, 2, 8):
        store, q, *_ = make(T, 2, 4, 64, bs, anchor_type=anchor_type, anchor_num=anchor_num, threads=threads)
        nb = store.n_blocks(0)
        results.append(
            [
                *store.select_attend(0, q, 120 * 16 // bs, "SEPARATE"),
                *store.select_attend(0, q, nb, "SHARED"),
                store.block_scores(0, q, "SHARED"),
            ]
        )
    for other in results[1:]:
        for a, b in zip(results[0], other):
            assert torch.equal(a, b)


def test_prefill_shaped_queries_over_a_long_context():
    """A prefill chunk's T*G queries presented as one group a KV head (as long_context's prefill does): with
    2,048 rows a head the split-K partials are capped by bytes, so each task covers more than the minimum
    chunk of blocks (6,000 tokens, 16 tasks a head). Exact against torch, and the same bits on 1, 2 and 8
    threads."""
    T, KVH, G, D, bs = 6000, 2, 2048, 64, 16
    results = []
    for threads in (1, 2, 8):
        store, q, *_ = make(T, KVH, G, D, bs, threads=threads)
        blocks = torch.arange(1, store.n_blocks(0), dtype=torch.int32)[None]  # all but the first block
        results.append(store.attend(0, q, blocks))
    ks, vs = store.read(0)
    ref_out, ref_l = ref_sparse(q, ks, vs, rows_of(blocks[0], KVH), bs)
    torch.testing.assert_close(results[0][0], ref_out, rtol=FP32_RTOL, atol=FP32_ATOL)
    torch.testing.assert_close(results[0][1], ref_l, rtol=FP32_RTOL, atol=FP32_ATOL)
    for out, lse in results[1:]:
        assert torch.equal(out, results[0][0]) and torch.equal(lse, results[0][1])


@pytest.mark.parametrize("kv_type", ["FP32", "FP16", "BF16", "Q8_0", "Q4_0"])
def test_scalar_and_avx2_agree(kv_type):
    if not _C.cpu_features()["avx2"]:
        pytest.skip("no AVX2 on this CPU")
    got = []
    store, q, *_ = make(900, 2, 4, 128, 16, kv_type=kv_type, integer=True)
    q = q / 8  # integer keys: exact scores (same selection), moderate logits
    for scalar in (False, True):
        _C.set_force_scalar(scalar)
        try:
            got.append(store.select_attend(0, q, 17, "SEPARATE") + (store.block_scores(0, q, "SHARED"),))
        finally:
            _C.set_force_scalar(False)
    (o1, l1, b1, s1), (o2, l2, b2, s2) = got
    assert torch.equal(b1, b2)
    torch.testing.assert_close(o1, o2, rtol=FP32_RTOL, atol=FP32_ATOL)
    torch.testing.assert_close(l1, l2, rtol=FP32_RTOL, atol=FP32_ATOL)
    torch.testing.assert_close(s1, s2, rtol=SCORE_RTOL, atol=SCORE_ATOL)


def test_timing_is_reported():
    store, q, *_ = make(2000, 2, 3, 64, 64)
    store.select_attend(0, q, 8)
    t = store.last_timing()
    assert set(t) == {"score_ms", "topk_ms", "attend_ms", "rerank_ms"} and all(x >= 0 for x in t.values())
    assert t["attend_ms"] > 0


# ---- checked boundary ----


def test_bad_queries_and_block_lists_raise():
    store, q, *_ = make(100, 2, 3, 64, 16)  # 7 blocks
    with pytest.raises(TypeError, match="dtype"):
        store.select_attend(0, q.double(), 2)
    with pytest.raises(ValueError, match="shape"):
        store.select(0, q[:, :63].contiguous(), 2)
    with pytest.raises(ValueError, match="multiple of n_kv_heads"):
        store.select(0, q[:5].contiguous(), 2)
    with pytest.raises(ValueError, match="contiguous"):
        store.attend(0, q.t().contiguous().t(), [0])
    with pytest.raises(IndexError, match="layer 1"):
        store.select_attend(1, q, 2)
    for bad in (float("nan"), float("inf")):
        qb = q.clone()
        qb[4, 3] = bad
        with pytest.raises(ValueError, match="non-finite value at head 4, dim 3"):
            store.select_attend(0, qb, 2)
    with pytest.raises(IndexError, match="block id 7 is out of range"):
        store.attend(0, q, [0, 7])
    with pytest.raises(ValueError, match="strictly ascending"):
        store.attend(0, q, [3, 1])
    with pytest.raises(ValueError, match="strictly ascending"):
        store.attend(0, q, [[1, 1], [2]])
    with pytest.raises(ValueError, match="rows"):
        store.attend(0, q, torch.zeros(3, 1, dtype=torch.int32))
    with pytest.raises(IndexError, match="allowed block id 9"):
        store.select(0, q, 2, "SEPARATE", allowed=[[1, 9], [2]])
    with pytest.raises(ValueError, match="allowed"):
        store.select(0, q, 2, "SEPARATE", allowed=[[1]])
    with pytest.raises(ValueError, match="k="):
        store.select(0, q, -1)
    with pytest.raises(ValueError, match="k="):
        store.select(0, q, [1, 2, 3], "SEPARATE")
    with pytest.raises(ValueError, match="exclude range"):
        store.select(0, q, 2, exclude_ranges=[(3, 1)])
    with pytest.raises(ValueError, match="mode"):
        store.select(0, q, 2, "PER_HEAD")
    with pytest.raises(ValueError, match="out: expected shape"):
        store.select_attend(0, q, 2, out=torch.empty(6, 32))
    with pytest.raises(TypeError, match="Tensor"):
        store.select(0, q.numpy(), 2)


def test_native_calls_check_their_arrays():
    st_ = _C.KVStore(1, 2, 32, 64, 16, "FP32", "QUEST", 2, 1)
    k = np.ones((40, 2, 32), np.float32)
    st_.append(0, k, k, "float32", None)
    q = np.ones((4, 32), np.float32)
    out, lse = np.empty((4, 32), np.float32), np.empty(4, np.float32)
    with pytest.raises(TypeError, match="int32"):
        st_.attend(0, q, np.zeros((1, 2), np.int64), out, lse)
    with pytest.raises(ValueError, match="shape"):
        st_.attend(0, q, np.zeros((1, 2), np.int32), out[:3], lse)
    with pytest.raises(TypeError, match="float32"):
        st_.attend(0, q.astype(np.float16), np.zeros((1, 2), np.int32), out, lse)
    with pytest.raises(ValueError, match="room for 1 blocks"):
        st_.select(
            0,
            q,
            "SEPARATE",
            np.array([3, 3], np.int32),
            np.zeros((0, 2), np.int64),
            None,
            np.zeros((2, 1), np.int32),
        )
    with pytest.raises(ValueError, match="shape"):
        st_.select(
            0,
            q,
            "SEPARATE",
            np.array([3], np.int32),
            np.zeros((0, 2), np.int64),
            None,
            np.zeros((2, 3), np.int32),
        )


# ---- benchmark ----


def test_benchmark_smoke_run(tmp_path):
    """tools/bench_attention.py end to end on a tiny context: the table's JSON fields and the plot."""
    import importlib.util
    import json
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "tools" / "bench_attention.py"
    spec = importlib.util.spec_from_file_location("bench_attention", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "bench.json"
    args = [
        "--contexts",
        "300",
        "--shapes",
        "9/3/64",
        "--budget",
        "64",
        "--block-size",
        "16",
        "--min-iters",
        "2",
        "--min-seconds",
        "0",
        "--bw-gib",
        "0.01",
        "--flush-mib",
        "1",
        "--threads",
        "1",
        "--rounds",
        "3",
        "--json",
        str(out),
    ]
    rows = bench.main(args)
    assert json.loads(out.read_text()) == rows and out.with_suffix(".png").stat().st_size > 0
    need = {
        "shape",
        "context",
        "budget",
        "block_size",
        "kv_type",
        "torch_dense_ms",
        "full_budget_ms",
        "sparse_ms",
        "score_ms",
        "topk_ms",
        "attend_ms",
        "speedup",
        "score_gbps",
        "attend_gbps",
        "read_bw_gbps",
        "score_bw_ratio",
        "attend_bw_ratio",
    }
    assert need <= set(rows[0]) and rows[0]["context"] == 300 and rows[0]["kv_type"] == "FP16"
    r = rows[0]
    assert len(r["read_bw_samples_gbps"]) == 3 and r["read_bw_gbps"] == sorted(r["read_bw_samples_gbps"])[1]
    assert all(r[k] > 0 for k in ("score_bw_ratio", "attend_bw_ratio", "read_bw_gbps"))
    assert rows[0]["full_budget_max_abs_err"] < 2e-2  # FP16 store vs torch dense on the same data
