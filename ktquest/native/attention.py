"""The dense decode attention of one token over a dense fp32 K/V buffer, in C++ (cpp/attn/dense_attn.h): the
same tile kernel and split-K merge as the store's sparse operator, read at the memory's bandwidth."""

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
