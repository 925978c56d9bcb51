"""Dense decode attention (cpp/attn/dense_attn.cpp, the dense cache's CPU decode path) against torch."""

import math

import numpy as np
import pytest
import torch

from ktquest import _C
from ktquest.kv.dense import DenseKVCache
from ktquest.native.attention import dense_decode_attention


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, n: int, scale: float):
    """q [H, D], k/v [KVH, S, D] -> (out [H, D], lse [H]) over rows [0, n), in fp64."""
    H, KVH = q.shape[0], k.shape[0]
    kk = k[:, :n].double().repeat_interleave(H // KVH, 0)  # [H, n, D]
    vv = v[:, :n].double().repeat_interleave(H // KVH, 0)
    s = torch.einsum("hd,hnd->hn", q.double(), kk) * scale  # [H, n]
    lse = torch.logsumexp(s, -1)
    out = torch.einsum("hn,hnd->hd", torch.exp(s - lse[:, None]), vv)
    return out.float(), lse.float()


# fp32 logits and an online softmax over tiles, against fp64: a few ulps per row summed over n rows.
RTOL, ATOL = 1e-5, 1e-5


@pytest.mark.parametrize("H,KVH,D", [(9, 3, 64), (4, 4, 128), (8, 1, 64), (32, 8, 128), (3, 1, 16)])
@pytest.mark.parametrize("n", [1, 7, 64, 129, 1000])
def test_matches_reference(force_scalar, H, KVH, D, n):
    g = torch.Generator().manual_seed(H * 7 + n)
    S = n + 5  # rows past n are never read
    q = torch.randn(H, D, generator=g) * 2
    k, v = torch.randn(KVH, S, D, generator=g), torch.randn(KVH, S, D, generator=g)
    k[:, n:] = v[:, n:] = float("nan")
    out, lse = dense_decode_attention(q, k, v, n, 1 / math.sqrt(D), threads=2)
    ref_out, ref_lse = reference(q, k, v, n, 1 / math.sqrt(D))
    torch.testing.assert_close(out, ref_out, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(lse, ref_lse, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("n,skip", [(300, (16, 100)), (300, (0, 64)), (300, (64, 300)), (70, (5, 6))])
def test_skipped_rows_are_not_read(force_scalar, n, skip):
    g = torch.Generator().manual_seed(n + skip[0])
    q = torch.randn(9, 64, generator=g)
    k, v = torch.randn(3, n, 64, generator=g), torch.randn(3, n, 64, generator=g)
    keep = torch.ones(n, dtype=torch.bool)
    keep[skip[0]: skip[1]] = False
    k[:, ~keep] = v[:, ~keep] = float("nan")  # a stale stretch: never read
    out, lse = dense_decode_attention(q, k, v, n, 0.125, threads=2, skip=skip)
    ref_out, ref_lse = reference(q, k[:, keep].contiguous(), v[:, keep].contiguous(), int(keep.sum()), 0.125)
    torch.testing.assert_close(out, ref_out, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(lse, ref_lse, rtol=RTOL, atol=ATOL)


def test_large_logits_do_not_overflow():
    q = torch.full((2, 64), 30.0)
    k = torch.full((1, 300, 64), 30.0)
    k[0, 100] = 31.0  # logits ~ 7000: exp would overflow without subtracting the running max
    v = torch.randn(1, 300, 64)
    out, lse = dense_decode_attention(q, k, v, 300, 1 / 8)
    torch.testing.assert_close(out, reference(q, k, v, 300, 1 / 8)[0], rtol=1e-4, atol=1e-4)
    assert torch.isfinite(lse).all()


def test_thread_count_is_bitwise_deterministic():
    g = torch.Generator().manual_seed(3)
    q, k, v = torch.randn(9, 64, generator=g), torch.randn(3, 5000, 64, generator=g), torch.randn(3, 5000, 64, generator=g)
    outs = [dense_decode_attention(q, k, v, 4999, 0.125, threads=t) for t in (1, 2, 3, 8)]
    for out, lse in outs[1:]:
        assert torch.equal(out, outs[0][0]) and torch.equal(lse, outs[0][1])


def test_scalar_and_avx2_agree():
    g = torch.Generator().manual_seed(4)
    q, k, v = torch.randn(9, 64, generator=g), torch.randn(3, 700, 64, generator=g), torch.randn(3, 700, 64, generator=g)
    fast = dense_decode_attention(q, k, v, 700, 0.125)
    _C.set_force_scalar(True)
    try:
        slow = dense_decode_attention(q, k, v, 700, 0.125)
    finally:
        _C.set_force_scalar(False)
    torch.testing.assert_close(fast[0], slow[0], rtol=RTOL, atol=ATOL)


def test_dense_cache_decode_matches_sdpa():
    """The dense cache's CPU decode step (the native kernel) equals SDPA's (the path CUDA and other dtypes
    take)."""
    g = torch.Generator().manual_seed(5)
    cache = DenseKVCache(2, 3, 64, 512, threads=2)
    for start, t in ((0, 300), (300, 1)):
        for layer in range(2):
            q, k, v = (torch.randn(t, h, 64, generator=g) for h in (9, 3, 3))
            out = cache.attend(layer, q, k, v, start)
    keys, values = (t[None, :, :301] for t in cache.layer_kv(1))
    sdpa = torch.nn.functional.scaled_dot_product_attention(q[:, :, None].transpose(0, 1).reshape(1, 9, 1, 64),
                                                            keys, values, enable_gqa=True)
    torch.testing.assert_close(out, sdpa.reshape(1, 9, 64), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "change,match",
    [
        (dict(q=np.zeros((9, 64), np.float64)), "q: expected a numpy array of dtype float32"),
        (dict(q=np.zeros((8, 64), np.float32)), "multiple of the 3 KV heads"),
        (dict(k=np.zeros((3, 10, 32), np.float32)), r"k: expected shape \[\*, \*, 64\]"),
        (dict(v=np.zeros((3, 11, 64), np.float32)), r"v: expected shape \[3, 10, 64\]"),
        (dict(n=11), "n=11 rows: must be between 1 and the 10 rows of k"),
        (dict(n=0), "n=0 rows"),
        (dict(out=np.zeros((9, 63), np.float32)), r"out: expected shape \[9, 64\]"),
        (dict(n_threads=0), "n_threads must be >= 1"),
        (dict(skip0=4, skip1=11), r"skip \[4, 11\) must be a range within"),
        (dict(skip0=0, skip1=10), "that leaves a row"),
        (dict(q=np.full((9, 64), np.inf, np.float32)), "q contains a non-finite value at head 0"),
        (dict(k=np.zeros((3, 20, 64), np.float32)[:, ::2]), "must be C-contiguous"),
        # sizes of 0 are refused by name before they reach a division (a head_dim of 0 was a SIGFPE)
        (dict(q=np.zeros((9, 0), np.float32), k=np.zeros((3, 10, 0), np.float32), v=np.zeros((3, 10, 0), np.float32),
              out=np.zeros((9, 0), np.float32)), r"q: head_dim \(dimension 1\) must be >= 1, got 0"),
        (dict(q=np.zeros((0, 64), np.float32), out=np.zeros((0, 64), np.float32), lse=np.zeros(0, np.float32)),
         r"q: heads \(dimension 0\) must be >= 1, got 0"),
        (dict(k=np.zeros((0, 10, 64), np.float32), v=np.zeros((0, 10, 64), np.float32)), "multiple of the 0 KV heads"),
        # a non-finite scale gave NaN or zero outputs
        (dict(scale=float("nan")), "scale=nan is not finite"),
        (dict(scale=float("inf")), "scale=inf is not finite"),
    ],
)
def test_bad_arguments_raise(change, match):
    args = dict(q=np.zeros((9, 64), np.float32), k=np.zeros((3, 10, 64), np.float32),
                v=np.zeros((3, 10, 64), np.float32), n=10, scale=0.125, out=np.zeros((9, 64), np.float32),
                lse=np.zeros(9, np.float32), n_threads=1)
    args.update(change)
    with pytest.raises((TypeError, ValueError), match=match):
        _C.dense_decode_attention(**args)


def test_dense_cache_grows_on_demand():
    """max_seq_len is a ceiling: each layer starts at GROW_TOKENS and grows by half again (to a multiple of
    GROW_TOKENS) as tokens arrive, keeping what it held; the attention is the same as a cache sized up front."""
    from ktquest.kv.dense import GROW_TOKENS

    g = torch.Generator().manual_seed(3)
    big = DenseKVCache(2, 2, 16, 8 * GROW_TOKENS)
    assert big.capacity == GROW_TOKENS and big.nbytes() == 2 * 2 * 2 * GROW_TOKENS * 16 * 4
    ref = DenseKVCache(2, 2, 16, 8 * GROW_TOKENS)
    ref._grow(0, 8 * GROW_TOKENS), ref._grow(1, 8 * GROW_TOKENS)  # the whole ceiling at once
    caps = []
    for start, t in ((0, 700), (700, 700), (1400, 1)):
        for layer in range(2):
            q, k, v = (torch.randn(t, h, 16, generator=g) for h in (4, 2, 2))
            out = big.attend(layer, q, k, v, start)
            torch.testing.assert_close(out, ref.attend(layer, q, k, v, start), rtol=0, atol=0)
        caps.append(big.capacity)
    assert caps == [GROW_TOKENS, 2 * GROW_TOKENS, 2 * GROW_TOKENS]
    for i in range(2):
        torch.testing.assert_close(big.layer_kv(i)[0][:, :1401], ref.layer_kv(i)[0][:, :1401], rtol=0, atol=0)
    small = DenseKVCache(1, 1, 16, 100)  # a ceiling under GROW_TOKENS is the first capacity
    assert small.capacity == 100
    with pytest.raises(ValueError, match="do not fit in max_seq_len=100"):
        small.attend(0, *(torch.zeros(101, 1, 16) for _ in range(3)), 0)
