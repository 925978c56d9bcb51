"""Tiny Qwen3.5 models (transformers' Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM; random init) and their GGUF
tensors and keys as llama.cpp's converter writes them (``Qwen3_5TextModel``: norms as 1 + w but the DeltaNet's
gated norm, ssm_a = -exp(A_log), dt_bias as ssm_dt.bias, the conv squeezed to [channels, kernel], the value
heads reordered from grouped-by-k-head to tiled, the MoE's experts stacked)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class Qwen35Spec:
    moe: bool = False
    dim: int = 64
    n_layers: int = 4  # layers 0-2 DeltaNet, 3 attention (full_attention_interval 4)
    interval: int = 4
    n_heads: int = 4
    n_kv_heads: int = 2
    head_dim: int = 32
    rope_dim: int = 8  # partial_rotary_factor 0.25
    ffn: int = 96
    n_k_heads: int = 2  # the DeltaNet's q/k heads, and 3 value heads each (tiled in the file)
    n_v_heads: int = 6
    k_head_dim: int = 16
    v_head_dim: int = 24
    conv_kernel: int = 4
    n_experts: int = 5
    n_used: int = 2
    expert_ffn: int = 32
    shared_ffn: int = 48
    ctx: int = 512
    rope_theta: float = 1e6
    eps: float = 1e-6
    tied: bool = False
    next: bool = False  # Qwen3-Next (qwen3next: MoE, value heads grouped, beta and alpha fused in the file)

    @property
    def arch(self) -> str:
        return "qwen3next" if self.next else "qwen35moe" if self.moe else "qwen35"


QWEN35_SPECS = {
    "qwen35": Qwen35Spec(),
    "qwen35_tied": Qwen35Spec(tied=True, n_layers=6, interval=3, n_k_heads=3, n_v_heads=3, v_head_dim=16),
    "qwen35moe": Qwen35Spec(moe=True),
    "qwen3next": Qwen35Spec(moe=True, next=True),
}


def build_qwen35(spec: Qwen35Spec, vocab_size: int, seed: int = 0) -> torch.nn.Module:
    """A random transformers Qwen3.5 (every parameter random, the norms around 0 as their 1 + w scale wants)."""
    from transformers import (
        Qwen3_5ForCausalLM,
        Qwen3_5MoeForCausalLM,
        Qwen3_5MoeTextConfig,
        Qwen3_5TextConfig,
        Qwen3NextConfig,
        Qwen3NextForCausalLM,
    )

    torch.manual_seed(seed)
    common = dict(
        vocab_size=vocab_size, hidden_size=spec.dim, num_hidden_layers=spec.n_layers,
        num_attention_heads=spec.n_heads, num_key_value_heads=spec.n_kv_heads, head_dim=spec.head_dim,
        linear_conv_kernel_dim=spec.conv_kernel, linear_key_head_dim=spec.k_head_dim,
        linear_value_head_dim=spec.v_head_dim, linear_num_key_heads=spec.n_k_heads,
        linear_num_value_heads=spec.n_v_heads, max_position_embeddings=spec.ctx, rms_norm_eps=spec.eps,
        tie_word_embeddings=spec.tied,
        layer_types=["full_attention" if (i + 1) % spec.interval == 0 else "linear_attention"
                     for i in range(spec.n_layers)],
        rope_parameters={"rope_type": "default", "rope_theta": spec.rope_theta,
                         "partial_rotary_factor": spec.rope_dim / spec.head_dim,
                         "mrope_section": [spec.rope_dim // 4, spec.rope_dim // 8, spec.rope_dim // 8],
                         "mrope_interleaved": True})
    if spec.next:
        rope = {k: v for k, v in common["rope_parameters"].items() if not k.startswith("mrope")}
        cfg = Qwen3NextConfig(num_experts=spec.n_experts, num_experts_per_tok=spec.n_used,
                              moe_intermediate_size=spec.expert_ffn, shared_expert_intermediate_size=spec.shared_ffn,
                              norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
                              **(common | {"rope_parameters": rope}))
        model = Qwen3NextForCausalLM(cfg).eval()
    elif spec.moe:
        cfg = Qwen3_5MoeTextConfig(num_experts=spec.n_experts, num_experts_per_tok=spec.n_used,
                                   moe_intermediate_size=spec.expert_ffn,
                                   shared_expert_intermediate_size=spec.shared_ffn, **common)
        model = Qwen3_5MoeForCausalLM(cfg).eval()
    else:
        model = Qwen3_5ForCausalLM(Qwen3_5TextConfig(intermediate_size=spec.ffn, **common)).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.empty(p.shape).uniform_(0.5, 4.0, generator=gen).log())
            elif name.endswith("norm.weight"):
                p.copy_(0.1 * torch.randn(p.shape, generator=gen) + (1.0 if "linear_attn.norm" in name else 0.0))
            else:
                p.copy_(0.15 * torch.randn(p.shape, generator=gen))
    return model


def _tiled(t: np.ndarray, axis: int, spec: Qwen35Spec, head: int) -> np.ndarray:
    """The value heads along ``axis`` (each ``head`` wide) from grouped-by-k-head to tiled order."""
    r = spec.n_v_heads // spec.n_k_heads
    shape = t.shape
    t = t.reshape(*shape[:axis], spec.n_k_heads, r, head, *shape[axis + 1:])
    return np.ascontiguousarray(np.swapaxes(t, axis, axis + 1)).reshape(shape)


def qwen35_gguf_tensors(model: torch.nn.Module, spec: Qwen35Spec) -> dict[str, np.ndarray]:
    """GGUF name -> float32 array, as llama.cpp's converter writes a Qwen3.5."""
    sd = {k.removeprefix("model."): v.detach().float().numpy().copy() for k, v in model.state_dict().items()}
    out = {"token_embd.weight": sd["embed_tokens.weight"], "output_norm.weight": sd["norm.weight"] + 1}
    if not spec.tied:
        out["output.weight"] = sd["lm_head.weight"]
    kd = spec.n_k_heads * spec.k_head_dim
    for i in range(spec.n_layers):
        p, b = f"layers.{i}.", f"blk.{i}."
        out[b + "attn_norm.weight"] = sd[p + "input_layernorm.weight"] + 1
        out[b + "post_attention_norm.weight"] = sd[p + "post_attention_layernorm.weight"] + 1
        if p + "self_attn.q_proj.weight" in sd:
            a = p + "self_attn."
            out |= {b + "attn_q.weight": sd[a + "q_proj.weight"], b + "attn_k.weight": sd[a + "k_proj.weight"],
                    b + "attn_v.weight": sd[a + "v_proj.weight"], b + "attn_output.weight": sd[a + "o_proj.weight"],
                    b + "attn_q_norm.weight": sd[a + "q_norm.weight"] + 1,
                    b + "attn_k_norm.weight": sd[a + "k_norm.weight"] + 1}
        elif spec.next:  # the converter's split of in_proj_qkvz: q, k, v (grouped) and z; in_proj_ba as it is
            a, r = p + "linear_attn.", spec.n_v_heads // spec.n_k_heads
            w = sd[a + "in_proj_qkvz.weight"].reshape(spec.n_k_heads, -1, spec.dim)
            cuts = np.cumsum([spec.k_head_dim, spec.k_head_dim, r * spec.v_head_dim])
            q, k, v, z = (x.reshape(-1, spec.dim) for x in np.split(w, cuts, axis=1))
            out |= {b + "attn_qkv.weight": np.concatenate([q, k, v]), b + "attn_gate.weight": z,
                    b + "ssm_ba.weight": sd[a + "in_proj_ba.weight"], b + "ssm_a": -np.exp(sd[a + "A_log"]),
                    b + "ssm_dt.bias": sd[a + "dt_bias"],
                    b + "ssm_conv1d.weight": sd[a + "conv1d.weight"].reshape(-1, spec.conv_kernel),
                    b + "ssm_norm.weight": sd[a + "norm.weight"], b + "ssm_out.weight": sd[a + "out_proj.weight"]}
        else:
            a = p + "linear_attn."
            qkv = sd[a + "in_proj_qkv.weight"]
            conv = sd[a + "conv1d.weight"].reshape(qkv.shape[0], spec.conv_kernel)
            out |= {
                b + "attn_qkv.weight": np.concatenate([qkv[: 2 * kd], _tiled(qkv[2 * kd:], 0, spec, spec.v_head_dim)]),
                b + "attn_gate.weight": _tiled(sd[a + "in_proj_z.weight"], 0, spec, spec.v_head_dim),
                b + "ssm_beta.weight": _tiled(sd[a + "in_proj_b.weight"], 0, spec, 1),
                b + "ssm_alpha.weight": _tiled(sd[a + "in_proj_a.weight"], 0, spec, 1),
                b + "ssm_a": _tiled(-np.exp(sd[a + "A_log"]), 0, spec, 1),
                b + "ssm_dt.bias": _tiled(sd[a + "dt_bias"], 0, spec, 1),
                b + "ssm_conv1d.weight": np.concatenate([conv[: 2 * kd], _tiled(conv[2 * kd:], 0, spec,
                                                                                 spec.v_head_dim)]),
                b + "ssm_norm.weight": sd[a + "norm.weight"],
                b + "ssm_out.weight": _tiled(sd[a + "out_proj.weight"], 1, spec, spec.v_head_dim)}
        if spec.moe:
            m = p + "mlp."
            gate, up = np.split(sd[m + "experts.gate_up_proj"], 2, axis=1)
            out |= {b + "ffn_gate_inp.weight": sd[m + "gate.weight"],
                    b + "ffn_gate_exps.weight": np.ascontiguousarray(gate),
                    b + "ffn_up_exps.weight": np.ascontiguousarray(up),
                    b + "ffn_down_exps.weight": sd[m + "experts.down_proj"],
                    b + "ffn_gate_shexp.weight": sd[m + "shared_expert.gate_proj.weight"],
                    b + "ffn_up_shexp.weight": sd[m + "shared_expert.up_proj.weight"],
                    b + "ffn_down_shexp.weight": sd[m + "shared_expert.down_proj.weight"],
                    b + "ffn_gate_inp_shexp.weight": sd[m + "shared_expert_gate.weight"].reshape(-1)}
        else:
            out |= {b + f"ffn_{n}.weight": sd[p + f"mlp.{n}_proj.weight"] for n in ("gate", "up", "down")}
    return out


