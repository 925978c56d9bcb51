"""The feed-forward layers of a block (``BlockSpec.ffn``): a gated FFN, and a mixture of gated experts.

    FeedForward:     down(act(gate x) * up x), act = silu (SwiGLU) or tanh-GELU (GeGLU)
    MoEFeedForward:  p = softmax(router x) in fp32;  the k largest p_e (renormalized to sum 1 where norm_topk);
                     sum over those e of p_e * expert_e(x)  [+ sigmoid(shexp_gate . x) * shared(x)]

Each expert is a SwiGLU ``FeedForward`` on its slice of the stacked tensors [n_experts, rows, cols]: a view of
the dequantized stack, or (weights in the file's encoding) a ``QuantWeight`` view of the mapped file, so an
expert's pages are read only when a token is routed to it. A prefill chunk groups its tokens by expert and runs
each used expert once on its group (a GEMV for a few tokens, the quantized GEMM for more: ``layers/linear.py``);
with every expert on the int8 GEMM, the groups of more than a few tokens go through one native call a matrix
(``matrix.gemm_int8_grouped``: x quantized once, the experts' panels as the tasks of one parallel pass) instead of
a call an expert.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ktquest.layers.linear import GEMV_MAX_TOKENS, Linear, QuantWeight, stack_rows
from ktquest.native import matrix

Matrix = torch.Tensor | QuantWeight  # a dequantized tensor, or the file's encoding read in place


class FeedForward(nn.Module):
    """Gated: down(act(gate(x)) * up(x)) with gate and up fused into one matmul; act = silu (SwiGLU) or
    tanh-GELU (GeGLU)."""

    def __init__(self, w_gate_up: Matrix, w_down: Matrix, kind: str = "swiglu"):
        super().__init__()
        self.w_gate_up = Linear(w_gate_up)  # [2*ffn, dim]: the gate's rows, then the up's (stack_rows)
        self.w_down = Linear(w_down)  # [dim, ffn]
        self.kind = kind

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.w_gate_up(x).chunk(2, dim=-1)  # [T, ffn] each
        act = F.silu(gate) if self.kind == "swiglu" else F.gelu(gate, approximate="tanh")
        return self.w_down(act.mul_(up))


def route(logits: torch.Tensor, k: int, norm_topk: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] -> (weights fp32 [T, k], expert ids int64 [T, k]): softmax in fp32, the k largest,
    renormalized to sum 1 where norm_topk. Equal probabilities go to the lower expert id first, here and in the
    native step (cpp/moe/): torch.topk leaves their order unspecified (on the CPU it picks ids 6, 5, 4 of eight
    equal ones), so it ranks int64 keys that carry the tie-break: a probability's fp32 bits (ordered as the
    values: they are >= 0) above E - 1 - id (a stable sort's order; half the time of sorting every expert)."""
    probs = logits.float().softmax(dim=-1)  # [T, E]
    n_exp = probs.shape[-1]
    keys = probs.view(torch.int32).to(torch.int64) << 32 | (n_exp - 1 - torch.arange(n_exp, device=probs.device))
    ids = keys.topk(k, dim=-1).indices  # [T, k], best first
    weights = probs.gather(-1, ids)
    if norm_topk:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


