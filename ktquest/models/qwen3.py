"""The qwen3 family (Qwen3 and Qwen3-2507 dense models): llama's blocks with QK-norm (each q and k head
RMS-normed over head_dim before RoPE), no biases, and head_dim from the file (``attention.key_length``: 128 in
the released models, whatever the width); the converter keeps q/k rows in order (NEOX RoPE)."""

from __future__ import annotations

from ktquest.formats.gguf import GGUFTensors
from ktquest.models.args import Family, Metadata
from ktquest.models.block import BlockSpec


def _family_args(m: Metadata, tensors: GGUFTensors, arch: str, n_layers: int, dim: int) -> dict:
    return {"blocks": (BlockSpec(qk_norm=True),) * n_layers}


FAMILY = Family(archs=("qwen3",), read=_family_args)
