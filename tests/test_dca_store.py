"""Dual chunk attention in the store (cpp/select/request.h QueryVariants): a query's three rotations, each block
scored, bounded, selected and attended by the one its chunk calls for, against references built from one
rotation at a time (the picked scores are the same kernel's bits) and from torch over the stored keys."""

from __future__ import annotations

import math

import pytest
import torch

from ktquest.kv.selection import block_scores_from_tokens, snapkv_token_scores
from ktquest.native.store import KVStore

KVH, G, D = 2, 3, 32
H = KVH * G


def filled(n: int, bs: int = 8, anchor: str = "QUEST", kv_type: str = "FP32", index_group: int = 0,
           int8: bool = False, seed: int = 0) -> KVStore:
    g = torch.Generator().manual_seed(seed)
    st = KVStore(1, KVH, D, n + 64, bs, kv_type, anchor, 2, 2, int8, index_group)
    k = torch.randn(n, KVH, D, generator=g)
    k[:, :, :4] += 3 * torch.randn(n, 1, 1, generator=g)  # keys that share a direction: scores spread widely
    st.append(0, k, torch.randn(n, KVH, D, generator=g))
    return st


def rotations(seed: int = 1, w: int | None = None) -> torch.Tensor:
    """Three unrelated queries [3, H, D] (or [3, w, H, D]): a block scored by the wrong one would show."""
    shape = (3, H, D) if w is None else (3, w, H, D)
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * 2


def variant_of(b: torch.Tensor, succ: int, intra: int) -> torch.Tensor:
    return torch.where(b >= intra, 0, torch.where(b >= succ, 1, 2))


def picked_scores(st: KVStore, qv: torch.Tensor, succ: int, intra: int, mode: str = "SEPARATE") -> torch.Tensor:
    """Each block's score by its own rotation, from three one-rotation calls."""
    each = torch.stack([st.block_scores(0, qv[v], mode) for v in range(3)])  # [3, (KVH,) nb]
    v = variant_of(torch.arange(each.shape[-1]), succ, intra)
    return each.gather(0, v.expand_as(each[:1]))[0]


BOUNDS = [(5, 11), (0, 7), (9, 9), (0, 0), (13, 40), (3, 1000)]  # blocks: some empty ranges, some past the end


@pytest.mark.parametrize("force_scalar", [False, True], indirect=True)
@pytest.mark.parametrize("anchor", ["QUEST", "BLOCK_MAX", "FIXED"])
@pytest.mark.parametrize("succ,intra", BOUNDS)
def test_scores_are_the_rotation_of_each_blocks_chunk(force_scalar, anchor, succ, intra):
    st, qv = filled(150, anchor=anchor), rotations()
    for mode in ("SEPARATE", "SHARED"):
        got = st.block_scores(0, qv, mode, variants=(succ, intra))
        assert torch.equal(got, picked_scores(st, qv, succ, intra, mode))


@pytest.mark.parametrize("index_group", [0, 4])
@pytest.mark.parametrize("succ,intra", BOUNDS)
def test_selection_is_the_top_k_of_those_scores(index_group, succ, intra):
    st, qv = filled(300, index_group=index_group), rotations(2)
    want = picked_scores(st, qv, succ, intra)  # [KVH, nb]
    excl = [(0, 1), (33, 38)]
    got = st.select(0, qv, 6, "SEPARATE", excl, variants=(succ, intra))
    for h in range(KVH):
        s = want[h].clone()
        for a, b in excl:
            s[a:b] = -math.inf
        top = sorted(torch.topk(s, 6).indices.tolist())
        assert got[h].tolist() == top
    if index_group:  # the index's bounds hold for the rotation each block is scored by
        bounds = st.group_bounds(0, qv, "SEPARATE", variants=(succ, intra))  # [KVH, ng]
        nb = want.shape[1]
        per_group = torch.nn.functional.pad(want, (0, bounds.shape[1] * index_group - nb), value=-math.inf)
        assert (bounds >= per_group.view(KVH, -1, index_group).amax(-1).double()).all()


def test_candidate_lists_and_ada_take_the_rotations_too():
    st, qv = filled(400, int8=False), rotations(3)
    succ, intra = 10, 30
    want = picked_scores(st, qv, succ, intra)
    allowed = torch.stack([torch.arange(2, 49, 2), torch.arange(1, 48, 2)]).to(torch.int32)  # [KVH, 24]
    for _ in range(2):  # the second call is served by the candidate copy
        got = st.select(0, qv, 5, "SEPARATE", [], allowed, variants=(succ, intra))
        for h in range(KVH):
            ids = allowed[h].long()
            top = ids[torch.topk(want[h, ids], 5).indices].sort().values
            assert got[h].tolist() == top.tolist()
    ada = st.select(0, qv, 5, "SEPARATE", [], allowed, ada_alpha=0.2, variants=(succ, intra))
    plain = st.select(0, qv[0], 5, "SEPARATE", [], allowed, ada_alpha=0.2)
    assert ada.shape == plain.shape  # (Ada-KV splits the budget by the picked scores: exercised, not compared)


