"""The feed-forward layers of a block (``BlockSpec.ffn``): a gated FFN, and a mixture of gated experts.

    FeedForward:     down(act(gate x) * up x), act = silu (SwiGLU) or tanh-GELU (GeGLU)
    MoEFeedForward:  p = softmax(router x) in fp32;  the k largest p_e (renormalized to sum 1 where norm_topk);
                     sum over those e of p_e * expert_e(x)  [+ sigmoid(shexp_gate . x) * shared(x)]

Each expert is a SwiGLU ``FeedForward`` on its slice of the stacked tensors [n_experts, rows, cols]: a view of
the dequantized stack, or (weights in the file's encoding) a ``QuantWeight`` view of the mapped file, so an
expert's pages are read only when a token is routed to it. A prefill chunk groups its tokens by expert and runs
each used expert once on its group (a GEMV for a few tokens, the quantized GEMM for more: ``layers/linear.py``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ktquest.layers.linear import Linear, QuantWeight, stack_rows

Matrix = torch.Tensor | QuantWeight  # a dequantized tensor, or the file's encoding read in place


class FeedForward(nn.Module):
    """Gated: down(act(gate(x)) * up(x)) with gate and up fused into one matmul; act = silu (SwiGLU) or
    tanh-GELU (GeGLU)."""

    def __init__(self, w_gate: Matrix, w_up: Matrix, w_down: Matrix, kind: str = "swiglu"):
        super().__init__()
        self.w_gate_up = Linear(stack_rows(w_gate, w_up))  # [2*ffn, dim]
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
    equal ones), so a stable sort decides."""
    probs = logits.float().softmax(dim=-1)  # [T, E]
    weights, ids = probs.sort(dim=-1, descending=True, stable=True)
    weights, ids = weights[:, :k], ids[:, :k]  # [T, k], best first
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
        self.experts = nn.ModuleList(FeedForward(g, u, d) for g, u, d in zip(gate, up, down, strict=True))
        self.n_used, self.norm_topk = n_used, norm_topk
        self.shared = None if shared is None else FeedForward(*shared[:3])
        self.shared_gate = None if shared is None else nn.Parameter(shared[3], requires_grad=False)  # [dim]

    @property
    def n_experts(self) -> int:
        return len(self.experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [T, dim] -> [T, dim]
        weights, ids = route(self.router(x), self.n_used, self.norm_topk)  # [T, k] each
        # The (token, slot) pairs grouped by expert: each used expert runs once on its tokens, its outputs
        # written to its run of the grouped rows; one gather puts the rows back in (token, slot) order, and
        # the weighted sum over the slots is one pass (no scatter-add: torch's index_add_ took a fifth of a
        # Qwen3-30B-A3B prefill).
        flat = ids.reshape(-1)  # [T * k]
        order = flat.argsort(stable=True)
        counts = torch.bincount(flat, minlength=self.n_experts).tolist()
        xs = x.index_select(0, order // self.n_used)  # [T * k, dim], grouped by expert
        ys = torch.empty_like(xs)
        start = 0
        for e, n in enumerate(counts):
            if n:
                ys[start: start + n] = self.experts[e](xs[start: start + n])
                start += n
        ys = ys.index_select(0, order.argsort())  # [T * k, dim] in (token, slot) order
        out = torch.bmm(weights.to(ys.dtype).unsqueeze(1), ys.view(len(x), self.n_used, -1)).squeeze(1)  # [T, dim]
        if self.shared is not None:
            g = torch.sigmoid(x @ self.shared_gate.to(x.dtype))  # [T]
            out += g[:, None] * self.shared(x)
        return out
