"""The chatglm family (GLM-4-9B-Chat and GLM-4-9B-Chat-1M: GGUF ``chatglm``): llama's blocks with

- q/k/v biases; q | k | v in one ``attn_qkv`` tensor (and ``attn_qkv.bias``) in files converted from THUDM's own
  checkpoints, three tensors in those from the -hf ones (``BlockSpec.fused_qkv`` follows the file);
- the FFN's gate | up in one ``ffn_up`` tensor of 2 x ffn rows, the gate's first (``BlockSpec.fused_gate_up``);
- RoPE on the first ``rope.dimension_count`` dims of each head (64 of 128) over adjacent pairs, as GLM rotates
  them (ggml's "normal" RoPE): ``loader.qk_perm`` gathers them into rotate-half order.

Its tokenizer's pre-tokenizer is ``chatglm-bpe`` and its chat template opens with ``[gMASK]<sop>`` (no BOS token):
both come from the file (formats/tokenizer.py, formats/chat_template.py).
"""

from __future__ import annotations

from ktquest.formats.gguf import GGUFTensors
from ktquest.models.args import Family, Metadata
from ktquest.models.block import BlockSpec


def _family_args(m: Metadata, tensors: GGUFTensors, arch: str, n_layers: int, dim: int) -> dict:
    fused = "blk.0.attn_qkv.weight" in tensors
    bias = f"blk.0.{'attn_qkv' if fused else 'attn_q'}.bias" in tensors
    spec = BlockSpec(qkv_bias=bias, fused_qkv=fused, fused_gate_up=True)
    return {"blocks": (spec,) * n_layers, "permuted_qk": True}


FAMILY = Family(archs=("chatglm",), read=_family_args)
