"""The qwen35 family (Qwen3.5 / Qwen3.6: ``qwen35`` dense, ``qwen35moe`` with experts; and Qwen3-Next,
``qwen3next``, whose files keep the DeltaNet's value heads in the model's grouped order with beta's and alpha's
projections fused, ``DeltaNetSpec.grouped``): hybrid models whose
layers are Gated DeltaNet mixers (``BlockSpec.mixer == "delta_net"``, models/delta_net.py) but every
``full_attention_interval``-th, which is attention with

- QK-norm, and an output gate: the q projection makes [q_h, gate_h] per head, attention's output is multiplied by
  sigmoid(gate) (``attn_gate``);
- RoPE on the first ``rope.dimension_count`` dims of each head only (partial rotary, NEOX style; the file's
  ``rope.dimension_sections`` are the multimodal sections of interleaved M-RoPE, which for text, where every
  section's position is the token's, is that RoPE exactly);
- few KV heads: the only k/v the model keeps (the DeltaNet layers keep a fixed-size state: kv/recurrent.py).

Every layer's FFN follows a pre-norm the converter names ``post_attention_norm``; qwen35moe's is a mixture of
experts (the router's softmax, its top-k renormalized as transformers' Qwen3_5MoeTopKRouter always does) with a
shared expert behind a sigmoid gate (qwen2moe's).

What this relies on (transformers 5.x models/qwen3_5/modeling_qwen3_5.py, llama.cpp's converter for
Qwen3_5TextModel): norms stored as 1 + w (Qwen3_5RMSNorm scales by 1 + w) except the DeltaNet's gated norm;
A_log stored as ssm_a = -exp(A_log); dt_bias as ssm_dt.bias; the conv's weight as [channels, kernel]; the value
heads reordered from grouped (by k head) to tiled. The keys: ssm.conv_kernel, ssm.state_size (the k head dim),
ssm.group_count (k heads), ssm.time_step_rank (value heads), ssm.inner_size (value heads x their dim).
"""

from __future__ import annotations

from ktquest.formats.gguf import GGUFTensors
from ktquest.models.args import Family, Metadata
from ktquest.models.block import SHARED_EXPERT_TENSORS, BlockSpec, DeltaNetSpec
from ktquest.models.qwen3moe import moe_fields

FULL_ATTENTION_INTERVAL = 4  # llama.cpp's default where the file has no full_attention_interval
POST_ATTENTION_NORM = "post_attention_norm.weight"


def delta_net_spec(m: Metadata, arch: str, grouped: bool = False) -> DeltaNetSpec:
    """The DeltaNet's sizes from the file's ``{arch}.ssm.*`` keys, each checked."""
    p = f"{arch}.ssm."
    n_k = m.integer(p + "group_count", 1)
    n_v = m.integer(p + "time_step_rank", 1)
    if n_v % n_k:
        raise m.error(p + "time_step_rank", n_v, f"a multiple of {p}group_count={n_k} (each k head serves as many "
                      f"value heads)")
    inner = m.integer(p + "inner_size", 1)
    if inner % n_v:
        raise m.error(p + "inner_size", inner, f"a multiple of {p}time_step_rank={n_v} (value heads x their dim)")
    return DeltaNetSpec(n_k_heads=n_k, n_v_heads=n_v, k_head_dim=m.integer(p + "state_size", 1),
                        v_head_dim=inner // n_v, conv_kernel=m.integer(p + "conv_kernel", 1, 64), grouped=grouped)


def _family_args(m: Metadata, tensors: GGUFTensors, arch: str, n_layers: int, dim: int) -> dict:
    ffn: dict = {}
    if arch in ("qwen35moe", "qwen3next"):
        gate = f"blk.0.{SHARED_EXPERT_TENSORS['w_gate_shexp']}"
        width = tensors.shape(gate)[0] if gate in tensors and len(tensors.shape(gate)) == 2 else None
        shared = m.integer(f"{arch}.expert_shared_feed_forward_length", 1,
                           **({} if width is None else {"default": width}))
        ffn = dict(shared_expert=True, shared_ffn=shared, **moe_fields(m, tensors, arch, norm_default=True))
    interval = m.integer(f"{arch}.full_attention_interval", 1, default=FULL_ATTENTION_INTERVAL)
    attention = BlockSpec(qk_norm=True, attn_gate=True, ffn_norm_tensor=POST_ATTENTION_NORM, **ffn)
    delta = BlockSpec(mixer="delta_net", delta=delta_net_spec(m, arch, grouped=arch == "qwen3next"),
                      ffn_norm_tensor=POST_ATTENTION_NORM, **ffn)
    return {"blocks": tuple(attention if (i + 1) % interval == 0 else delta for i in range(n_layers))}


FAMILY = Family(archs=("qwen35", "qwen35moe", "qwen3next"), read=_family_args)
