"""The fused-projection shapes' part of make_shaped_gguf.py: GLM-4 (``chatglm``) and Phi-3 (``phi3``), their tensors
and keys as llama.cpp's converter writes them (models/chatglm.py and models/phi3.py read them) and the types
llama-quantize gives them:

- a block: ``attn_qkv`` [q + 2 kv, dim] (Q5_K in Q4_K_M, llama-quantize's attn_qkv rule; GLM's with its bias
  ``attn_qkv.bias``), ``attn_output``, ``ffn_up`` [2 ffn, dim] (gate | up), ``ffn_down``;
- keys: ``rope.dimension_count`` (GLM rotates half of each head); Phi-3's LongRoPE: ``rope.scaling.type``,
  ``original_context_length``, ``attn_factor`` = sqrt(1 + ln(context / original) / ln(original)) and the two
  factor tensors ``rope_factors_long/short.weight`` [rope dims / 2] in F32.

Shapes (config.json of each):

| --shape      | dim  | layers | heads/kv x D | ffn   | vocab   | rope dims | base | context   | eps       |
|--------------|------|--------|--------------|-------|---------|-----------|------|-----------|-----------|
| glm4-9b-1m   | 4096 | 40     | 32/4 x 128   | 13696 | 151552  | 64        | 1e8  | 1,048,576 | 1.5625e-7 |
| phi3.5-mini  | 3072 | 32     | 32/32 x 96   | 8192  | (tok.)  | 96        | 1e4  | 131,072   | 1e-5      |

GLM-4-9B-Chat-1M: ``rope_ratio`` 10000 on the base 10,000, ``multi_query_group_num`` 4, ``seq_length`` 1048576,
untied. Phi-3.5-mini-instruct: LongRoPE over an original context of 4,096; its vocabulary is 32,064, fewer tokens
than the bundled SmolLM2 tokenizer's 49,152, so the file takes the tokenizer's (the embeddings and the output 1.5x
theirs: 2% of the file); its factors are made up (about 1 short, about 8 long): the speed does not depend on them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import gguf

Q = gguf.GGMLQuantizationType


@dataclass(frozen=True, slots=True)
class Fused:
    """A fused-projection shape's own: rotated dims, a q | k | v bias, LongRoPE's trained context (0: none)."""

    rope_dim: int
    qkv_bias: bool = False
    original_context: int = 0


def fused_block_plans(shape, fused: Fused, i: int, matrix, norm, vector) -> list:
    """Layer i after its attn_norm: the fused attention, ffn_norm, the fused FFN."""
    from make_shaped_gguf import BIAS_STD

    p, dim, ffn = f"blk.{i}.", shape.dim, shape.ffn
    q, kv = shape.head_size * shape.n_heads, shape.head_size * shape.n_kv_heads
    plans = [matrix(p + "attn_qkv.weight", "attn_qkv", i, q + 2 * kv, dim)]
    if fused.qkv_bias:
        plans.append(vector(p + "attn_qkv.bias", (q + 2 * kv,), 0.0, BIAS_STD))
    plans += [matrix(p + "attn_output.weight", "attn_output", i, dim, q), norm(p + "ffn_norm.weight", dim),
              matrix(p + "ffn_up.weight", "ffn_up", i, 2 * ffn, dim),
              matrix(p + "ffn_down.weight", "ffn_down", i, dim, ffn)]
    return plans


def rope_factor_plans(fused: Fused, tensor_plan) -> list:
    """LongRoPE's two factor tensors: about 1 (short) and about 8 (long), each > 0."""
    if not fused.original_context:
        return []
    return [tensor_plan(f"rope_factors_{k}.weight", (fused.rope_dim // 2,), Q.F32, 0.05, mean)
            for k, mean in (("long", 8.0), ("short", 1.0))]


def display_name(name: str) -> str:
    """general.name's model: llama.cpp gives a model whose name holds "phi3" or "phi-3" Phi-3's token attributes,
    looking up <s>, </s> and <unk>, which the SmolLM2 tokenizer lacks (its load then fails): "Phi 3.5-mini"."""
    return name.replace("phi3", "Phi 3")


def add_fused_metadata(w: gguf.GGUFWriter, shape, fused: Fused) -> None:
    w.add_rope_dimension_count(fused.rope_dim)
    if fused.original_context:  # Phi-3's converter: attn_factor from the trained context's growth
        orig = fused.original_context
        w.add_rope_scaling_type(gguf.RopeScalingType.LONGROPE)
        w.add_rope_scaling_orig_ctx_len(orig)
        w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(shape.context / orig) / math.log(orig)))
        w.add_sliding_window(262144)  # as Phi-3.5-mini's config says (not applied: models/phi3.py)
