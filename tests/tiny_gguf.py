"""Tiny Hugging Face models and their GGUF tensors and metadata, as ``convert_hf_to_gguf.py`` writes them: the
specs of the test models (``TINY_SPECS``, ``MOE_SPECS``, ``QWEN2MOE_SPECS``, ``GEMMA3_SPECS``), ``build_hf_model`` (random init),
``hf_to_gguf_tensors`` / ``gguf_metadata``; ``conftest.write_gguf`` writes the file with the test tokenizer."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import gguf
import numpy as np
import torch
from tiny_internlm2 import InternLM2ForCausalLM, as_llama_tensors


@dataclass(frozen=True)
class TinySpec:
    arch: str  # "llama" | "qwen2" | "internlm2" | "qwen3" | "gemma3" | "qwen3moe" | "qwen2moe"
    tied: bool
    rope: dict | None = None  # HF rope_parameters beyond the default
    dim: int = 64
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 2
    ffn: int = 128
    ctx: int = 256
    rope_theta: float = 10000.0
    eps: float = 1e-5
    window: int = 0  # gemma3: the sliding window ...
    swa_pattern: int = 0  # ... on all layers but every swa_pattern-th (0: llama.cpp's 6, no metadata key)
    head_dim: int = 0  # 0: dim // n_heads (qwen3 sets its own)
    n_experts: int = 0  # qwen3moe, qwen2moe: the experts, how many run a token, their width, renormalized or not
    n_used: int = 0
    expert_ffn: int = 0
    norm_topk: bool = True
    shared_ffn: int = 0  # qwen2moe: the shared expert's width

    @property
    def hd(self) -> int:
        return self.head_dim or self.dim // self.n_heads


TINY_SPECS = {
    "llama": TinySpec("llama", tied=False),
    "llama_tied": TinySpec("llama", tied=True),
    "llama_linear": TinySpec("llama", tied=True, rope={"rope_type": "linear", "factor": 2.0}),
    "llama3": TinySpec("llama", tied=False, rope={"rope_type": "llama3", "factor": 8.0,
                                                  "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                  "original_max_position_embeddings": 64}),
    "qwen2": TinySpec("qwen2", tied=True),
    "qwen2_untied": TinySpec("qwen2", tied=False, rope_theta=1e6),
    "qwen2_yarn": TinySpec("qwen2", tied=True, rope={"rope_type": "yarn", "factor": 4.0,
                                                     "original_max_position_embeddings": 64}),
    # Phi-3's LongRoPE on llama: factor = ctx / original context, as Phi-3's configs imply it
    "llama_longrope": TinySpec("llama", tied=False, rope={
        "rope_type": "longrope", "factor": 4.0, "original_max_position_embeddings": 64,
        "short_factor": [1.0 + 0.1 * i for i in range(8)], "long_factor": [1.0 + 1.5 * i for i in range(8)]}),
    "internlm2": TinySpec("internlm2", tied=False),
    # QK-norm, no biases, a head_dim that is not dim / n_heads (as Qwen3's 128 at any width)
    "qwen3": TinySpec("qwen3", tied=True, head_dim=32, rope_theta=1e6, eps=1e-6),
    # Qwen3-8B/14B past 32K: YaRN from the file's keys (factor 4 on the original context)
    "qwen3_yarn": TinySpec("qwen3", tied=False, head_dim=32, rope_theta=1e6, eps=1e-6,
                           rope={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}),
}


# qwen3moe (tests/test_moe.py): an odd expert count, renormalized top-2 (the key absent: qwen3moe's default),
# and top-3 of 8 as trained (expert_weights_norm false in the file)
MOE_SPECS = {
    "qwen3moe": TinySpec("qwen3moe", tied=False, head_dim=32, rope_theta=1e6, eps=1e-6, n_layers=3, n_experts=5,
                         n_used=2, expert_ffn=48),
    "qwen3moe_nonorm": TinySpec("qwen3moe", tied=True, head_dim=16, rope_theta=1e6, eps=1e-6, n_experts=8,
                                n_used=3, expert_ffn=32, norm_topk=False),
}


# qwen2moe (tests/test_qwen2moe.py): q/k/v biases, a shared expert; an odd expert count with top-2 as trained (the
# key absent: qwen2moe's default), and top-3 of 4 renormalized (expert_weights_norm true in the file)
QWEN2MOE_SPECS = {
    "qwen2moe": TinySpec("qwen2moe", tied=False, rope_theta=1e6, eps=1e-6, n_layers=3, n_experts=5, n_used=2,
                         expert_ffn=48, shared_ffn=96, norm_topk=False),
    "qwen2moe_norm": TinySpec("qwen2moe", tied=True, n_experts=4, n_used=3, expert_ffn=32, shared_ffn=64),
}


# gemma3 (tests/test_gemma3.py): the default pattern (layers 0-4 slide, 5 is global), and a pattern of 3 whose
# last layer slides; windows shorter than the test prompts
GEMMA3_SPECS = {
    "gemma3": TinySpec("gemma3", tied=True, n_layers=6, n_kv_heads=1, ctx=512, rope_theta=1e6, eps=1e-6, window=8),
    "gemma3_p3": TinySpec("gemma3", tied=True, n_layers=4, ctx=512, rope_theta=1e6, eps=1e-6, window=5,
                          swa_pattern=3),
}


def _gemma3_config(spec: TinySpec, vocab_size: int):
    from transformers import Gemma3TextConfig

    pattern = spec.swa_pattern or 6
    return Gemma3TextConfig(
        vocab_size=vocab_size, hidden_size=spec.dim, intermediate_size=spec.ffn, num_hidden_layers=spec.n_layers,
        num_attention_heads=spec.n_heads, num_key_value_heads=spec.n_kv_heads, head_dim=spec.hd,
        max_position_embeddings=spec.ctx, rms_norm_eps=spec.eps, query_pre_attn_scalar=spec.hd,
        sliding_window=spec.window, pad_token_id=0, bos_token_id=None, eos_token_id=None,
        layer_types=["full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
                     for i in range(spec.n_layers)],
        rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": spec.rope_theta},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}})


def build_hf_model(spec: TinySpec, vocab_size: int, seed: int = 0) -> torch.nn.Module:
    """A random HF model (InternLM2: ``tiny_internlm2``'s); every parameter (norms and biases too) is random
    so each one is tested. The weights depend on the architecture and sizes only, not on ``spec.rope``."""
    from transformers import (
        Gemma3ForCausalLM,
        LlamaConfig,
        LlamaForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen2MoeConfig,
        Qwen2MoeForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
    )

    torch.manual_seed(seed)
    if spec.arch == "internlm2":
        model = InternLM2ForCausalLM(spec, vocab_size).eval()
    elif spec.arch == "gemma3":
        model = Gemma3ForCausalLM(_gemma3_config(spec, vocab_size)).eval()
    else:
        config_cls, model_cls = {"llama": (LlamaConfig, LlamaForCausalLM),
                                 "qwen2": (Qwen2Config, Qwen2ForCausalLM),
                                 "qwen3": (Qwen3Config, Qwen3ForCausalLM),
                                 "qwen3moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM),
                                 "qwen2moe": (Qwen2MoeConfig, Qwen2MoeForCausalLM)}[spec.arch]
        moe = {"num_experts": spec.n_experts, "num_experts_per_tok": spec.n_used, "norm_topk_prob": spec.norm_topk,
               "moe_intermediate_size": spec.expert_ffn, "decoder_sparse_step": 1, "mlp_only_layers": []}
        cfg = config_cls(
            **({"head_dim": spec.hd} if spec.arch in ("qwen3", "qwen3moe") else {}),
            **(moe if spec.arch in ("qwen3moe", "qwen2moe") else {}),
            **({"shared_expert_intermediate_size": spec.shared_ffn} if spec.arch == "qwen2moe" else {}),
            vocab_size=vocab_size, hidden_size=spec.dim, intermediate_size=spec.ffn,
            num_hidden_layers=spec.n_layers, num_attention_heads=spec.n_heads,
            num_key_value_heads=spec.n_kv_heads, max_position_embeddings=spec.ctx,
            rms_norm_eps=spec.eps, tie_word_embeddings=spec.tied,
            rope_parameters={"rope_type": "default", "rope_theta": spec.rope_theta, **(spec.rope or {})},
        )
        model = model_cls(cfg).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(0.15 * torch.randn(p.shape, generator=gen))
    return model


def permute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp converter's LlamaModel.permute: rotate-half rows -> interleaved pairs, per head."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama3_rope_freqs(spec: TinySpec) -> np.ndarray:
    """The converter's rope_freqs.weight for llama3 rope scaling: per-frequency divisors [D/2]."""
    r = spec.rope
    d = spec.hd
    freqs = 1.0 / (spec.rope_theta ** (np.arange(0, d, 2, dtype=np.float64) / d))
    low_wavelen = r["original_max_position_embeddings"] / r["low_freq_factor"]
    high_wavelen = r["original_max_position_embeddings"] / r["high_freq_factor"]
    factors = []
    for f in freqs:
        wavelen = 2 * np.pi / f
        if wavelen < high_wavelen:
            factors.append(1.0)
        elif wavelen > low_wavelen:
            factors.append(r["factor"])
        else:
            smooth = (r["original_max_position_embeddings"] / wavelen - r["low_freq_factor"]) / (
                r["high_freq_factor"] - r["low_freq_factor"])
            factors.append(1.0 / ((1 - smooth) / r["factor"] + smooth))
    return np.asarray(factors, dtype=np.float32)


def hf_to_gguf_tensors(model: torch.nn.Module, spec: TinySpec) -> dict[str, np.ndarray]:
    """GGUF name -> float32 array [rows, cols], llama/internlm2 Q/K permuted like the converter does
    (internlm2's fused wqkv split first: ``tiny_internlm2.as_llama_tensors``)."""
    if spec.arch == "internlm2":
        sd = as_llama_tensors(model)
    else:
        sd = {k: v.detach().float().numpy().copy() for k, v in model.state_dict().items()}
    permuted = spec.arch in ("llama", "internlm2")
    out = {"token_embd.weight": sd["model.embed_tokens.weight"],
           "output_norm.weight": sd["model.norm.weight"]}
    if not spec.tied:
        out["output.weight"] = sd["lm_head.weight"]
    names = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm",
             "post_attention_layernorm": "ffn_norm"}
    if spec.arch == "gemma3":  # the sandwich norms; every norm stored as 1 + w (Gemma's RMSNorm scales by 1 + w)
        names |= {"post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm",
                  "post_feedforward_layernorm": "post_ffw_norm", "self_attn.q_norm": "attn_q_norm",
                  "self_attn.k_norm": "attn_k_norm"}
        sd = {k: v + 1.0 if k.endswith("norm.weight") else v for k, v in sd.items()}
        out["output_norm.weight"] = sd["model.norm.weight"]
    if spec.arch in ("qwen3", "qwen3moe"):
        names |= {"self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm"}
    if spec.arch == "qwen2moe":  # the shared expert, its gate [1, dim] written as [dim]
        names |= {"mlp.shared_expert.gate_proj": "ffn_gate_shexp", "mlp.shared_expert.up_proj": "ffn_up_shexp",
                  "mlp.shared_expert.down_proj": "ffn_down_shexp", "mlp.shared_expert_gate": "ffn_gate_inp_shexp"}
        sd |= {k: v.reshape(-1) for k, v in sd.items() if k.endswith("mlp.shared_expert_gate.weight")}
    if spec.arch in ("qwen3moe", "qwen2moe"):  # the router, and the experts stacked [E, rows, cols] as converted
        names |= {"mlp.gate": "ffn_gate_inp"}
        for i in range(spec.n_layers):
            gate, up = np.split(sd.pop(f"model.layers.{i}.mlp.experts.gate_up_proj"), 2, axis=1)
            out[f"blk.{i}.ffn_gate_exps.weight"] = np.ascontiguousarray(gate)  # [E, ffn_e, dim]
            out[f"blk.{i}.ffn_up_exps.weight"] = np.ascontiguousarray(up)
            out[f"blk.{i}.ffn_down_exps.weight"] = sd.pop(f"model.layers.{i}.mlp.experts.down_proj")  # [E, dim, ffn_e]
    for i in range(spec.n_layers):
        for hf_name, g_name in names.items():
            for kind in ("weight", "bias"):
                key = f"model.layers.{i}.{hf_name}.{kind}"
                if key not in sd:
                    continue
                w = sd[key]
                if permuted and g_name == "attn_q":
                    w = permute_qk(w, spec.n_heads)
                elif permuted and g_name == "attn_k":
                    w = permute_qk(w, spec.n_kv_heads)
                out[f"blk.{i}.{g_name}.{kind}"] = w
    if spec.rope and spec.rope["rope_type"] == "llama3":
        out["rope_freqs.weight"] = llama3_rope_freqs(spec)
    if spec.rope and spec.rope["rope_type"] == "longrope":  # as Phi-3's converter writes them
        out["rope_factors_long.weight"] = np.asarray(spec.rope["long_factor"], dtype=np.float32)
        out["rope_factors_short.weight"] = np.asarray(spec.rope["short_factor"], dtype=np.float32)
    return out


