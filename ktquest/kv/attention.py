"""Attention pieces shared by the caches: the native dense decode attention, and the exact merge of two
attentions over disjoint key sets by their log-sum-exp."""

from __future__ import annotations

import torch

from ktquest import _C
from ktquest.native.args import as_numpy, check_int


def dense_decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, n: int, scale: float,
                           threads: int = 1, out: torch.Tensor | None = None,
                           skip: tuple[int, int] = (0, 0)) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode token's attention over the first ``n`` rows of a dense fp32 cache but rows [skip), in C++.

    q: [H, D], k/v: [KVH, S, D] (S >= n) -> out [H, D], lse [H] (fp32; GQA: head i reads KV head i // (H/KVH)).
    """
    qn = as_numpy(q, "q", (torch.float32,), 2)
    kn, vn = as_numpy(k, "k", (torch.float32,), 3), as_numpy(v, "v", (torch.float32,), 3)
    if out is None:
        out = torch.empty(qn.shape[0], qn.shape[1])
    lse = torch.empty(qn.shape[0])
    _C.dense_decode_attention(qn, kn, vn, check_int(n, "n", 1), float(scale), as_numpy(out, "out", (torch.float32,), 2),
                              lse.numpy(), check_int(threads, "threads", 1), skip[0], skip[1])
    return out, lse


def merge_attention(
    out1: torch.Tensor, lse1: torch.Tensor, out2: torch.Tensor, lse2: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact softmax merge of attention over two disjoint key sets. out*: [..., H, D], lse*: [..., H]
    (natural log; -inf = empty part, whose out rows are zeros). Returns (out, lse) of the union.

    Part 2's weight in the union is exp(lse2 - lse) = sigmoid(lse2 - lse1): 1 when part 1 is empty, 0 when
    part 2 is (and 0 when both are: their sigmoid is NaN).
    """
    w2 = torch.sigmoid(lse2 - lse1).nan_to_num_(0.0)
    return torch.lerp(out1, out2, w2.unsqueeze(-1)), torch.logaddexp(lse1, lse2)
