"""A weight read in place as the GGUF file stores it (ktquest.layers.linear: QuantWeight, Linear): the fused
multi-part GEMV of decode, the int8 prefill GEMM and the prefill GEMM on dequantized panels, against gguf's
dequantizer and a float64 torch matmul, every kept type, both kernel paths, odd shapes."""

import subprocess
import sys

import numpy as np
import pytest
import torch
from gguf.quants import dequantize
from test_gemv_quant import FP16_FIELDS, QT, case, random_rows, reference

from ktquest import _C
from ktquest.layers import linear
from ktquest.layers.linear import Linear, QuantWeight, stack_rows

TYPES = list(_C.GGML_TYPES)
# A block multiple that fits every type, and odd row counts.
IN = {t: 512 if t in ("Q4_K", "Q5_K", "Q6_K") else 96 for t in TYPES}


def dequant(raw: np.ndarray, qtype: str) -> torch.Tensor:
    with np.errstate(all="ignore"):
        return torch.from_numpy(dequantize(raw, QT[qtype]).copy()).double()


@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("x16", [False, True])
def test_gemm_matches_dequantize_and_matmul(force_scalar, qtype, x16, monkeypatch):
    """A prefill chunk (T > GEMV_MAX_TOKENS): the K-quants and the 4/5-bit 32-value types on int8 activations take
    the int8 GEMM (q8(x) per 256 or 32 values, as decode); everything else dequantized panels of rows and an fp32
    matmul, the bias added, with panels small enough that the rows take several (a last, partial one included)."""
    monkeypatch.setattr(linear, "PANEL_VALUES", 16 * IN[qtype])
    raw, x, b = case(qtype, 37, IN[qtype], 9, True)
    lin = Linear(QuantWeight(parts=((qtype, raw),), in_features=IN[qtype]), b)
    lin.use_x16(x16)
    assert lin._int8_gemm == (qtype in ("Q4_K", "Q5_K", "Q6_K", "Q4_0", "Q4_1", "Q5_0", "Q5_1") and not x16)
    y = lin(x)
    if lin._int8_gemm:
        ref, tol = reference(qtype, raw, x, b)
    else:
        ref = x.double() @ dequant(raw, qtype).T + b.double()
        tol = 1e-5 * (x.double().abs() @ dequant(raw, qtype).abs().T + b.double().abs()) + 1e-6
    assert y.shape == (9, 37) and ((y.double() - ref).abs() <= tol).all()


@pytest.mark.parametrize("qtype", TYPES)
def test_linear_decode_rows_take_the_gemv(force_scalar, qtype):
    raw, x, b = case(qtype, 33, IN[qtype], 3, True)
    y = Linear(QuantWeight(parts=((qtype, raw),), in_features=IN[qtype]), b)(x)
    ref, tol = reference(qtype, raw, x, b)
    assert ((y.double() - ref).abs() <= tol).all()


def quantize_x16(x: torch.Tensor) -> torch.Tensor:
    """What the x16 kernels multiply (cpp/quant/q8_act.h, quantize_act16): x [T, in] -> dequant(q16(x)) [T, in],
    d = absmax / 32767 per 32 values (0 below 1e-30), q = round_half_even(x * (1 / d)) in fp32."""
    g = x.reshape(x.shape[0], -1, 32)
    amax = g.abs().amax(-1)
    d = torch.where(amax >= 1e-30, amax / 32767.0, torch.zeros_like(amax))
    inv = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
    return (torch.round(g * inv[..., None]) * d[..., None]).reshape(x.shape)


@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("T,threads", [(1, 1), (3, 2)])
def test_x16_rounds_activations_to_int16(force_scalar, qtype, T, threads):
    """x16: the 32-value block types multiply x rounded to int16 per 32 values (dequant(W) . q16(x) up to fp32
    rounding, and within the int16 bound of fp32 x); the K-quants keep int8, the float types never round x."""
    raw, x, b = case(qtype, 41, IN[qtype], T, True)
    m = _C.QuantMatrix([(qtype, raw)], b.numpy(), x16=True)
    assert m.x16
    y = np.full((T, 41), np.nan, np.float32)
    _C.gemv_matrix(m, x.numpy(), y, threads)
    y = torch.from_numpy(y).double()
    if qtype in ("Q4_K", "Q5_K", "Q6_K", "F32", "F16", "BF16"):
        ref, tol = reference(qtype, raw, x, b)
        assert ((y - ref).abs() <= tol).all()
        return
    w = dequant(raw, qtype)
    xq = quantize_x16(x).double()
    ref = xq @ w.T + b.double()
    tol = 1e-5 * (xq.abs() @ w.abs().T + b.double().abs()) + 1e-6
    assert ((y - ref).abs() <= tol).all()
    half_step = x.double().reshape(T, -1, 32).abs().amax(-1) / 65534.0  # [T, in / 32]
    bound = half_step @ w.abs().reshape(41, -1, 32).sum(-1).T  # what int16 rounding may add to each output
    exact = x.double() @ w.T + b.double()
    assert ((y - exact).abs() <= bound + tol).all()


