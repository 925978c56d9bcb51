"""A small torch InternLM2 (transformers has no class for it): the reference for the ``internlm2`` arch.

It follows InternLM2's own modeling code (``modeling_internlm2.py``, trust_remote_code): one fused ``wqkv``
whose output holds, per KV head, its group's query heads then its key and its value head
([KVH, G + 2, D] with G = H / KVH); rotate-half RoPE (dynamic NTK when ``spec.rope`` says so, with the
sequence's length as InternLM2's ``DynamicNTKScalingRotaryEmbedding`` takes it); ``wo``; SwiGLU
``w2(silu(w1 x) * w3 x)``; pre-norm ``attention_norm`` / ``ffn_norm``; ``output`` untied.

``as_llama_tensors`` is the converter's half that is InternLM2's own: the fused ``wqkv`` split into q, k, v
as ``convert_hf_to_gguf.py`` splits it, under Llama's Hugging Face names, so that ``conftest`` writes the GGUF
as it writes a llama's (Q/K rows permuted, llama.cpp's tensor names).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(dim)), eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


def rotary(spec: Any, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [seq_len, D] as InternLM2's rotary embeddings make them for a sequence of seq_len tokens."""
    d, base = spec.dim // spec.n_heads, spec.rope_theta
    rope = spec.rope or {}
    if rope.get("rope_type") == "dynamic" and seq_len > spec.ctx:
        f = rope["factor"]
        base = base * ((f * seq_len / spec.ctx) - (f - 1)) ** (d / (d - 2))
    inv_freq = 1.0 / (base ** (torch.arange(0, d, 2).float() / d))  # [D/2]
    freqs = torch.outer(torch.arange(seq_len, dtype=torch.float32), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)  # [T, D]
    return emb.cos(), emb.sin()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Attention(nn.Module):
    def __init__(self, spec: Any):
        super().__init__()
        self.h, self.kvh, self.d = spec.n_heads, spec.n_kv_heads, spec.dim // spec.n_heads
        self.wqkv = nn.Linear(spec.dim, (self.h + 2 * self.kvh) * self.d, bias=False)
        self.wo = nn.Linear(self.h * self.d, spec.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        t, g = x.shape[0], self.h // self.kvh
        qkv = self.wqkv(x).view(t, self.kvh, g + 2, self.d)  # "b q (h gs d) -> b q h gs d"
        q = qkv[:, :, :g].reshape(t, self.h, self.d).transpose(0, 1)  # [H, T, D]
        k, v = qkv[:, :, -2].transpose(0, 1), qkv[:, :, -1].transpose(0, 1)  # [KVH, T, D]
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        k, v = k.repeat_interleave(g, dim=0), v.repeat_interleave(g, dim=0)  # repeat_kv: [H, T, D]
        scores = q @ k.transpose(1, 2) / self.d ** 0.5  # [H, T, T]
        scores = scores.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
        out = scores.softmax(-1, dtype=torch.float32) @ v  # [H, T, D]
        return self.wo(out.transpose(0, 1).reshape(t, self.h * self.d))


class FeedForward(nn.Module):
    def __init__(self, spec: Any):
        super().__init__()
        self.w1 = nn.Linear(spec.dim, spec.ffn, bias=False)
        self.w3 = nn.Linear(spec.dim, spec.ffn, bias=False)
        self.w2 = nn.Linear(spec.ffn, spec.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class DecoderLayer(nn.Module):
    def __init__(self, spec: Any):
        super().__init__()
        self.attention_norm, self.attention = RMSNorm(spec.dim, spec.eps), Attention(spec)
        self.ffn_norm, self.feed_forward = RMSNorm(spec.dim, spec.eps), FeedForward(spec)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin)
        return h + self.feed_forward(self.ffn_norm(h))


class InternLM2Model(nn.Module):
    def __init__(self, spec: Any, vocab_size: int):
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab_size, spec.dim)
        self.layers = nn.ModuleList(DecoderLayer(spec) for _ in range(spec.n_layers))
        self.norm = RMSNorm(spec.dim, spec.eps)


class InternLM2ForCausalLM(nn.Module):
    """``model(ids [1, T]).logits`` [1, T, V], as the Hugging Face models are called in the tests."""

    def __init__(self, spec: Any, vocab_size: int):
        super().__init__()
        self.spec = spec
        self.model = InternLM2Model(spec, vocab_size)
        self.output = nn.Linear(spec.dim, vocab_size, bias=False)

    def forward(self, ids: torch.Tensor) -> SimpleNamespace:
        cos, sin = rotary(self.spec, ids.shape[1])
        x = self.model.tok_embeddings(ids[0])  # [T, dim]
        for layer in self.model.layers:
            x = layer(x, cos, sin)
        return SimpleNamespace(logits=self.output(self.model.norm(x))[None])


def as_llama_tensors(model: InternLM2ForCausalLM) -> dict[str, np.ndarray]:
    """The model's tensors under Llama's Hugging Face names, ``wqkv`` split as llama.cpp's converter splits
    it: rows [KVH, G + 2, D, dim] -> q = [:, :G], k = [:, -2], v = [:, -1] (not yet permuted)."""
    s = model.spec
    h, kvh, d = s.n_heads, s.n_kv_heads, s.dim // s.n_heads
    sd = {k: v.detach().float().numpy().copy() for k, v in model.state_dict().items()}
    out = {"model.embed_tokens.weight": sd["model.tok_embeddings.weight"],
           "model.norm.weight": sd["model.norm.weight"], "lm_head.weight": sd["output.weight"]}
    names = {"attention.wo": "self_attn.o_proj", "feed_forward.w1": "mlp.gate_proj",
             "feed_forward.w3": "mlp.up_proj", "feed_forward.w2": "mlp.down_proj",
             "attention_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}
    for i in range(s.n_layers):
        p = f"model.layers.{i}."
        qkv = sd[p + "attention.wqkv.weight"].reshape(kvh, h // kvh + 2, d, s.dim)
        out |= {p + "self_attn.q_proj.weight": qkv[:, :-2].reshape(h * d, s.dim),
                p + "self_attn.k_proj.weight": qkv[:, -2].reshape(kvh * d, s.dim),
                p + "self_attn.v_proj.weight": qkv[:, -1].reshape(kvh * d, s.dim)}
        out |= {p + llama + ".weight": sd[p + name + ".weight"] for name, llama in names.items()}
    return out
