"""The hybrid shapes' part of make_shaped_gguf.py: Qwen3.5 / Qwen3.6 (``qwen35``, ``qwen35moe``), three Gated
DeltaNet layers before each gated-attention layer, their tensors and keys as llama.cpp's converter writes them
(models/qwen35.py reads them) and the types llama-quantize gives them:

- a DeltaNet layer: ``attn_qkv`` [2 Hk Dk + Hv Dv, dim] (Q5_K in Q4_K_M, as llama-quantize's attn_qkv rule),
  ``attn_gate`` [Hv Dv, dim], ``ssm_out`` [dim, Hv Dv] (the mix's type); ``ssm_alpha``, ``ssm_beta`` [Hv, dim],
  ``ssm_conv1d`` [channels, kernel], ``ssm_a`` (negative: -exp(A_log)), ``ssm_dt.bias``, ``ssm_norm`` [Dv] in F32;
- an attention layer: ``attn_q`` [2 H D, dim] (q and its output gate per head), ``attn_k/v``, ``attn_output``,
  ``attn_q_norm``/``attn_k_norm`` [D];
- every layer's FFN after ``post_attention_norm``; qwen35moe's experts with a shared expert and its gate.

Shapes (the model cards: Qwen3.5-9B; Qwen3.5-35B-A3B and Qwen3.6-35B-A3B, one architecture):

| --shape          | dim  | layers | attn heads/kv x D | DeltaNet k/v heads x D | ffn / experts        | rope dims |
|------------------|------|--------|-------------------|------------------------|----------------------|-----------|
| qwen3.5-0.8b     | 1024 | 24     | 8/2 x 256         | 16/16 x 128 (*)        | 3584, tied           | 64        |
| qwen3.5-9b       | 4096 | 32     | 16/4 x 256        | 16/32 x 128            | 12288                | 64        |
| qwen3.5-35b-a3b  | 2048 | 40     | 16/2 x 256        | 16/32 x 128            | 256 x 512, 8 + 1 sh. | 64        |
| tiny-hybrid      | 256  | 4      | 4/2 x 64          | 2/4 x 32               | 640                  | 16        |

Vocabulary 248,320, RoPE base 1e7, context 262,144, every fourth layer attention, conv kernel 4. (*) the
0.8B's DeltaNet heads are not on its card: 16 q/k and 16 value heads of 128 are assumed.
"""

from __future__ import annotations

from dataclasses import dataclass

import gguf

Q = gguf.GGMLQuantizationType
SSM_A_MEAN, SSM_A_STD = -2.0, 0.05  # -exp(A_log): negative, so exp(g) <= 1 and the state decays


@dataclass(frozen=True, slots=True)
class Hybrid:
    n_k_heads: int
    n_v_heads: int
    k_dim: int
    v_dim: int
    rope_dim: int
    interval: int = 4
    conv: int = 4
    shared_ffn: int = 0  # qwen35moe: the shared expert's width

    @property
    def conv_dim(self) -> int:
        return 2 * self.n_k_heads * self.k_dim + self.n_v_heads * self.v_dim


def is_attention(h: Hybrid, layer: int) -> bool:
    return (layer + 1) % h.interval == 0


def mixer_plans(shape, h: Hybrid, i: int, matrix, norm, vector) -> list:
    """Layer i's mixer tensors (``matrix(name, kind, layer, rows, cols)``, ``norm(name, n)``, ``vector(name,
    shape, mean, std)`` make the plans)."""
    p, dim = f"blk.{i}.", shape.dim
    if is_attention(h, i):
        q, kv = shape.head_size * shape.n_heads, shape.head_size * shape.n_kv_heads
        return [matrix(p + "attn_q.weight", "attn_q", i, 2 * q, dim), matrix(p + "attn_k.weight", "attn_k", i, kv, dim),
                matrix(p + "attn_v.weight", "attn_v", i, kv, dim),
                matrix(p + "attn_output.weight", "attn_output", i, dim, q),
                norm(p + "attn_k_norm.weight", shape.head_size), norm(p + "attn_q_norm.weight", shape.head_size)]
    value = h.n_v_heads * h.v_dim
    return [matrix(p + "attn_qkv.weight", "attn_qkv", i, h.conv_dim, dim),
            matrix(p + "attn_gate.weight", "attn_gate", i, value, dim),
            vector(p + "ssm_alpha.weight", (h.n_v_heads, dim), 0.0, 0.02),
            vector(p + "ssm_beta.weight", (h.n_v_heads, dim), 0.0, 0.02),
            vector(p + "ssm_conv1d.weight", (h.conv_dim, h.conv), 0.0, 0.2),
            vector(p + "ssm_a", (h.n_v_heads,), SSM_A_MEAN, SSM_A_STD),
            vector(p + "ssm_dt.bias", (h.n_v_heads,), 0.0, 0.5),
            norm(p + "ssm_norm.weight", h.v_dim),
            matrix(p + "ssm_out.weight", "ssm_out", i, dim, value)]


def shared_expert_plans(shape, h: Hybrid, i: int, matrix, vector) -> list:
    """qwen35moe's shared expert of layer i and its gate [dim]."""
    p, dim, width = f"blk.{i}.", shape.dim, h.shared_ffn
    return [vector(p + "ffn_gate_inp_shexp.weight", (dim,), 0.0, 0.02),
            matrix(p + "ffn_gate_shexp.weight", "ffn_gate", i, width, dim),
            matrix(p + "ffn_up_shexp.weight", "ffn_up", i, width, dim),
            matrix(p + "ffn_down_shexp.weight", "ffn_down", i, dim, width)]


def add_hybrid_metadata(w: gguf.GGUFWriter, shape, h: Hybrid) -> None:
    """The converter's keys for the DeltaNet layers, the partial rotary dims and the shared expert."""
    w.add_ssm_conv_kernel(h.conv)
    w.add_ssm_state_size(h.k_dim)
    w.add_ssm_group_count(h.n_k_heads)
    w.add_ssm_time_step_rank(h.n_v_heads)
    w.add_ssm_inner_size(h.n_v_heads * h.v_dim)
    w.add_full_attention_interval(h.interval)
    w.add_rope_dimension_count(h.rope_dim)
    pairs = h.rope_dim // 2  # M-RoPE's sections over the rotated pairs: [11, 11, 10, 0] of 32, as Qwen3.5's
    a = round(pairs * 11 / 32)
    w.add_rope_dimension_sections([a, a, pairs - 2 * a, 0])
    if h.shared_ffn:
        w.add_expert_shared_feed_forward_length(h.shared_ffn)