def reference_attention(st: KVStore, qv: torch.Tensor, blocks: list[int], succ: int, intra: int, bs: int):
    """Torch over the stored keys: each head's softmax over the tokens of ``blocks``, each token's logit by its
    block's rotation -> out [H, D], lse [H]."""
    k, v = st.read(0)  # [N, KVH, D]
    toks = torch.cat([torch.arange(b * bs, min((b + 1) * bs, k.shape[0])) for b in blocks])
    rot = variant_of(toks // bs, succ, intra)  # [n]
    kk, vv = k[toks].repeat_interleave(G, 1), v[toks].repeat_interleave(G, 1)  # [n, H, D]
    logits = torch.einsum("vhd,nhd->vhn", qv, kk) / math.sqrt(D)  # [3, H, n]
    logits = logits.gather(0, rot[None, None].expand(1, H, -1))[0]  # [H, n]
    lse = logits.logsumexp(-1)
    return torch.einsum("hn,nhd->hd", (logits - lse[:, None]).exp(), vv), lse


@pytest.mark.parametrize("force_scalar", [False, True], indirect=True)
@pytest.mark.parametrize("kv_type", ["FP32", "FP16", "Q8_0"])
@pytest.mark.parametrize("succ,intra", [(4, 9), (0, 3), (6, 6), (20, 20)])
def test_attention_is_one_softmax_over_each_blocks_rotation(force_scalar, kv_type, succ, intra):
    bs = 8
    st, qv = filled(17 * bs - 3, bs, kv_type=kv_type), rotations(4)  # a partial last block
    blocks = [0, 1, 3, 4, 5, 8, 9, 10, 12, 16]  # runs across every bound
    out, lse = st.attend(0, qv, torch.tensor(blocks, dtype=torch.int32), variants=(succ, intra))
    want_out, want_lse = reference_attention(st, qv, blocks, succ, intra, bs)
    torch.testing.assert_close(out, want_out, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(lse, want_lse, rtol=1e-5, atol=1e-5)
    # select + attend in one call: the same blocks as select, the same attention as attend
    o2, l2, ids = st.select_attend(0, qv, 4, "SEPARATE", [(0, 1)], variants=(succ, intra))
    assert torch.equal(ids, st.select(0, qv, 4, "SEPARATE", [(0, 1)], variants=(succ, intra)))
    o3, l3 = st.attend(0, qv, ids, variants=(succ, intra))
    torch.testing.assert_close(o2, o3, rtol=0, atol=0)
    torch.testing.assert_close(l2, l3, rtol=0, atol=0)


def test_one_rotation_everywhere_is_the_plain_call():
    st, qv = filled(200), rotations(5)
    same = qv[1].expand(3, H, D).contiguous()
    blocks = torch.arange(0, 25, dtype=torch.int32)
    o1, l1 = st.attend(0, same, blocks, variants=(7, 15))
    o2, l2 = st.attend(0, qv[1], blocks)
    torch.testing.assert_close(o1, o2, rtol=1e-5, atol=1e-6)  # (to rounding: the runs end at the bounds)
    torch.testing.assert_close(l1, l2, rtol=1e-6, atol=1e-6)
    assert torch.equal(st.block_scores(0, same, variants=(7, 15)), st.block_scores(0, qv[1]))


@pytest.mark.parametrize("force_scalar", [False, True], indirect=True)
@pytest.mark.parametrize("succ,intra", [(100, 300), (0, 250), (37, 37), (0, 0), (255, 700)])
def test_snapkv_scores_each_key_by_its_rotation(force_scalar, succ, intra):
    n, bs, w = 700, 8, 24
    st = filled(n, bs, kv_type="FP16")
    qv = rotations(6, w)
    got = st.snapkv_scores(0, qv, n - w, n, n // bs, 7, "mean", variants=(succ, intra))
    k = st.read_keys(0, 0, n)
    twin = block_scores_from_tokens(snapkv_token_scores(qv, k, n - w, 7, "mean", chunk_size=128,
                                                        variants=(succ, intra)), bs, n // bs)
    torch.testing.assert_close(got, twin, rtol=2e-5, atol=1e-7)
    # the twin against the definition: every key's logit from the rotation its position calls for
    q = qv.float() / math.sqrt(D)  # [3, W, H, D]
    logits = torch.einsum("vwhd,nhd->vhwn", q, k.float().repeat_interleave(G, 1))  # [3, H, W, N]
    rot = variant_of(torch.arange(n), succ, intra)
    logits = logits.gather(0, rot.expand(1, H, w, n))[0]
    logits = logits.masked_fill(torch.arange(n)[None, :] > (n - w + torch.arange(w))[:, None], -math.inf)
    probs = logits.softmax(-1).sum(1)  # [H, N]
    pooled = torch.nn.functional.max_pool1d(probs, 7, 1, 3).view(KVH, G, n).mean(1)
    torch.testing.assert_close(twin, block_scores_from_tokens(pooled, bs, n // bs), rtol=1e-5, atol=1e-7)


def test_bad_rotations_are_refused():
    st, qv = filled(100), rotations()
    with pytest.raises(ValueError, match="0 <= succ <= intra"):
        st.attend(0, qv, torch.arange(3, dtype=torch.int32), variants=(5, 2))
    with pytest.raises(ValueError, match="q"):
        st.attend(0, qv[0], torch.arange(3, dtype=torch.int32), variants=(1, 2))  # one rotation given
    with pytest.raises(ValueError, match="variants"):
        st.select(0, qv, 2, variants=(1, 2, 3))
    with pytest.raises(ValueError, match="succ <= intra"):
        st.snapkv_scores(0, rotations(1, 4), 96, 100, 12, variants=(-1, 2))
