"""Tiny GLM-4 and Phi-3 models (transformers' GlmForCausalLM and Phi3ForCausalLM; random init) and their GGUF
tensors and keys as llama.cpp's converter writes them: ``chatglm`` (q/k/v with biases, three tensors or one
``attn_qkv``; gate | up as one ``ffn_up``; partial RoPE over adjacent pairs, rows as the model has them) and
``phi3`` (``attn_qkv``, ``ffn_up`` fused; NEOX RoPE, partial or whole; LongRoPE's factors as two tensors and the
attention factor as a key)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch


@dataclass(frozen=True)
class GlmPhiSpec:
    arch: str  # "chatglm" | "phi3"
    fused_qkv: bool = True  # one attn_qkv tensor (chatglm: THUDM's checkpoints), or attn_q / attn_k / attn_v
    dim: int = 64
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 2
    ffn: int = 96
    ctx: int = 256
    partial: float = 1.0  # the share of each head's dims RoPE rotates
    rope_theta: float = 10000.0
    eps: float = 1e-5
    tied: bool = False
    original_ctx: int = 0  # phi3: LongRoPE's trained context (0: no LongRoPE)

    @property
    def hd(self) -> int:
        return self.dim // self.n_heads

    @property
    def rope_dim(self) -> int:
        return int(self.hd * self.partial)

    def factors(self) -> tuple[list[float], list[float]]:
        """LongRoPE's short and long per-frequency divisors (rising, as Phi-3's are)."""
        n = self.rope_dim // 2
        return [1.0 + 0.05 * i for i in range(n)], [1.0 + 1.5 * i for i in range(n)]


GLM_PHI_SPECS = {
    # GLM-4-9B-Chat-1M's shape in small: half of each head rotated, 2 KV heads, biases; fused and separate q/k/v
    "chatglm": GlmPhiSpec("chatglm", partial=0.5, rope_theta=1e6, eps=1.5625e-07),
    "chatglm_split": GlmPhiSpec("chatglm", fused_qkv=False, partial=0.5, n_layers=3, tied=True),
    # Phi-3.5-mini: every dim rotated, LongRoPE over a trained context of 64; Phi-4-mini: 3/4 of them
    "phi3": GlmPhiSpec("phi3", original_ctx=64),
    "phi4_mini": GlmPhiSpec("phi3", partial=0.75, n_kv_heads=1, original_ctx=64, tied=True),
}


def build_glm_phi(spec: GlmPhiSpec, vocab_size: int, seed: int = 0) -> torch.nn.Module:
    """A random transformers model of ``spec`` (every parameter random, the norms around 1)."""
    from transformers import GlmConfig, GlmForCausalLM, Phi3Config, Phi3ForCausalLM

    common = dict(vocab_size=vocab_size, hidden_size=spec.dim, intermediate_size=spec.ffn,
                  num_hidden_layers=spec.n_layers, num_attention_heads=spec.n_heads,
                  num_key_value_heads=spec.n_kv_heads, max_position_embeddings=spec.ctx, rms_norm_eps=spec.eps,
                  tie_word_embeddings=spec.tied, pad_token_id=0, bos_token_id=None, eos_token_id=None)
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": spec.rope_theta, "partial_rotary_factor": spec.partial}
    torch.manual_seed(seed)
    if spec.arch == "chatglm":
        model = GlmForCausalLM(GlmConfig(head_dim=spec.hd, attention_bias=True, rope_parameters=rope, **common))
    else:
        if spec.original_ctx:
            short, long = spec.factors()
            rope |= {"rope_type": "longrope", "short_factor": short, "long_factor": long}
        model = Phi3ForCausalLM(Phi3Config(original_max_position_embeddings=spec.original_ctx or spec.ctx,
                                           rope_parameters=rope, **common))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen) if name.endswith("norm.weight")
                    else 0.15 * torch.randn(p.shape, generator=gen))
    return model.eval()


def glm_phi_gguf_tensors(model: torch.nn.Module, spec: GlmPhiSpec) -> dict[str, np.ndarray]:
    """GGUF name -> float32 array, as the converter writes them (no row permutation for either)."""
    sd = {k: v.detach().float().numpy().copy() for k, v in model.state_dict().items()}
    out = {"token_embd.weight": sd["model.embed_tokens.weight"], "output_norm.weight": sd["model.norm.weight"]}
    if not spec.tied:
        out["output.weight"] = sd["lm_head.weight"]
    q, kv = spec.n_heads * spec.hd, spec.n_kv_heads * spec.hd
    for i in range(spec.n_layers):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        out |= {b + "attn_norm.weight": sd[p + "input_layernorm.weight"],
                b + "ffn_norm.weight": sd[p + "post_attention_layernorm.weight"],
                b + "attn_output.weight": sd[p + "self_attn.o_proj.weight"],
                b + "ffn_up.weight": sd[p + "mlp.gate_up_proj.weight"],  # [2 ffn, dim]: gate, then up
                b + "ffn_down.weight": sd[p + "mlp.down_proj.weight"]}
        kinds = ("weight", "bias") if spec.arch == "chatglm" else ("weight",)
        for kind in kinds:
            if spec.arch == "phi3":
                fused = sd[p + "self_attn.qkv_proj.weight"]
                parts = np.split(fused, [q, q + kv])
            else:
                parts = [sd[p + f"self_attn.{n}_proj.{kind}"] for n in "qkv"]
                fused = np.concatenate(parts)
            if spec.fused_qkv:
                out[b + f"attn_qkv.{kind}"] = fused
            else:
                out |= {b + f"attn_{n}.{kind}": np.ascontiguousarray(w) for n, w in zip("qkv", parts)}
    if spec.original_ctx:  # Phi-3's converter: both sets of LongRoPE divisors
        short, long = spec.factors()
        out["rope_factors_long.weight"] = np.asarray(long, np.float32)
        out["rope_factors_short.weight"] = np.asarray(short, np.float32)
    return out


def glm_phi_metadata(spec: GlmPhiSpec) -> dict[str, Any]:
    a = spec.arch
    md: dict[str, Any] = {
        f"{a}.block_count": spec.n_layers, f"{a}.context_length": spec.ctx, f"{a}.embedding_length": spec.dim,
        f"{a}.feed_forward_length": spec.ffn, f"{a}.attention.head_count": spec.n_heads,
        f"{a}.attention.head_count_kv": spec.n_kv_heads, f"{a}.attention.layer_norm_rms_epsilon": spec.eps,
        f"{a}.rope.dimension_count": spec.rope_dim, f"{a}.rope.freq_base": spec.rope_theta,
    }
    if spec.original_ctx:  # attn_factor from the context's growth, as Phi-3's converter writes it
        orig = spec.original_ctx
        md[f"{a}.rope.scaling.original_context_length"] = orig
        md[f"{a}.rope.scaling.attn_factor"] = math.sqrt(1 + math.log(spec.ctx / orig) / math.log(orig))
    if a == "phi3":
        md[f"{a}.attention.sliding_window"] = 2 * spec.ctx  # as the 128K files say (not applied)
    return md
