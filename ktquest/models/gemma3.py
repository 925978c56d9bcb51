"""The gemma3 family: the blocks of ``models/llama.py`` with

- QK-norm: each q and k head RMS-normed over its D values before RoPE;
- "sandwich" norms: the attention's and the FFN's outputs RMS-normed before they join the residual;
- GeGLU: the FFN's gate is tanh-GELU;
- embeddings scaled by sqrt(dim), the LM head tied to them;
- sliding-window attention on five of every six layers: those attend the last ``sliding_window`` positions
  with RoPE of base 10,000 (table 1); the others attend everything with the file's RoPE (table 0).

Norm weights: Gemma's RMSNorm multiplies by (1 + w), and llama.cpp's converter stores 1 + w, so the norms are
llama's. Which positions a layer attends is its cache's business: ``kv/sliding.py`` sends the sliding layers to
a window buffer and the global ones to the configured cache (dense or long_context).
"""

from __future__ import annotations

import math

from ktquest.formats.gguf import GGUFTensors
from ktquest.models.args import Family, Metadata
from ktquest.models.block import BlockSpec

# One global-attention layer in every SWA_PATTERN (the rest slide over a window), and the local layers' RoPE
# base: llama.cpp's defaults where the file names neither.
SWA_PATTERN = 6
LOCAL_ROPE_THETA = 10000.0


def _family_args(m: Metadata, tensors: GGUFTensors, arch: str, n_layers: int, dim: int) -> dict:
    window = m.integer("gemma3.attention.sliding_window", 1)
    pattern = m.integer("gemma3.attention.sliding_window_pattern", 1, default=SWA_PATTERN)
    common = dict(qk_norm=True, sandwich_norms=True, ffn="geglu")
    sliding = BlockSpec(attention="sliding", window=window, rope=1, **common)
    full = BlockSpec(**common)
    blocks = tuple(sliding if (i + 1) % pattern != 0 else full for i in range(n_layers))
    return {"blocks": blocks, "rope_theta_local": LOCAL_ROPE_THETA, "emb_scale": math.sqrt(dim)}


FAMILY = Family(archs=("gemma3",), read=_family_args)
