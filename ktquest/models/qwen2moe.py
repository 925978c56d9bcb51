"""The qwen2moe family (Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B): qwen2's attention (q/k/v biases, no QK-norm, rows in
order for NEOX RoPE) and a mixture-of-experts FFN with a shared expert on every layer (``BlockSpec.ffn == "moe"``,
models/ffn.py):

    f(x) = sum over the k best e of p_e * expert_e(x)  +  sigmoid(ffn_gate_inp_shexp . x) * shared(x)

``expert_count`` SwiGLU experts of width ``expert_feed_forward_length`` (default: the stacks' rows), the router's
softmax in fp32, the ``expert_used_count`` best experts as the softmax gives them: not renormalized unless the file
sets ``expert_weights_norm`` (llama.cpp builds qwen2moe with norm_w false; transformers' Qwen2MoeConfig has
norm_topk_prob=False, and the released Qwen1.5-MoE / Qwen2-MoE configs keep it), and the shared SwiGLU of width
``expert_shared_feed_forward_length`` (default: the rows of blk.0.ffn_gate_shexp) added after a sigmoid gate.

What this relies on, read in transformers 5.x's models/qwen2_moe/modeling_qwen2_moe.py: Qwen2MoeAttention has
q/k/v biases (``qkv_bias``, default true) and no o bias, no q/k norms; Qwen2MoeTopKRouter takes softmax(router x)
in fp32, its top-k, and divides by their sum only where ``norm_topk_prob``; Qwen2MoeSparseMoeBlock adds
``sigmoid(shared_expert_gate(x)) * shared_expert(x)`` (a Linear(dim, 1): ffn_gate_inp_shexp, [dim] in the file, or
[1, dim] unsqueezed, which llama.cpp also reads: models/loader.py takes both) to the experts' weighted sum; every
layer is sparse where ``decoder_sparse_step`` is 1 and ``mlp_only_layers`` empty, as in the released models (a file
with dense layers between has no ffn_*_exps there and is refused by name when read). Sliding-window attention is
off in those configs (``use_sliding_window`` false), and llama.cpp reads none for qwen2moe.
"""

from __future__ import annotations

from ktquest.formats.gguf import GGUFTensors
from ktquest.models.args import Family, Metadata
from ktquest.models.block import SHARED_EXPERT_TENSORS, BlockSpec
from ktquest.models.qwen3moe import moe_fields


def _family_args(m: Metadata, tensors: GGUFTensors, arch: str, n_layers: int, dim: int) -> dict:
    gate = f"blk.0.{SHARED_EXPERT_TENSORS['w_gate_shexp']}"  # the width, where the key is missing: its rows
    width = tensors.shape(gate)[0] if gate in tensors and len(tensors.shape(gate)) == 2 else None
    shared = m.integer(f"{arch}.expert_shared_feed_forward_length", 1, **({} if width is None else {"default": width}))
    spec = BlockSpec(qkv_bias=True, shared_expert=True, shared_ffn=shared,
                     **moe_fields(m, tensors, arch, norm_default=False))
    return {"blocks": (spec,) * n_layers}


FAMILY = Family(archs=("qwen2moe",), read=_family_args)