class MoEFeedForward(nn.Module):
    """A mixture of SwiGLU experts (``BlockSpec.ffn == "moe"``), and the shared expert where the block has one.

    w_router: [E, dim]; gate/up: [E, ffn_e, dim] and down: [E, dim, ffn_e] stacks (a tensor, or one
    ``QuantWeight`` an expert); shared: (gate, up, down, shexp_gate [dim]) or None."""

    def __init__(self, w_router: Matrix, gate, up, down, n_used: int, norm_topk: bool,
                 shared: tuple | None = None):
        super().__init__()
        self.router = Linear(w_router)  # [E, dim]
        self.experts = nn.ModuleList(FeedForward(stack_rows(g, u), d) for g, u, d in zip(gate, up, down, strict=True))
        self.n_used, self.norm_topk = n_used, norm_topk
        self.shared = None if shared is None else FeedForward(stack_rows(*shared[:2]), shared[2])
        self.shared_gate = None if shared is None else nn.Parameter(shared[3], requires_grad=False)  # [dim]

    @property
    def n_experts(self) -> int:
        return len(self.experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [T, dim] -> [T, dim]
        weights, ids = route(self.router(x), self.n_used, self.norm_topk)  # [T, k] each
        # The (token, slot) pairs grouped by expert: each used expert runs once on its tokens (src: the token of
        # each grouped row, read in place by the grouped GEMM), its outputs written to its run of the grouped
        # rows; the weighted sum over each token's slots then reads its k rows where they are (one
        # embedding_bag pass: no scatter-add, whose index_add_ took a fifth of a Qwen3-30B-A3B prefill, and no
        # gather of the rows back into (token, slot) order).
        flat = ids.reshape(-1)  # [T * k]
        order = flat.argsort(stable=True)
        counts = torch.bincount(flat, minlength=self.n_experts).tolist()
        ys = self._experts(x, order // self.n_used, counts)  # [T * k, dim], grouped by expert
        pos = order.argsort().view(len(x), self.n_used)  # [T, k]: each (token, slot)'s row of ys
        out = F.embedding_bag(pos, ys, per_sample_weights=weights.to(ys.dtype), mode="sum")  # [T, dim]
        if self.shared is not None:
            g = torch.sigmoid(x @ self.shared_gate.to(x.dtype))  # [T]
            out += g[:, None] * self.shared(x)
        return out

    def _experts(self, x: torch.Tensor, src: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """Grouped rows (``counts`` an expert; row i is token src[i] of x [T, dim]) -> each expert's output on its
        rows [N, dim]: a group of a few tokens through its expert's GEMV, the rest in two grouped GEMM calls
        (gate|up, down) where every expert takes the int8 GEMM, else one expert at a time."""
        ys = torch.empty(len(src), x.shape[1], dtype=x.dtype, device=x.device)
        big = [n > GEMV_MAX_TOKENS for n in counts]
        if any(big) and not self._groupable(x):  # (checked only where a group is big: a decode step has none)
            big = [False] * len(counts)
        start = 0
        for e, n in enumerate(counts):
            if n and not big[e]:
                ys[start: start + n] = self.experts[e](x.index_select(0, src[start: start + n]))
            start += n
        if any(big):
            self._grouped(x, src, counts, big, ys)
        return ys

    def _groupable(self, x: torch.Tensor) -> bool:
        """Every expert's gate|up and down on the int8 GEMM (encoded, int8 activations: ``Linear.use_x16``)."""
        return x.dtype == torch.float32 and x.device.type == "cpu" and all(
            e.w_gate_up.quant is not None and e.w_gate_up._int8_gemm and e.w_down._int8_gemm for e in self.experts)

    def _grouped(self, x: torch.Tensor, src: torch.Tensor, counts: list[int], big: list[bool],
                 ys: torch.Tensor) -> None:
        """The ``big`` groups' rows of ys from two native calls (the others' rows left as they are), the gate|up
        call reading each row's token of x in place (x quantized once, however many experts a token goes to).
        Where every group is big or empty (a prefill chunk: some 16 tokens an expert) the down call writes into
        ys in place."""
        every = all(b or n == 0 for n, b in zip(counts, big))  # (an expert no token chose has no rows)
        if every:
            rows, take = src, None
        else:
            ends = torch.tensor([0] + counts).cumsum(0)
            take = torch.cat([torch.arange(int(ends[e]), int(ends[e + 1])) for e in range(len(counts)) if big[e]])
            rows = src.index_select(0, take)  # [M]: the big groups' tokens, in expert order
        sizes = [n if b else 0 for n, b in zip(counts, big)]
        offsets = np.asarray([0] + sizes, np.int64).cumsum()
        first = self.experts[0]
        threads = first.w_gate_up.threads
        gu = torch.empty(len(rows), first.w_gate_up.out_features)
        matrix.gemm_int8_grouped([e.w_gate_up.qm for e in self.experts], offsets, x.contiguous().numpy(), gu.numpy(),
                                 threads, rows.contiguous().numpy())
        gate, up = gu.chunk(2, dim=-1)
        act = F.silu(gate).mul_(up).contiguous()
        down = ys if every else torch.empty(len(rows), first.w_down.out_features)
        matrix.gemm_int8_grouped([e.w_down.qm for e in self.experts], offsets, act.numpy(), down.numpy(), threads)
        if not every:
            ys.index_copy_(0, take, down)