def gguf_metadata(spec: TinySpec, vocab_size: int) -> dict[str, Any]:
    """The converter's hyper-parameter keys for ``spec`` (GGUF key -> value)."""
    a = spec.arch
    md: dict[str, Any] = {
        f"{a}.block_count": spec.n_layers,
        f"{a}.context_length": spec.ctx,
        f"{a}.embedding_length": spec.dim,
        f"{a}.feed_forward_length": spec.ffn,
        f"{a}.attention.head_count": spec.n_heads,
        f"{a}.attention.head_count_kv": spec.n_kv_heads,
        f"{a}.rope.freq_base": spec.rope_theta,
        f"{a}.attention.layer_norm_rms_epsilon": spec.eps,
    }
    if a == "llama":
        md[f"{a}.vocab_size"] = vocab_size
        md[f"{a}.rope.dimension_count"] = spec.hd
    if a in ("gemma3", "qwen3", "qwen3moe"):
        md[f"{a}.attention.key_length"] = md[f"{a}.attention.value_length"] = spec.hd
    if a in ("qwen3moe", "qwen2moe"):
        md[f"{a}.expert_count"] = spec.n_experts
        md[f"{a}.expert_used_count"] = spec.n_used
        md[f"{a}.expert_feed_forward_length"] = spec.expert_ffn
        if spec.norm_topk != (a == "qwen3moe"):  # the key where it is not the architecture's default
            md[f"{a}.expert_weights_norm"] = spec.norm_topk
    if a == "qwen2moe":
        md[f"{a}.expert_shared_feed_forward_length"] = spec.shared_ffn
    if a == "gemma3":
        md[f"{a}.attention.sliding_window"] = spec.window
        if spec.swa_pattern:
            md[f"{a}.attention.sliding_window_pattern"] = spec.swa_pattern
    rope = spec.rope or {}
    if rope.get("rope_type") == "linear":
        md[f"{a}.rope.scaling.type"] = "linear"
        md[f"{a}.rope.scaling.factor"] = rope["factor"]
    elif rope.get("rope_type") == "yarn":
        md[f"{a}.rope.scaling.type"] = "yarn"
        md[f"{a}.rope.scaling.factor"] = rope["factor"]
        md[f"{a}.rope.scaling.original_context_length"] = rope["original_max_position_embeddings"]
    elif rope.get("rope_type") == "longrope":  # Phi-3's converter: attn_factor from the context's growth
        orig = rope["original_max_position_embeddings"]
        md[f"{a}.rope.scaling.type"] = "longrope"
        md[f"{a}.rope.scaling.original_context_length"] = orig
        md[f"{a}.rope.scaling.attn_factor"] = math.sqrt(1 + math.log(spec.ctx / orig) / math.log(orig))
    return md


def finish_gguf(w: gguf.GGUFWriter) -> None:
    """Write out a GGUFWriter whose keys and tensors are added: header, key/values, tensor data, close."""
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