def test_fused_parts_of_mixed_types(force_scalar):
    """q | k | v in three encodings (a Q4_K_M file's attn_q Q4_K, attn_k Q8_0, attn_v Q6_K) and a bias: one pass
    gives each part's product, for decode rows and a prefill chunk, at 1 and 3 threads (bitwise the same)."""
    inp = 512
    parts = [("Q4_K", random_rows("Q4_K", 67, inp, 1)), ("Q8_0", random_rows("Q8_0", 5, inp, 2)),
             ("Q6_K", random_rows("Q6_K", 64, inp, 3))]
    w = stack_rows(*(QuantWeight(parts=(p,), in_features=inp) for p in parts))
    assert w.out_features == 136 and [t for t, _ in w.parts] == ["Q4_K", "Q8_0", "Q6_K"]
    g = torch.Generator().manual_seed(0)
    b = torch.randn(136, generator=g)
    lin = Linear(w, b)
    for T in (1, 2, 8):
        x = torch.randn(T, inp, generator=g)
        lin.threads = 1
        y = lin(x)
        lin.threads = 3
        assert torch.equal(lin(x), y)
        row = 0
        for t, raw in parts:
            n = raw.shape[0]
            ref, tol = reference(t, raw, x, b[row:row + n])
            if T > linear.GEMV_MAX_TOKENS:  # the GEMM multiplies fp32 x: no activation rounding
                ref = x.double() @ dequant(raw, t).T + b[row:row + n].double()
            assert ((y[:, row:row + n].double() - ref).abs() <= tol).all(), t
            row += n


def test_out_perm_gathers_the_outputs():
    raw, x, _ = case("Q8_0", 32, 64, 2, False)
    perm = torch.randperm(32, generator=torch.Generator().manual_seed(1))
    w = QuantWeight(parts=(("Q8_0", raw),), in_features=64)
    assert torch.equal(Linear(w, out_perm=perm)(x), Linear(w)(x)[:, perm])


def test_quant_matrix_checks_its_parts():
    q4 = random_rows("Q4_K", 4, 512, 0)
    with pytest.raises(ValueError, match="at least one part"):
        _C.QuantMatrix([])
    with pytest.raises(ValueError, match=r"parts\[1\]: rows of 256 values, the matrix's are 512"):
        _C.QuantMatrix([("Q4_K", q4), ("Q4_K", random_rows("Q4_K", 4, 256, 0))])
    with pytest.raises(ValueError, match="whole blocks of 144 bytes"):
        _C.QuantMatrix([("Q4_K", np.zeros((4, 100), np.uint8))])
    with pytest.raises(ValueError, match="not allowed|type"):
        _C.QuantMatrix([("Q3_K", q4)])
    with pytest.raises(TypeError, match=r"parts\[0\]: expected a tuple"):
        _C.QuantMatrix(["Q4_K"])
    with pytest.raises(ValueError, match=r"bias: expected shape \[4\]"):
        _C.QuantMatrix([("Q4_K", q4)], np.zeros(5, np.float32))
    m = _C.QuantMatrix([("Q4_K", q4)])
    assert (m.out_features, m.in_features, m.types) == (4, 512, ["Q4_K"])
    with pytest.raises(ValueError, match=r"x: expected \[T, 512\]"):
        _C.gemv_matrix(m, np.zeros((1, 256), np.float32), np.zeros((1, 4), np.float32), 1)
    with pytest.raises(IndexError, match=r"rows \[2, 5\) are outside the 4 rows"):
        _C.dequantize_matrix(m, 2, 5, np.zeros((3, 512), np.float32), 1)
    with pytest.raises(ValueError, match="not writeable|read-only"):
        out = np.zeros((4, 512), np.float32)
        out.flags.writeable = False
        _C.dequantize_matrix(m, 0, 4, out, 1)


