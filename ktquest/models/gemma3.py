"""The gemma3 family: Transformer -> Block -> Attention / FeedForward / RMSNorm, llama's skeleton with

- QK-norm: each q and k head RMS-normed over its D values before RoPE;
- "sandwich" norms: the attention's and the FFN's outputs RMS-normed before they join the residual;
- GeGLU: the FFN's gate is tanh-GELU;
- embeddings scaled by sqrt(dim), the LM head tied to them;
- sliding-window attention on five of every six layers (``ModelArgs.swa_layers``): those attend the last
  ``sliding_window`` positions with RoPE of base 10,000; the others attend everything with the file's RoPE.

Norm weights: Gemma's RMSNorm multiplies by (1 + w), and llama.cpp's converter stores 1 + w, so the norms are
llama's. Which positions a layer attends is its cache's business: ``kv/sliding.py`` sends the sliding layers
to a window buffer and the global ones to the configured cache (dense or long_context).
"""

from __future__ import annotations

import torch
from torch import nn

from ktquest.kv.base import KVCache
from ktquest.layers.linear import Linear, stack_rows
from ktquest.models.args import ModelArgs
from ktquest.models.llama import BlockWeights, FeedForward, RMSNorm, Transformer
from ktquest.models.rope import apply_rope


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, layer_idx: int, w: BlockWeights):
        super().__init__()
        self.layer_idx = layer_idx
        self.n_heads, self.n_kv_heads, self.head_dim = args.n_heads, args.n_kv_heads, args.head_dim
        self.wqkv = Linear(stack_rows(w.wq, w.wk, w.wv))  # rows [q (H*D) | k (KVH*D) | v (KVH*D)]
        self.wo = Linear(w.wo)
        self.q_norm = RMSNorm(w.q_norm, args.norm_eps)  # [D]
        self.k_norm = RMSNorm(w.k_norm, args.norm_eps)  # [D]

    def forward(self, x: torch.Tensor, start_pos: int, cos: torch.Tensor, sin: torch.Tensor,
                cache: KVCache) -> torch.Tensor:
        t, h, kvh, d = x.shape[0], self.n_heads, self.n_kv_heads, self.head_dim
        qkv = self.wqkv(x).view(t, h + 2 * kvh, d)  # [T, H + 2*KVH, D]
        q = apply_rope(self.q_norm(qkv[:, :h]), cos, sin)  # [T, H, D]
        k = apply_rope(self.k_norm(qkv[:, h: h + kvh]), cos, sin)  # [T, KVH, D]
        out = cache.attend(self.layer_idx, q, k, qkv[:, h + kvh:], start_pos)  # [T, H, D]
        return self.wo(out.reshape(t, h * d))  # [T, dim]


class Block(nn.Module):
    def __init__(self, args: ModelArgs, layer_idx: int, w: BlockWeights, qkv_perm: torch.Tensor | None):
        super().__init__()
        if qkv_perm is not None:
            raise ValueError("gemma3 files keep q/k rows in order (NEOX RoPE): no qkv_perm")
        self.attn_norm = RMSNorm(w.attn_norm, args.norm_eps)
        self.attn = Attention(args, layer_idx, w)
        self.post_attn_norm = RMSNorm(w.post_attn_norm, args.norm_eps)
        self.ffn_norm = RMSNorm(w.ffn_norm, args.norm_eps)
        self.ffn = FeedForward(w.w_gate, w.w_up, w.w_down, activation=args.activation)
        self.post_ffn_norm = RMSNorm(w.post_ffn_norm, args.norm_eps)
        self.layer_idx = layer_idx

    def forward(self, x: torch.Tensor, start_pos: int, cos: torch.Tensor, sin: torch.Tensor,
                cache: KVCache) -> torch.Tensor:
        h = x + self.post_attn_norm(self.attn(self.attn_norm(x), start_pos, cos, sin, cache))
        return h + self.post_ffn_norm(self.ffn(self.ffn_norm(h)))


class Gemma3Transformer(Transformer):
    """Token ids -> logits for a gemma3 file (the embedding scale and the two RoPE tables are the
    skeleton's, from ``ModelArgs``)."""

    block = Block
