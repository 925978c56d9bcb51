"""Linear layers of the model: one place that decides how a weight is multiplied.

On CUDA and for prefill chunks this is ``torch.nn.functional.linear``. On the CPU, single-token decode
is bound by reading the weights, so a Q8_0 copy (int8 in groups of 32 with an fp32 scale, a quarter of
the fp32 bytes) can be multiplied by the AVX2 GEMV of ``ktquest._C`` instead (``decode_weights``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class Linear(torch.nn.Module):
    """y = x @ W.T (+ b).  weight: [out, in], bias: [out] or None."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        self.weight = torch.nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else torch.nn.Parameter(bias, requires_grad=False)

    @property
    def in_features(self) -> int:
        return self.weight.shape[1]

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [T, in] -> [T, out]
        return F.linear(x, self.weight, self.bias)
