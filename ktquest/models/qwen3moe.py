"""The qwen3moe family (Qwen3-MoE: Qwen3-30B-A3B, Qwen3-235B-A22B, Qwen3-Coder-30B-A3B): qwen3's attention
(QK-norm, no biases, head_dim from the file) and a mixture-of-experts FFN on every layer (``BlockSpec.ffn ==
"moe"``, models/ffn.py): ``expert_count`` SwiGLU experts of width ``expert_feed_forward_length``, the router's
softmax, the ``expert_used_count`` best experts renormalized to sum 1 (``expert_weights_norm``; llama.cpp always
renormalizes qwen3moe, as every released Qwen3-MoE config sets norm_topk_prob, so an absent key means true)."""

from __future__ import annotations

from ktquest.formats.gguf import GGUFError, GGUFTensors
from ktquest.models.args import Family, Metadata
from ktquest.models.block import MOE_TENSORS, BlockSpec

GATING_SOFTMAX = 1  # llama.cpp's expert_gating_func values: 1 softmax, 2 sigmoid


def moe_fields(m: Metadata, tensors: GGUFTensors, arch: str, norm_default: bool) -> dict:
    """A moe ``BlockSpec``'s expert fields from the file's ``{arch}.expert_*`` keys, each checked."""
    n = m.integer(f"{arch}.expert_count", 1)
    used = m.integer(f"{arch}.expert_used_count", 1)
    if used > n:
        raise m.error(f"{arch}.expert_used_count", used, f"at most {arch}.expert_count={n} (the experts a token "
                      f"runs, of the {n} the file has)")
    gate = f"blk.0.{MOE_TENSORS['w_gate_exps']}"  # the width, where the key is missing: the stack's rows
    width = tensors.shape(gate)[-2] if gate in tensors and len(tensors.shape(gate)) == 3 else None
    ffn = m.integer(f"{arch}.expert_feed_forward_length", 1,
                    **({} if width is None else {"default": width}))
    norm = m.value(f"{arch}.expert_weights_norm", norm_default)
    if not isinstance(norm, bool):
        raise m.error(f"{arch}.expert_weights_norm", norm, "true or false")
    gating = m.integer(f"{arch}.expert_gating_func", 0, default=GATING_SOFTMAX)
    if gating != GATING_SOFTMAX:
        raise m.error(f"{arch}.expert_gating_func", gating, f"{GATING_SOFTMAX} (softmax; sigmoid routers are not "
                      f"supported)")
    scale = m.number(f"{arch}.expert_weights_scale", 0.0, default=1.0)
    if scale != 1.0:
        raise GGUFError(f"{m.path}: {arch}.expert_weights_scale={scale}: scaled expert weights are not supported")
    return {"ffn": "moe", "n_experts": n, "n_experts_used": used, "expert_ffn": ffn, "norm_topk": norm}


def _family_args(m: Metadata, tensors: GGUFTensors, arch: str, n_layers: int, dim: int) -> dict:
    return {"blocks": (BlockSpec(qk_norm=True, **moe_fields(m, tensors, arch, norm_default=True)),) * n_layers}


FAMILY = Family(archs=("qwen3moe",), read=_family_args)
