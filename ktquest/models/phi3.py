"""The phi3 family (Phi-3-mini/medium, Phi-3.5-mini, Phi-4-mini: GGUF ``phi3``): llama's blocks with

- q | k | v in one ``attn_qkv`` tensor (three tensors where a converter split them: ``BlockSpec.fused_qkv``
  follows the file) and the FFN's gate | up in one ``ffn_up`` of 2 x ffn rows, the gate's first;
- NEOX RoPE, partial on Phi-4-mini (``rope.dimension_count``: 96 of 128 dims);
- LongRoPE on the 128K models: the file's ``rope_factors_short/long.weight`` (models/rope.py takes the long ones
  when the cache holds more than ``rope.scaling.original_context_length`` tokens, as llama.cpp does by its
  n_ctx), cos/sin times ``rope.scaling.attn_factor``.

Every layer attends every position: the files' ``attention.sliding_window`` (2047 on the 4K models, 262144 on the
128K ones) is not applied, as llama.cpp does not apply it.
"""

from __future__ import annotations

from ktquest.formats.gguf import GGUFTensors
from ktquest.models.args import Family, Metadata
from ktquest.models.block import BlockSpec


def _family_args(m: Metadata, tensors: GGUFTensors, arch: str, n_layers: int, dim: int) -> dict:
    spec = BlockSpec(qkv_bias=f"blk.0.attn_{'qkv' if 'blk.0.attn_qkv.weight' in tensors else 'q'}.bias" in tensors,
                     fused_qkv="blk.0.attn_qkv.weight" in tensors, fused_gate_up=True)
    return {"blocks": (spec,) * n_layers}


FAMILY = Family(archs=("phi3",), read=_family_args)