def qwen35_metadata(spec: Qwen35Spec) -> dict:
    """The converter's keys for ``spec``."""
    a = spec.arch
    md = {f"{a}.block_count": spec.n_layers, f"{a}.context_length": spec.ctx, f"{a}.embedding_length": spec.dim,
          f"{a}.feed_forward_length": spec.ffn, f"{a}.attention.head_count": spec.n_heads,
          f"{a}.attention.head_count_kv": spec.n_kv_heads, f"{a}.attention.key_length": spec.head_dim,
          f"{a}.attention.value_length": spec.head_dim, f"{a}.rope.freq_base": spec.rope_theta,
          f"{a}.rope.dimension_count": spec.rope_dim, f"{a}.attention.layer_norm_rms_epsilon": spec.eps,
          f"{a}.ssm.conv_kernel": spec.conv_kernel, f"{a}.ssm.state_size": spec.k_head_dim,
          f"{a}.ssm.group_count": spec.n_k_heads, f"{a}.ssm.time_step_rank": spec.n_v_heads,
          f"{a}.ssm.inner_size": spec.n_v_heads * spec.v_head_dim, f"{a}.full_attention_interval": spec.interval}
    if spec.moe:
        md |= {f"{a}.expert_count": spec.n_experts, f"{a}.expert_used_count": spec.n_used,
               f"{a}.expert_feed_forward_length": spec.expert_ffn,
               f"{a}.expert_shared_feed_forward_length": spec.shared_ffn}
    return md
