"""Linear layers of the model: one place that decides how a weight is multiplied.

A weight is either a torch tensor (``weights: dequantize``: the reference path, and CUDA) or a
``QuantWeight``: the tensor as the GGUF file stores it (Q4_K, Q6_K, Q8_0, F16, ...), memory-mapped and
read in place, never copied to fp32. On a ``QuantWeight``:

- a few tokens (decode) take ``native.matrix.gemv``: AVX2 integer dot products on the encoded rows, x quantized
  to int8 per 32 or 256 values as ggml does (``cpp/gemm/gemv_blocks.h``), or to int16 (``activations:
  int16``, the 32-value block types: 258 times less rounding);
- a prefill chunk of K-quant rows (Q4_K, Q5_K, Q6_K) or 4/5-bit 32-value rows (Q4_0, Q4_1, Q5_0, Q5_1) takes
  ``native.matrix.gemm_int8``: x quantized to int8 as decode quantizes it, each weight row unpacked once per call
  (``cpp/gemm/gemm_int8.h``);
- any other prefill chunk dequantizes a panel of rows at a time (``native.matrix.dequantize_matrix``, about 8 MB of fp32)
  and multiplies it with torch's fp32 GEMM: the transient panel is all the fp32 a layer ever holds.

A fused projection (q | k | v, gate | up) is several tensors stacked by rows, each in its own encoding
(Q4_K_M files quantize ``attn_v`` and some ``ffn_down`` to Q6_K): a ``QuantWeight`` of several parts.

A third kind, ``Int8Weight`` (``weights: int8``: a GPU where the weights in fp16 do not fit), holds each row as
int8 with one scale: half fp16's memory; a product scales panels of ``INT8_PANEL`` values of int8 rows into
the activations' dtype first (a bounded temporary, also inside a captured CUDA graph; the GPU's weight-only int8
kernels ran slower than that on an H200: tools/bench_int8_weights.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from ktquest.native import matrix

# Rows up to this many tokens take the GEMV path; longer chunks are compute-bound and take the GEMM.
GEMV_MAX_TOKENS = 4
# Values of an Int8Weight's rows scaled into the activations' dtype at once by a product (32 MB in fp16).
INT8_PANEL = 1 << 24
# fp32 values in one dequantized panel of a prefill chunk's GEMM (128 MB): a 1.5B model's matrices fit in one,
# so the GEMM writes y directly; larger ones are cut, and each panel's columns of y copied into place.
PANEL_VALUES = 1 << 25
# Panels of at least this many values are dequantized on every thread, smaller ones on one.
DEQUANT_THREADS_FROM = 1 << 22


@dataclass(frozen=True, slots=True)
class QuantWeight:
    """A weight [out, in] in its GGUF encoding: parts of whole rows stacked in order.

    parts: (type, uint8 [rows, row_bytes]) each, the type one of ``native.enums.GGML_TYPES`` (gguf's names), the array
    a view of the mapped file (read-only) or, for a type converted at load, its Q8_0 bytes.
    """

    parts: tuple[tuple[str, np.ndarray], ...]
    in_features: int

    @property
    def out_features(self) -> int:
        return sum(p.shape[0] for _, p in self.parts)

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for _, p in self.parts)

    def rows(self, ids: np.ndarray) -> np.ndarray:
        """fp32 [len(ids), in]: the rows ``ids`` dequantized (an embedding lookup; one part only)."""
        (t, data), = self.parts
        return matrix.dequantize_rows(t, np.ascontiguousarray(data[ids]))

    def dequantize(self) -> np.ndarray:
        """fp32 [out, in]: every row (tests, and the ``dequantize`` path)."""
        return np.concatenate([matrix.dequantize_rows(t, p) for t, p in self.parts])


@dataclass(frozen=True, slots=True)
class Int8Weight:
    """A matrix [out, in] as int8 rows and a scale a row: W ~= q * scale[:, None] (``weights: int8``)."""

    q: torch.Tensor  # int8 [out, in]
    scale: torch.Tensor  # [out], the compute dtype

    @classmethod
    def of(cls, w: torch.Tensor, dtype: torch.dtype | None = None) -> Int8Weight:
        """Each row of ``w`` rounded to int8 by its largest magnitude (a row of zeros: scale 1), ``INT8_PANEL``
        values at a time (its temporaries stay that small); the scales in ``dtype`` (default: w's)."""
        rows = max(1, INT8_PANEL // max(1, w.shape[1]))
        q = torch.empty(w.shape, dtype=torch.int8, device=w.device)
        scale = torch.empty(w.shape[0], dtype=torch.float32, device=w.device)
        for a in range(0, w.shape[0], rows):
            part = w[a: a + rows].float()
            peak = part.abs().amax(1)
            s = torch.where(peak > 0, peak / 127, torch.ones_like(peak))
            q[a: a + rows] = part.div_(s[:, None]).round_().clamp_(-127, 127)
            scale[a: a + rows] = s
        return cls(q, scale.to(dtype or w.dtype))

    def to(self, device: torch.device | str) -> Int8Weight:
        return Int8Weight(self.q.to(device), self.scale.to(device))

    def dequantize(self) -> torch.Tensor:
        return self.q.to(self.scale.dtype) * self.scale[:, None]


def stack_rows(*ws: torch.Tensor | QuantWeight | Int8Weight) -> torch.Tensor | QuantWeight | Int8Weight:
    """Matrices [out_i, in] stacked by rows (a fused projection): torch.cat, or one QuantWeight of their parts,
    or one Int8Weight."""
    if all(isinstance(w, QuantWeight) for w in ws):
        return QuantWeight(parts=tuple(p for w in ws for p in w.parts), in_features=ws[0].in_features)
    if all(isinstance(w, Int8Weight) for w in ws):
        return Int8Weight(torch.cat([w.q for w in ws]), torch.cat([w.scale for w in ws]))
    return torch.cat(ws)


class Linear(torch.nn.Module):
    """y = x @ W.T (+ b), then the output columns gathered by ``out_perm`` when given.

    weight: a torch tensor [out, in], a ``QuantWeight`` or an ``Int8Weight``; bias: [out] or None (fp32 for a
    QuantWeight); out_perm: int64 [out] or None (llama files' q/k rows: ``models/loader.py``).
    """

    def __init__(self, weight: torch.Tensor | QuantWeight | Int8Weight, bias: torch.Tensor | None = None,
                 out_perm: torch.Tensor | None = None):
        super().__init__()
        self.quant: QuantWeight | None = weight if isinstance(weight, QuantWeight) else None
        self.qm = None  # the native matrix of a QuantWeight (native.matrix.QuantMatrix)
        self.int8: Int8Weight | None = weight if isinstance(weight, Int8Weight) else None
        if self.int8 is not None:
            self.register_buffer("w8", weight.q, persistent=False)
            self.register_buffer("w8_scale", weight.scale, persistent=False)
        if out_perm is not None and self.quant is None:  # gathered where the weight's products are
            out_perm = out_perm.to(weight.q.device if self.int8 is not None else weight.device)
        self.register_buffer("out_perm", out_perm, persistent=False)
        if self.quant is not None:
            self.weight = None
            b = None if bias is None else bias.detach().to(torch.float32).contiguous()
            self.bias = None if b is None else torch.nn.Parameter(b, requires_grad=False)
            # A prefill panel's rows in out_perm's order (then y needs no gather), and the bias in that order.
            self._order = None if out_perm is None else out_perm.to(torch.int32).numpy()
            self._bias_in_order = self.bias if out_perm is None or b is None else self.bias[out_perm]
            self.use_x16(False)
        else:
            self.weight = None if self.int8 is not None else torch.nn.Parameter(weight, requires_grad=False)
            self.bias = None if bias is None else torch.nn.Parameter(bias, requires_grad=False)
        self.threads = max(1, torch.get_num_threads())

    def use_x16(self, x16: bool) -> None:
        """How x is rounded (a QuantWeight only; Config.activations). False: to int8 as ggml does, in decode's
        GEMV and in prefill's int8 GEMM where every part takes it. True: to int16 in decode where the type has
        such kernels (the 32-value block types), and every prefill chunk on fp32 x and dequantized panels."""
        b = None if self.bias is None else self.bias.detach().numpy()
        self.qm = matrix.QuantMatrix(list(self.quant.parts), b, x16=x16)
        # Prefill on int8 x: the int8 GEMM where it takes the matrix (cpp/gemm/gemm_int8.h: the K-quants, or the
        # 4/5-bit 32-value types, not mixed); otherwise dequantized panels.
        self._int8_gemm = not x16 and self.qm.int8_gemm

    @property
    def in_features(self) -> int:
        if self.quant is not None:
            return self.quant.in_features
        return (self.w8 if self.int8 is not None else self.weight).shape[1]

    @property
    def out_features(self) -> int:
        if self.quant is not None:
            return self.quant.out_features
        return (self.w8 if self.int8 is not None else self.weight).shape[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [T, in] -> [T, out]
        if self.int8 is not None:  # panels of int8 rows scaled into x's dtype (an unscaled product could overflow)
            rows = max(1, INT8_PANEL // self.w8.shape[1])
            parts = [F.linear(x, self.w8[a: a + rows].to(x.dtype) * self.w8_scale[a: a + rows, None])
                     for a in range(0, self.w8.shape[0], rows)]
            y = parts[0] if len(parts) == 1 else torch.cat(parts, -1)
            y = y if self.bias is None else y + self.bias
        elif self.quant is None:
            y = F.linear(x, self.weight, self.bias)
        else:
            x = x.to(torch.float32).contiguous()
            if x.shape[0] <= GEMV_MAX_TOKENS:
                y = torch.empty(x.shape[0], self.out_features, dtype=torch.float32)
                matrix.gemv(self.qm, x.numpy(), y.numpy(), self.threads)
                return y if self.out_perm is None else y.index_select(1, self.out_perm)
            return self._gemm(x)  # out_perm applied
        return y if self.out_perm is None else y.index_select(1, self.out_perm)

    def _gemm(self, x: torch.Tensor) -> torch.Tensor:
        """x @ W.T (+ b) [T, out] with out_perm applied: the int8 GEMM, or W dequantized a panel of rows at a
        time into the shared scratch panel and multiplied in fp32."""
        n, k = self.out_features, self.in_features
        if self._int8_gemm:
            y = torch.empty(x.shape[0], n, dtype=torch.float32)
            matrix.gemm_int8(self.qm, x.numpy(), y.numpy(), self.threads)
            return y if self.out_perm is None else y.index_select(1, self.out_perm)
        step = max(16, min(n, PANEL_VALUES // k))
        panel = _panel(step * k).view(step, k)
        if step == n:  # the whole matrix in one panel, its rows in out_perm's order: no gather of y after
            matrix.dequantize_matrix(self.qm, 0, n, panel.numpy(), self._dequant_threads(n * k), self._order)
            return F.linear(x, panel, self._bias_in_order)
        y = torch.empty(x.shape[0], n, dtype=torch.float32)
        for r0 in range(0, n, step):
            r1 = min(n, r0 + step)
            matrix.dequantize_matrix(self.qm, r0, r1, panel.numpy(), self._dequant_threads((r1 - r0) * k))
            b = None if self.bias is None else self.bias[r0:r1]
            y[:, r0:r1] = F.linear(x, panel[: r1 - r0], b)
        return y if self.out_perm is None else y.index_select(1, self.out_perm)

    def _dequant_threads(self, values: int) -> int:
        """Threads for dequantizing a panel: one below DEQUANT_THREADS_FROM values, where starting the pool's
        workers (and sharing the cores with torch's spinning OpenMP threads) costs more than it saves."""
        return self.threads if values >= DEQUANT_THREADS_FROM else 1


_scratch = torch.empty(0)


def _panel(values: int) -> torch.Tensor:
    """The prefill GEMM's dequantized panel: one fp32 scratch buffer shared by every Linear, grown once (a fresh
    8 MB buffer a call cost more in page faults than its dequantization)."""
    global _scratch
    if _scratch.numel() < values:
        _scratch = torch.empty(values, dtype=torch.float32)
    return _scratch[:values]


def set_threads(model: torch.nn.Module, threads: int) -> None:
    """The threads every ``Linear`` of ``model`` gives its native matmuls."""
    for m in model.modules():
        if isinstance(m, Linear):
            m.threads = max(1, threads)


def set_x16(model: torch.nn.Module, x16: bool) -> None:
    """``Linear.use_x16`` on every encoded Linear of ``model`` (before its native decoder is built)."""
    for m in model.modules():
        if isinstance(m, Linear) and m.quant is not None:
            m.use_x16(x16)


class Embedding(torch.nn.Module):
    """Token ids -> rows of the embedding table [V, dim]: a torch tensor, or a ``QuantWeight`` (an
    ``Int8Weight``) whose rows are dequantized as they are looked up."""

    def __init__(self, table: torch.Tensor | QuantWeight | Int8Weight):
        super().__init__()
        self.quant: QuantWeight | None = table if isinstance(table, QuantWeight) else None
        self.int8: Int8Weight | None = table if isinstance(table, Int8Weight) else None
        plain = self.quant is None and self.int8 is None
        self.weight = torch.nn.Parameter(table, requires_grad=False) if plain else None
        if self.int8 is not None:
            self.register_buffer("w8", table.q, persistent=False)
            self.register_buffer("w8_scale", table.scale, persistent=False)

    @property
    def num_embeddings(self) -> int:
        if self.quant is not None:
            return self.quant.out_features
        return (self.w8 if self.int8 is not None else self.weight).shape[0]

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:  # [T] -> [T, dim]
        if self.int8 is not None:
            return F.embedding(tokens, self.w8).to(self.w8_scale.dtype) * self.w8_scale[tokens][:, None]
        if self.quant is None:
            return F.embedding(tokens, self.weight)
        ids = tokens.cpu().numpy()
        if ids.size and (ids.min() < 0 or ids.max() >= self.num_embeddings):
            raise IndexError(f"token ids {ids.min()}..{ids.max()} are outside the vocabulary "
                             f"(0..{self.num_embeddings - 1})")
        return torch.from_numpy(self.quant.rows(ids))