def test_dequantize_matrix_rows_across_parts():
    parts = [("Q5_1", random_rows("Q5_1", 7, 64, 4)), ("BF16", random_rows("BF16", 9, 64, 5))]
    m = _C.QuantMatrix(parts)
    full = np.concatenate([dequant(r, t).float().numpy() for t, r in parts])
    for r0, r1, threads in ((0, 16, 1), (3, 12, 2), (6, 8, 3), (5, 5, 1)):
        out = np.full((r1 - r0 + 2, 64), np.nan, np.float32)
        _C.dequantize_matrix(m, r0, r1, out, threads)
        np.testing.assert_array_equal(out[: r1 - r0], full[r0:r1])
        assert np.isnan(out[r1 - r0:]).all()


def test_a_huge_thread_count_is_capped():
    """Asking for 100,000 threads starts at most 256 (the pool's cap): the same result, no exhausted process.
    In a child process, so this one does not keep the workers."""
    code = """
import subprocess
import sys

import numpy as np
from ktquest import _C
def threads():
    return int([s for s in open('/proc/self/status') if s.startswith('Threads:')][0].split()[1])
w = np.random.default_rng(0).standard_normal((65536, 32)).astype(np.float32)
m = _C.QuantMatrix([("F32", w.view(np.uint8))])
x = np.ones((1, 32), np.float32)
y1, y = np.empty((1, 65536), np.float32), np.empty((1, 65536), np.float32)
_C.gemv_matrix(m, x, y1, 1)
before = threads()
_C.gemv_matrix(m, x, y, 100000)
print(threads() - before, bool((y == y1).all()))
"""
    r = subprocess.run([sys.executable, *(["-S"] if sys.flags.no_site else []), "-c", code], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    started, same = r.stdout.split()
    assert 0 < int(started) <= 255 and same == "True", r.stdout


# The int8 GEMM's two families (a matrix's parts are all of one): one part of each type, odd row counts.
FAMILIES = {"kquant": (("Q4_K", 37), ("Q6_K", 21), ("Q5_K", 19)),
            "q32": (("Q4_1", 37), ("Q5_0", 21), ("Q4_0", 19), ("Q5_1", 5))}


def family_parts(family: str, inp: int, seed: int) -> list:
    return [(t, random_rows(t, n, inp, seed + i)) for i, (t, n) in enumerate(FAMILIES[family])]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("T,threads", [(1, 1), (5, 2), (9, 3)])
def test_int8_gemm_matches_the_int8_reference(force_scalar, family, T, threads):
    """The prefill GEMM on K-quant parts or on 4/5-bit 32-value parts (a bias): q8(x) per 256 or 32 values times
    the dequantized rows, as the decode GEMV computes each row; bitwise the same at 1 and 3 threads."""
    inp = 512
    parts = family_parts(family, inp, 11)
    out = sum(raw.shape[0] for _, raw in parts)
    g = torch.Generator().manual_seed(T)
    x = torch.randn(T, inp, generator=g) * 2.0
    b = torch.randn(out, generator=g)
    m = _C.QuantMatrix(parts, b.numpy())
    y = np.full((T, out), np.nan, np.float32)
    _C.gemm_int8(m, x.numpy(), y, threads)
    y1 = np.full((T, out), np.nan, np.float32)
    _C.gemm_int8(m, x.numpy(), y1, 1)
    np.testing.assert_array_equal(y, y1)
    row = 0
    for t, raw in parts:
        n = raw.shape[0]
        ref, tol = reference(t, raw, x, b[row:row + n])
        got = torch.from_numpy(y[:, row:row + n]).double()
        assert ((got - ref).abs() <= tol).all(), f"{t}: max excess {((got - ref).abs() - tol).max():.3g}"
        row += n


# The GEMM's kernel paths on this CPU: the AVX-VNNI tile where it has AVX-VNNI, the AVX2 tile, the scalar twins.
PATHS = ("vnni", "avx2", "scalar") if _C.cpu_features()["avx_vnni"] and _C.use_avx2() else ("avx2", "scalar")


def on_path(path: str, fn):
    """fn() with the GEMM's kernels of one path (the settings restored after it)."""
    scalar, allow = _C.force_scalar(), _C.allow_vnni()
    _C.set_force_scalar(path == "scalar")
    _C.set_allow_vnni(path == "vnni")
    try:
        return fn()
    finally:
        _C.set_force_scalar(scalar)
        _C.set_allow_vnni(allow)


@pytest.mark.parametrize("family,inp", [("kquant", 768), ("q32", 96)])
def test_int8_gemm_paths_agree_bitwise(family, inp):
    """The AVX-VNNI tile, the AVX2 tile and the scalar twin take the same integer sums and the same fp32
    operations per row and block, on panels unpacked by the AVX2 kernel or its twin: the same bits, with padding
    rows (the row counts are not a multiple of the panel's 16), panels whose rows are of two types, and a token
    count that is not a multiple of the tile's."""
    parts = family_parts(family, inp, 21)
    out = sum(raw.shape[0] for _, raw in parts)
    m = _C.QuantMatrix(parts)
    x = (torch.randn(7, inp, generator=torch.Generator().manual_seed(5)) * 3.0).numpy()
    ys = []
    for path in PATHS:
        y = np.full((7, out), np.nan, np.float32)
        on_path(path, lambda: _C.gemm_int8(m, x, y, 2))
        ys.append(y)
    assert np.isfinite(ys[0]).all()
    for y in ys[:-1]:
        np.testing.assert_array_equal(y, ys[-1])


@pytest.mark.parametrize("qtype", ["Q4_K", "Q5_K", "Q6_K", "Q4_0", "Q4_1", "Q5_0", "Q5_1"])
def test_int8_gemm_one_type_paths_agree_bitwise(qtype):
    """A matrix of one type, 40 rows (two full panels and one of 8 rows and 8 padding rows) over three scaled
    blocks or more (the AVX2 unpacking's prefetch two blocks ahead): the three paths give the same bits."""
    inp = 768 if qtype.endswith("_K") else 128
    m = _C.QuantMatrix([(qtype, random_rows(qtype, 40, inp, 9))])
    x = (torch.randn(5, inp, generator=torch.Generator().manual_seed(6)) * 2.0).numpy()
    ys = []
    for path in PATHS:
        y = np.full((5, 40), np.nan, np.float32)
        on_path(path, lambda: _C.gemm_int8(m, x, y, 2))
        ys.append(y)
    assert np.isfinite(ys[-1]).all()
    for y in ys[:-1]:
        np.testing.assert_array_equal(y, ys[-1])


def max_code_rows(qtype: str, out: int, inp: int) -> np.ndarray:
    """Rows whose every code is its type's largest (and K-quant sub-scales and mins too): random_rows' sane fp16
    scales, every other byte 0xFF."""
    raw = random_rows(qtype, out, inp, 7)
    bb = raw.shape[1] // (inp // (256 if qtype in ("Q4_K", "Q5_K", "Q6_K") else 32))
    blocks = raw.reshape(-1, bb)
    keep = np.zeros(bb, bool)
    for off in FP16_FIELDS[qtype]:
        keep[off:off + 2] = True
    blocks[:, ~keep] = 0xFF
    return blocks.reshape(out, -1)


@pytest.mark.parametrize("qtype", ["Q4_K", "Q5_K", "Q6_K", "Q4_0", "Q4_1", "Q5_0", "Q5_1"])
@pytest.mark.parametrize("path", PATHS)
def test_int8_gemm_at_the_int16_bound(qtype, path):
    """The int16 pair sums at their largest: every code at its type's maximum against x of one magnitude (every
    quantized value +-127), the most steps each type adds up before widening; a step too many would saturate
    and miss the reference by far (and the VNNI tile's int32 sums at their largest). The three kernel paths; a
    single 32-value block, and several."""
    for inp in ((256, 512) if qtype in ("Q4_K", "Q5_K", "Q6_K") else (32, 96)):
        raw = max_code_rows(qtype, 19, inp)
        m = _C.QuantMatrix([(qtype, raw)])
        x = torch.full((4, inp), 0.75)
        x[1] = -0.75
        x[2, ::2] = -0.75
        y = np.full((4, 19), np.nan, np.float32)
        on_path(path, lambda: _C.gemm_int8(m, x.numpy(), y, 2))
        ref, tol = reference(qtype, raw, x, torch.zeros(19))
        got = torch.from_numpy(y).double()
        assert ((got - ref).abs() <= tol).all(), f"{qtype} in={inp}: max excess {((got - ref).abs() - tol).max():.3g}"


@pytest.mark.parametrize("path", PATHS)
def test_int8_gemm_q6_k_at_its_largest_scales(path):
    """Q6_K with every code 63 and its int8 scales at both ends (-128 and 127, alternating by group) against x
    of one magnitude: the sums at their largest magnitude, both signs of the scale through the VNNI tile's
    widening and the AVX2 tile's madd."""
    inp = 512
    raw = max_code_rows("Q6_K", 19, inp)
    blocks = raw.reshape(-1, 210)
    blocks[:, 192:208] = np.tile(np.array([0x80, 0x7F], np.uint8), 8)
    x = torch.full((3, inp), 0.75)
    x[1] = -0.75
    x[2, ::3] = -0.75
    y = np.full((3, 19), np.nan, np.float32)
    on_path(path, lambda: _C.gemm_int8(_C.QuantMatrix([("Q6_K", raw)]), x.numpy(), y, 2))
    ref, tol = reference("Q6_K", raw, x, torch.zeros(19))
    got = torch.from_numpy(y).double()
    assert ((got - ref).abs() <= tol).all(), f"max excess {((got - ref).abs() - tol).max():.3g}"


def test_linear_takes_the_int8_gemm_for_one_family_only():
    """A fused matrix takes the int8 GEMM when every part is of one family (Q4_1 + Q5_0; int8 activations), not
    with a Q8_0 part or across the families; each way a prefill chunk matches the reference."""
    inp, g = 256, torch.Generator().manual_seed(3)
    x = torch.randn(8, inp, generator=g)
    for types, takes in ((("Q4_1", "Q5_0"), True), (("Q4_1", "Q8_0"), False), (("Q4_0", "Q4_K"), False)):
        parts = [(t, random_rows(t, 21 + i, inp, 30 + i)) for i, t in enumerate(types)]
        lin = Linear(stack_rows(*(QuantWeight(parts=(p,), in_features=inp) for p in parts)))
        assert lin._int8_gemm == takes, types
        lin.use_x16(True)
        assert not lin._int8_gemm
        lin.use_x16(False)
        y = lin(x)
        row = 0
        for t, raw in parts:
            n = raw.shape[0]
            ref, tol = reference(t, raw, x, torch.zeros(n))
            if not takes:  # dequantized panels and an fp32 GEMM: no activation rounding
                ref = x.double() @ dequant(raw, t).T
            assert ((y[:, row:row + n].double() - ref).abs() <= tol).all(), (types, t)
            row += n


def test_int8_gemm_refuses_other_types():
    m = _C.QuantMatrix([("Q4_K", random_rows("Q4_K", 4, 256, 0)), ("Q8_0", random_rows("Q8_0", 4, 256, 0))])
    with pytest.raises(ValueError, match="not the two mixed, got Q4_K, Q8_0"):
        _C.gemm_int8(m, np.zeros((2, 256), np.float32), np.zeros((2, 8), np.float32), 1)
    mixed = _C.QuantMatrix([("Q4_K", random_rows("Q4_K", 4, 256, 0)), ("Q4_1", random_rows("Q4_1", 4, 256, 0))])
    with pytest.raises(ValueError, match="not the two mixed, got Q4_K, Q4_1"):
        _C.gemm_int8(mixed, np.zeros((2, 256), np.float32), np.zeros((2, 8), np.float32), 1)
    for types in (("Q8_0",), ("Q4_1", "Q8_0"), ("F16",)):
        m = _C.QuantMatrix([(t, random_rows(t, 4, 64, 0)) for t in types])
        with pytest.raises(ValueError, match=f"got {', '.join(types)}"):
            _C.gemm_int8(m, np.zeros((2, 64), np.float32), np.zeros((2, 4 * len(types)), np.float32), 1)
    k = _C.QuantMatrix([("Q6_K", random_rows("Q6_K", 4, 256, 0))])
    with pytest.raises(ValueError, match=r"y: expected shape \[2, 4\]"):
        _C.gemm_int8(k, np.zeros((2, 256), np.float32), np.zeros((2, 5), np.float32), 1)


@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("x16", [False, True])
def test_many_tokens_are_each_token_alone(qtype, x16):
    """T = 7 activation rows in one call (batched decode: the many-row kernels read each weight row once for up to
    4 of them), int8 or int16 x: each row bit for bit what it gets alone."""
    raw, x, b = case(qtype, 41, IN[qtype], 7, True)
    m = _C.QuantMatrix([(qtype, raw)], b.numpy(), x16=x16)
    y = np.empty((7, 41), np.float32)
    _C.gemv_matrix(m, x.numpy(), y, 2)
    for t in range(7):
        one = np.empty((1, 41), np.float32)
        _C.gemv_matrix(m, x.numpy()[t: t + 1], one, 2)
        assert np.array_equal(y[t], one[0]), t
