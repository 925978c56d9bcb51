"""Q8_0 weight-only GEMV (cpp/gemm/gemv*.cpp) against a torch reference of the same quantization."""

import subprocess
import sys

import numpy as np
import pytest
import torch

from ktquest import _C
from ktquest.layers.linear import Linear


def q8_0_reference(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w: [R, C] fp32 -> (q int8 [R, C], d fp32 [R, C/32]); round half to even, d = absmax/127."""
    g = w.reshape(w.shape[0], -1, 32)
    d = g.abs().amax(-1) / 127.0
    inv = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
    q = torch.round(g * inv[..., None]).to(torch.int8)  # torch.round is half-to-even
    return q.reshape(w.shape), d


def gemv_reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """Weight-only Q8_0: x [T, in] fp32 times the dequantized weight, summed in fp64."""
    qw, dw = q8_0_reference(w)
    wd = (qw.reshape(w.shape[0], -1, 32).double() * dw.double()[..., None]).reshape(w.shape)
    return (x.double() @ wd.T + (0 if b is None else b.double())).float()


# The kernel sums group products in fp32 (8 lanes, then a horizontal add); the reference in fp64.
FP32_SUM_RTOL = 1e-5
FP32_SUM_ATOL = 1e-4


def test_quantize_matches_reference(force_scalar):
    torch.manual_seed(0)
    w = torch.randn(37, 96) * torch.logspace(-3, 2, 96)
    w[3] = 0.0  # an all-zero group gets scale 0, values 0
    q, d = _C.quantize_q8_0(w.numpy())
    qr, dr = q8_0_reference(w)
    np.testing.assert_array_equal(d, dr.numpy())
    np.testing.assert_array_equal(q, qr.numpy())


@pytest.mark.parametrize("T,inp,out", [(1, 32, 1), (1, 64, 7), (1, 576, 19), (3, 96, 129), (2, 1536, 576)])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("threads", [1, 2, 8])
def test_gemv_matches_reference(force_scalar, T, inp, out, bias, threads):
    g = torch.Generator().manual_seed(T * 1000 + inp + out)
    w = torch.randn(out, inp, generator=g)
    x = torch.randn(T, inp, generator=g)
    b = torch.randn(out, generator=g) if bias else None
    qw, dw = _C.quantize_q8_0(w.numpy())
    y = np.empty((T, out), np.float32)
    _C.gemv_q8_0(x.numpy(), qw, dw, None if b is None else b.numpy(), y, threads)
    torch.testing.assert_close(torch.from_numpy(y), gemv_reference(x, w, b), rtol=FP32_SUM_RTOL, atol=FP32_SUM_ATOL)


def test_gemv_thread_count_is_bitwise_deterministic():
    torch.manual_seed(1)
    w, x = torch.randn(1000, 576), torch.randn(1, 576)
    qw, dw = _C.quantize_q8_0(w.numpy())
    outs = []
    for threads in (1, 2, 3, 8):
        y = np.empty((1, 1000), np.float32)
        _C.gemv_q8_0(x.numpy(), qw, dw, None, y, threads)
        outs.append(y)
    for y in outs[1:]:
        np.testing.assert_array_equal(y, outs[0])


def test_a_huge_thread_count_is_capped():
    """Asking for 100,000 threads starts at most 256 (the pool's cap): the same result, no exhausted process.
    In a child process, so this one does not keep the workers."""
    code = """
import numpy as np
from ktquest import _C
def threads():
    return int([s for s in open('/proc/self/status') if s.startswith('Threads:')][0].split()[1])
w = np.random.default_rng(0).standard_normal((65536, 32)).astype(np.float32)
q, d = _C.quantize_q8_0(w)
x = np.ones((1, 32), np.float32)
y1, y = np.empty((1, 65536), np.float32), np.empty((1, 65536), np.float32)
_C.gemv_q8_0(x, q, d, None, y1, 1)
before = threads()
_C.gemv_q8_0(x, q, d, None, y, 100000)
print(threads() - before, bool((y == y1).all()))
"""
    r = subprocess.run([sys.executable, *(["-S"] if sys.flags.no_site else []), "-c", code], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    started, same = r.stdout.split()
    assert 0 < int(started) <= 255 and same == "True", r.stdout


def test_linear_q8_path_close_to_fp32():
    torch.manual_seed(2)
    lin = Linear(torch.randn(300, 256) * 0.05, torch.randn(300))
    x = torch.randn(1, 256)
    ref = lin(x)
    assert lin.enable_q8(threads=2)
    y = lin(x)
    # Weight rounding only (at most half a step of absmax/127 per weight): well under 1% of the scale.
    torch.testing.assert_close(y, ref, rtol=0, atol=0.01 * ref.abs().max().item())
    long = torch.randn(16, 256)  # prefill chunks stay on the fp32 weight
    torch.testing.assert_close(lin(long), torch.nn.functional.linear(long, lin.weight, lin.bias))


@pytest.mark.parametrize(
    "args,match",
    [
        ((np.zeros((1, 64), np.float64),), "x: expected a numpy array of dtype float32"),
        ((np.zeros((64,), np.float32),), "x: expected 2 dimensions"),
        ((np.zeros((1, 64), np.float32)[:, ::2],), "must be C-contiguous|dimension"),
        ((np.zeros((1, 48), np.float32),), "qw: expected"),
    ],
)
def test_gemv_bad_arguments_raise(args, match):
    qw, dw = _C.quantize_q8_0(np.zeros((8, 64), np.float32))
    with pytest.raises((TypeError, ValueError), match=match):
        _C.gemv_q8_0(args[0], qw, dw, None, np.zeros((1, 8), np.float32), 1)


def test_gemv_bad_output_and_bias_raise():
    qw, dw = _C.quantize_q8_0(np.zeros((8, 64), np.float32))
    x = np.zeros((1, 64), np.float32)
    with pytest.raises(ValueError, match=r"y: expected \[1, 8\]"):
        _C.gemv_q8_0(x, qw, dw, None, np.zeros((1, 9), np.float32), 1)
    with pytest.raises(ValueError, match=r"bias: expected \[8\]"):
        _C.gemv_q8_0(x, qw, dw, np.zeros(7, np.float32), np.zeros((1, 8), np.float32), 1)
    with pytest.raises(ValueError, match="n_threads"):
        _C.gemv_q8_0(x, qw, dw, None, np.zeros((1, 8), np.float32), 0)
    with pytest.raises(ValueError, match="multiple of 32"):
        _C.quantize_q8_0(np.zeros((2, 40), np.float32))
