"""The gated delta rule of a DeltaNet layer in native code (cpp/delta/: the heads in parallel, AVX2 with a scalar
twin): the one door to it (``models/delta_net.py`` calls it on the CPU)."""

from __future__ import annotations

import torch

from ktquest import _C


def gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     state: torch.Tensor, threads: int, grouped: bool = False) -> torch.Tensor:
    """q, k [T, Hk, Dk] fp32 (l2-normed; q scaled), v [T, Hv, Dv], g, beta [T, Hv]; ``state`` [Hv, Dk, Dv]
    updated in place -> o [T, Hv, Dv]. Value head h reads q/k head h % Hk (h // (Hv / Hk) where ``grouped``).
    CPU tensors only."""
    out = torch.empty_like(v)
    _C.gated_delta_rule(q.contiguous().numpy(), k.contiguous().numpy(), v.contiguous().numpy(),
                        g.contiguous().numpy(), beta.contiguous().numpy(), state.numpy(), out.numpy(), threads,
                        grouped)
    return out
