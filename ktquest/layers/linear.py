"""Linear layers of the model: one place that decides how a weight is multiplied.

On CUDA and for prefill chunks this is ``torch.nn.functional.linear`` on the fp32/fp16 weight. On the
CPU, single-token decode is bound by reading the weights, so each layer can also hold a Q8_0 copy
(int8 in groups of 32 with an fp32 scale: 1.125 bytes a weight instead of 4) that the AVX2 GEMV of
``ktquest._C`` multiplies (``decode_weights: q8_0``). Only the weights are rounded (the activation stays
fp32), so decode logits differ from the fp32 path by a few tenths of a percent.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ktquest import _C

# Rows up to this many tokens take the GEMV path; longer chunks are compute-bound and go to torch.
GEMV_MAX_TOKENS = 4


class Linear(torch.nn.Module):
    """y = x @ W.T (+ b).  weight: [out, in], bias: [out] or None."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        self.weight = torch.nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else torch.nn.Parameter(bias, requires_grad=False)
        # The Q8_0 copy for CPU decode: (qw int8 [out, in], dw fp32 [out, in/32], bias numpy or None)
        self.q8: tuple | None = None
        self.threads = 1

    @property
    def in_features(self) -> int:
        return self.weight.shape[1]

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    def enable_q8(self, threads: int) -> bool:
        """Quantize a Q8_0 copy of the weight for CPU decode; False when this layer can't use it."""
        w = self.weight
        if w.device.type != "cpu" or w.dtype != torch.float32 or w.shape[1] % _C.Q8_GROUP != 0:
            return False
        qw, dw = _C.quantize_q8_0(w.detach().contiguous().numpy())
        b = None if self.bias is None else self.bias.detach().contiguous().numpy()
        self.q8 = (qw, dw, b)
        self.threads = max(1, threads)
        return True

    def disable_q8(self) -> None:
        self.q8 = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [T, in] -> [T, out]
        if self.q8 is not None and x.dim() == 2 and x.shape[0] <= GEMV_MAX_TOKENS and x.dtype == torch.float32:
            qw, dw, b = self.q8
            y = torch.empty(x.shape[0], qw.shape[0], dtype=torch.float32)
            _C.gemv_q8_0(x.contiguous().numpy(), qw, dw, b, y.numpy(), self.threads)
            return y
        return F.linear(x, self.weight, self.bias)


def set_decode_weights(model: torch.nn.Module, mode: str, threads: int) -> int:
    """Give every ``Linear`` of ``model`` the decode path ``mode`` ("q8_0" or "fp32").

    Returns the number of layers that use Q8_0 (0 for "fp32", or off the CPU / not fp32).
    """
    n = 0
    for m in model.modules():
        if isinstance(m, Linear):
            if mode == "q8_0":
                n += m.enable_q8(threads)
            else:
                m.disable_q8()
    return n
