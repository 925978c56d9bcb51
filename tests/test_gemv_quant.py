"""GGUF-encoded weights read in place (cpp/quant/ggml_blocks.h, cpp/gemm/gemv_blocks*.cpp): dequantization and the
block GEMV against gguf's dequantizer and a float64 torch matmul, on both kernel paths."""

import functools
import zlib

import gguf
import numpy as np
import pytest
import torch
from gguf.quants import dequantize, quantize

from ktquest import _C

QT = gguf.GGMLQuantizationType
K_TYPES = ["Q4_K", "Q5_K", "Q6_K"]
FLOAT_TYPES = ["F32", "F16", "BF16"]
Q32_TYPES = ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"]
# Where each type keeps its fp16 scales in a block (ggml-common.h): given sane values in the GEMV tests.
FP16_FIELDS = {"Q8_0": [0], "Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2],
               "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208]}
ACT_GROUP = {**{t: 256 for t in K_TYPES}, **{t: 32 for t in Q32_TYPES}}  # quantized x: values per scale


# ---- the reference ----


def random_rows(qtype: str, out: int, inp: int, seed: int) -> np.ndarray:
    """uint8 [out, row_bytes]: random blocks of `qtype` with random codes and sub-scales and fp16 scales of
    either sign in [1e-3, 5e-2]; float types hold N(0, 1) values."""
    rng = np.random.default_rng(seed)
    if qtype in FLOAT_TYPES:
        w = rng.standard_normal((out, inp), dtype=np.float32)
        if qtype == "BF16":
            return quantize(w, QT.BF16).view(np.uint8).reshape(out, -1)
        return w.astype(np.float16 if qtype == "F16" else np.float32).view(np.uint8).reshape(out, -1)
    bv, bb = gguf.GGML_QUANT_SIZES[QT[qtype]]
    blocks = rng.integers(0, 256, (out * inp // bv, bb), dtype=np.uint8)
    for off in FP16_FIELDS[qtype]:
        scale = (rng.uniform(1e-3, 5e-2, len(blocks)) * rng.choice([-1, 1], len(blocks))).astype(np.float16)
        blocks[:, off:off + 2] = scale.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(out, -1)


def quantize_x(x: torch.Tensor, group: int) -> torch.Tensor:
    """What the kernels multiply (cpp/quant/q8_act.h): x [T, in] -> dequant(q8(x)) [T, in] fp32.
    d = absmax / 127 per group (0 below 1e-30), q = round_half_even(x * (1 / d)) in fp32."""
    g = x.reshape(x.shape[0], -1, group)
    amax = g.abs().amax(-1)
    d = torch.where(amax >= 1e-30, amax / 127.0, torch.zeros_like(amax))
    inv = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
    q = torch.round(g * inv[..., None])  # torch.round is half-to-even
    return (q * d[..., None]).reshape(x.shape)


def reference(qtype: str, raw: np.ndarray, x: torch.Tensor, b: torch.Tensor | None):
    """(y, err): the kernels' product in float64 (x rounded as they round it) and the fp32 rounding allowed, a
    small multiple of the magnitude sum |W| @ |x'| + |b| (a block's dot product is exact in integers; fp32 rounding
    enters where blocks are scaled and summed: at most ~in/32 additions, each off by 2^-24 of the running sum)."""
    with np.errstate(all="ignore"):
        w = torch.from_numpy(dequantize(raw, QT[qtype]).copy()).double()
    xq = quantize_x(x, ACT_GROUP[qtype]) if qtype in ACT_GROUP else x
    bias = 0 if b is None else b.double()
    return xq.double() @ w.T + bias, FP32_SUM_REL * (xq.double().abs() @ w.abs().T + abs(bias)) + 1e-30


FP32_SUM_REL = 1e-5


def q8_bound(qtype: str, raw: np.ndarray, x: torch.Tensor) -> torch.Tensor:
    """The error that rounding x to int8 may add to each output (q8_act.h): sum over groups g of
    (d_g / 2) * sum_{i in g} |w_i|, d_g = absmax(x over g) / 127."""
    if qtype not in ACT_GROUP:
        return torch.zeros(x.shape[0], raw.shape[0], dtype=torch.float64)
    group = ACT_GROUP[qtype]
    with np.errstate(all="ignore"):
        w = torch.from_numpy(dequantize(raw, QT[qtype]).copy()).double()
    half_step = x.double().reshape(x.shape[0], -1, group).abs().amax(-1) / 254.0  # [T, in / group]
    wsum = w.abs().reshape(w.shape[0], -1, group).sum(-1)  # [out, in / group]
    return half_step @ wsum.T


@functools.cache
def case(qtype: str, out: int, inp: int, T: int, bias: bool):
    seed = zlib.crc32(repr((qtype, out, inp, T, bias)).encode())
    raw = random_rows(qtype, out, inp, seed)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, inp, generator=g) * 2.0
    b = torch.randn(out, generator=g) if bias else None
    return raw, x, b


def run_gemv(qtype, raw, x, b, threads):
    y = np.full((x.shape[0], raw.shape[0]), np.nan, np.float32)
    _C.gemv_quant(x.numpy(), raw, qtype, None if b is None else b.numpy(), y, threads)
    return torch.from_numpy(y)


# ---- dequantization ----


@pytest.mark.parametrize("qtype", list(_C.GGML_TYPES))
def test_dequantize_rows_is_gguf_bit_for_bit(qtype):
    """Any bytes, NaN and inf scales included: the same floats as gguf's dequantizer (NaN where it has NaN)."""
    bv, bb = gguf.GGML_QUANT_SIZES[QT[qtype]]
    raw = np.random.default_rng(7).integers(0, 256, (9, bb * (1024 // bv + 3)), dtype=np.uint8)
    with np.errstate(all="ignore"):
        ref = dequantize(raw, QT[qtype])
    np.testing.assert_array_equal(_C.dequantize_rows(qtype, raw), ref)
    sane = random_rows(qtype, 5, 512, 3)
    with np.errstate(all="ignore"):
        np.testing.assert_array_equal(_C.dequantize_rows(qtype, sane), dequantize(sane, QT[qtype]))


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "F16", "BF16"])
def test_dequantize_rows_of_gguf_quantized_floats(qtype):
    w = np.random.default_rng(1).standard_normal((7, 96)).astype(np.float32)
    raw = quantize(w, QT[qtype]).view(np.uint8).reshape(7, -1)
    np.testing.assert_array_equal(_C.dequantize_rows(qtype, raw), dequantize(raw, QT[qtype]).reshape(7, 96))


def test_row_bytes():
    assert _C.ggml_row_bytes("Q4_K", 4096) == 16 * 144
    assert _C.ggml_row_bytes("Q6_K", 256) == 210
    assert _C.ggml_row_bytes("Q8_0", 64) == 68
    assert _C.ggml_row_bytes("BF16", 7) == 14
    for name in _C.GGML_TYPES:
        bv, bb = gguf.GGML_QUANT_SIZES[QT[name]]
        assert _C.ggml_row_bytes(name, 256 * bv) == 256 * bb
    with pytest.raises(ValueError, match="multiple of 256"):
        _C.ggml_row_bytes("Q4_K", 100)


# ---- the GEMV ----

GEMV_TYPES = list(_C.GGML_TYPES)
IN_SIZES = {**{t: (256, 512, 2816) for t in K_TYPES}, **{t: (32, 96, 160) for t in Q32_TYPES},
            **{t: (1, 37, 160) for t in FLOAT_TYPES}}  # float rows: any length (tails of 1..7 and 8..31)
SHAPES = [(qt, out, inp) for qt in GEMV_TYPES for out in (1, 7, 33, 260) for inp in IN_SIZES[qt]]
# (T, bias, threads): every value of each, not every combination.
RUNS = [(1, False, 1), (3, True, 3), (1, True, 3), (3, False, 1)]


@pytest.mark.parametrize("qtype,out,inp", SHAPES)
@pytest.mark.parametrize("T,bias,threads", RUNS)
def test_gemv_matches_reference(force_scalar, qtype, out, inp, T, bias, threads):
    raw, x, b = case(qtype, out, inp, T, bias)
    y = run_gemv(qtype, raw, x, b, threads)
    ref, tol = reference(qtype, raw, x, b)
    assert torch.isfinite(y).all()
    assert ((y.double() - ref).abs() <= tol).all(), f"max excess {((y.double() - ref).abs() - tol).max():.3g}"
    # Against fp32 x, not the int8 x the kernels multiply: within the bound q8_act.h states.
    exact = x.double() @ torch.from_numpy(dequantize(raw, QT[qtype]).copy()).double().T + (
        0 if b is None else b.double())
    assert ((y.double() - exact).abs() <= q8_bound(qtype, raw, x) + tol).all()


@pytest.mark.parametrize("qtype", GEMV_TYPES)
def test_gemv_threads_and_paths(qtype):
    """Bitwise the same for any thread count; the two twins agree to fp32 rounding."""
    raw, x, b = case(qtype, 777, 1024, 2, True)
    try:
        for scalar in (False, True):
            _C.set_force_scalar(scalar)
            ys = [run_gemv(qtype, raw, x, b, n) for n in (1, 2, 3, 8)]
            for y in ys[1:]:
                assert torch.equal(y, ys[0])
            if not scalar:
                y_avx = ys[0]
    finally:
        _C.set_force_scalar(False)
    _, tol = reference(qtype, raw, x, b)
    assert ((y_avx.double() - ys[0].double()).abs() <= 2 * tol).all()


@pytest.mark.parametrize("qtype", [t for t in GEMV_TYPES if t in ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "F16", "BF16")])
def test_gemv_on_gguf_quantized_weights(force_scalar, qtype):
    """Weights as gguf quantizes real floats (scales from the data, not drawn at random)."""
    g = torch.Generator().manual_seed(5)
    w = torch.randn(67, 256, generator=g) * 0.02
    raw = quantize(w.numpy(), QT[qtype]).view(np.uint8).reshape(67, -1)
    x = torch.randn(2, 256, generator=g)
    y = run_gemv(qtype, raw, x, None, 2)
    ref, tol = reference(qtype, raw, x, None)
    assert ((y.double() - ref).abs() <= tol).all()


@pytest.mark.parametrize("qtype", [t for t in GEMV_TYPES if t in ACT_GROUP])
def test_gemv_long_rows(force_scalar, qtype):
    """Rows of _C.GEMV_STREAM_IN values and more take the AVX2 kernels that prefetch the weights."""
    inp = _C.GEMV_STREAM_IN + 256
    raw, x, b = case(qtype, 9, inp, 2, True)
    y = run_gemv(qtype, raw, x, b, 2)
    ref, tol = reference(qtype, raw, x, b)
    assert ((y.double() - ref).abs() <= tol).all()


def test_gemv_zero_activations():
    """A zero x (absmax 0: scale 0) gives the bias, on both paths."""
    raw = random_rows("Q4_K", 5, 512, 0)
    b = np.arange(5, dtype=np.float32)
    for scalar in (False, True):
        _C.set_force_scalar(scalar)
        y = np.empty((1, 5), np.float32)
        _C.gemv_quant(np.zeros((1, 512), np.float32), raw, "Q4_K", b, y, 1)
        np.testing.assert_array_equal(y[0], b)
    _C.set_force_scalar(False)


# ---- argument checks ----


def good_args():
    raw = random_rows("Q4_K", 8, 512, 0)
    return [np.zeros((2, 512), np.float32), raw, "Q4_K", None, np.zeros((2, 8), np.float32), 1]


@pytest.mark.parametrize(
    "i,value,exc,match",
    [
        (0, np.zeros((2, 512), np.float64), TypeError, "x: expected a numpy array of dtype float32"),
        (0, np.zeros(512, np.float32), ValueError, "x: expected 2 dimensions"),
        (0, np.zeros((2, 1024), np.float32)[:, ::2], ValueError, "x: must be C-contiguous"),
        (0, np.zeros((2, 300), np.float32), ValueError, "x: the input dimension .300. must be a multiple of 256"),
        (0, np.zeros((2, 768), np.float32), ValueError, r"w: expected rows of 432 bytes .* got 288"),
        (1, np.zeros((8, 288), np.int8), TypeError, "w: expected a numpy array of dtype uint8"),
        (1, np.zeros((8, 289), np.uint8)[:, 1:], ValueError, "w: must be C-contiguous"),
        (1, np.zeros((8, 290), np.uint8), ValueError, r"w: expected rows of 288 bytes"),
        (2, "Q3_K", ValueError, "type 'Q3_K' is not one of F32, F16"),
        (2, "q4_k", ValueError, "type 'q4_k' is not one of"),
        (3, np.zeros(7, np.float32), ValueError, r"bias: expected \[8\], got \[7\]"),
        (4, np.zeros((2, 9), np.float32), ValueError, r"y: expected \[2, 8\], got \[2, 9\]"),
        (4, np.zeros((2, 8), np.float32).T.copy().T, ValueError, "y: must be C-contiguous"),
        (5, 0, ValueError, "n_threads must be >= 1"),
    ],
)
def test_gemv_bad_arguments_raise(i, value, exc, match):
    args = good_args()
    args[i] = value
    with pytest.raises(exc, match=match):
        _C.gemv_quant(*args)


def test_gemv_misaligned_rows_raise():
    buf = np.zeros(8 * 288 + 1, np.uint8)
    with pytest.raises(ValueError, match="w: Q4_K rows must be 2-byte aligned"):
        _C.gemv_quant(np.zeros((1, 512), np.float32), buf[1:].reshape(8, 288), "Q4_K", None,
                      np.zeros((1, 8), np.float32), 1)


def test_dequantize_rows_bad_arguments_raise():
    with pytest.raises(ValueError, match="raw: a Q6_K row is whole blocks of 210 bytes, got rows of 200"):
        _C.dequantize_rows("Q6_K", np.zeros((2, 200), np.uint8))
    with pytest.raises(ValueError, match="type 'Q2_K' is not one of"):
        _C.dequantize_rows("Q2_K", np.zeros((2, 84), np.uint8))
    with pytest.raises(TypeError, match="raw: expected a numpy array of dtype uint8"):
        _C.dequantize_rows("Q8_0", np.zeros((2, 34), np.float32))
    with pytest.raises(ValueError, match="raw: must be C-contiguous"):
        _C.dequantize_rows("Q8_0", np.zeros((2, 68), np.uint8)[:, ::2])


@pytest.mark.parametrize("qtype", GEMV_TYPES)
@pytest.mark.parametrize("long", [False, True])
def test_many_tokens_are_each_token_alone(qtype, long):
    """T activation rows in one call (batched decode; the types with a many-row kernel read each weight row once
    for up to 4 of them) give each row bit for bit what it gets alone, for T past the kernel's 4 too; AVX2 and
    the streaming (long-row) kernels."""
    inp = _C.GEMV_STREAM_IN + 256 if long else 512
    raw, x, b = case(qtype, 45, inp, 7, True)
    together = run_gemv(qtype, raw, x, b, 2)
    for t in range(7):
        assert torch.equal(together[t], run_gemv(qtype, raw, x[t: t + 1], b, 2)[0]), t
