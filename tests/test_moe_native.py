"""The native mixture-of-experts FFN (cpp/moe/, ktquest/native/moe.py) on experts in every encoding with kernels,
both kernel paths: against the torch experts on the same encoded weights (models/ffn.py's MoEFeedForward, whose
per-expert GEMVs are the kernels tests/test_gemv_quant.py checks), against dequantize + float64 torch, and its
routing against models/ffn.route (ties, k = 1, odd expert counts)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_gemv_quant import FLOAT_TYPES, K_TYPES, Q32_TYPES, random_rows

from ktquest.layers.linear import Linear, QuantWeight
from ktquest.models.ffn import MoEFeedForward, route
from ktquest.native import moe

DIM, FFN = 256, 256  # the K-quants' rows are whole super-blocks of 256
# The same kernels on the same quantized x: the k weighted outputs summed in another order (routing order here,
# expert order in torch's index_add_), fp32 rounding relative to the largest output
SAME_KERNELS_RTOL, SAME_KERNELS_ATOL_REL = 1e-5, 1e-6
# Against fp32 x and float64 weights, in relative L2 norm: x and the experts' hidden state are each rounded to int8
# (q8_act.h), per 32 values (~1% on these random blocks) or per 256 for the K-quants (a coarser step: ~2.5%); the
# float types take fp32 x as it is.
REL_L2 = {**{t: 2e-2 for t in Q32_TYPES}, **{t: 5e-2 for t in K_TYPES}, **{t: 1e-5 for t in FLOAT_TYPES}}


def experts(qtype: str, n: int, rows: int, cols: int, seed: int) -> tuple[QuantWeight, ...]:
    """n experts [rows, cols] in `qtype`: views of one stacked [n, rows, row_bytes] array, as the loader makes them."""
    stack = random_rows(qtype, n * rows, cols, seed).reshape(n, rows, -1)
    return tuple(QuantWeight(parts=((qtype, stack[e]),), in_features=cols) for e in range(n))


def make_ffn(qtype: str, n: int, k: int, norm: bool, seed: int = 0):
    """(torch MoEFeedForward, native MoeFfn) on the same weights: an F32 router (llama.cpp keeps ffn_gate_inp in
    F32), the experts in `qtype`."""
    rng = np.random.default_rng(seed)
    router = QuantWeight(parts=(("F32", rng.standard_normal((n, DIM), dtype=np.float32).view(np.uint8)),),
                         in_features=DIM)
    gate, up = experts(qtype, n, FFN, DIM, seed + 1), experts(qtype, n, FFN, DIM, seed + 2)
    down = experts(qtype, n, DIM, FFN, seed + 3)
    ref = MoEFeedForward(router, gate, up, down, k, norm)
    nat = moe.MoeFfn(ref.router.qm, [e.w_gate_up.qm for e in ref.experts], [e.w_down.qm for e in ref.experts], k, norm)
    return ref, nat, (router, gate, up, down)


def dequantized_reference(ws, k: int, norm: bool, x: torch.Tensor) -> torch.Tensor:
    """x [dim] -> the MoE FFN in float64 on the dequantized experts."""
    router, gate, up, down = ws
    d = lambda q: torch.from_numpy(q.dequantize()).double()  # noqa: E731
    weights, ids = route((x.double() @ d(router).T)[None], k, norm)
    y = torch.zeros(DIM, dtype=torch.float64)
    for w, e in zip(weights[0].tolist(), ids[0].tolist()):
        h = torch.nn.functional.silu(d(gate[e]) @ x.double()) * (d(up[e]) @ x.double())
        y += w * (d(down[e]) @ h)
    return y


TYPES = FLOAT_TYPES + Q32_TYPES + K_TYPES


@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("n,k,norm", [(1, 1, True), (3, 1, False), (7, 2, True), (5, 3, False)],
                         ids=["1-of-1", "1-of-3", "2-of-7-renorm", "3-of-5"])
def test_moe_ffn_matches_the_torch_experts(force_scalar, qtype, n, k, norm):
    ref, nat, ws = make_ffn(qtype, n, k, norm, seed=n * 10 + k)
    check_native_ffn(ref, nat, qtype, k, norm, lambda x: dequantized_reference(ws, k, norm, x))


def check_native_ffn(ref, nat, qtype: str, k: int, norm: bool, reference) -> None:
    """The native MoE FFN ``nat`` on one token: the torch FFN ``ref``'s routing and weights, its output within the
    same kernels' rounding, and within REL_L2 of ``reference(x)`` (dequantized weights in float64)."""
    x = torch.randn(DIM, generator=torch.Generator().manual_seed(k))
    y = np.empty(DIM, np.float32)
    ids, weights = nat.run(x.numpy(), y, 2)
    ref_w, ref_ids = route(ref.router(x[None]), k, norm)
    assert ids.tolist() == ref_ids[0].tolist()
    torch.testing.assert_close(torch.from_numpy(weights), ref_w[0], atol=1e-6, rtol=1e-6)
    same = ref(x[None])[0]
    torch.testing.assert_close(torch.from_numpy(y), same, rtol=SAME_KERNELS_RTOL,
                               atol=SAME_KERNELS_ATOL_REL * float(same.abs().max()))
    expected = reference(x)
    err = torch.linalg.norm(torch.from_numpy(y).double() - expected) / torch.linalg.norm(expected)
    assert err <= REL_L2[qtype], f"relative L2 error {float(err):.3g}"


@pytest.mark.parametrize("qtype", ["Q4_K", "Q8_0", "F16"])
def test_moe_ffn_is_the_same_for_any_thread_count(qtype):
    _, nat, _ = make_ffn(qtype, 7, 3, True)
    x = np.random.default_rng(3).standard_normal(DIM, dtype=np.float32)
    outs = []
    for threads in (1, 2, 3, 8):
        y = np.empty(DIM, np.float32)
        nat.run(x, y, threads)
        outs.append(y)
    for y in outs[1:]:
        assert np.array_equal(y, outs[0])


@pytest.mark.parametrize("n,k", [(1, 1), (5, 1), (7, 2), (8, 3), (19, 4), (128, 8)])
@pytest.mark.parametrize("norm", [True, False])
def test_native_route_matches_the_torch_route(n, k, norm):
    logits = torch.randn(6, n, generator=torch.Generator().manual_seed(n))
    logits[1] = 0.0  # every expert tied
    logits[2, : n // 2] = 3.0  # ties at the top
    logits[3, n // 3:] = -1.0  # ties at the bottom
    weights, ids = route(logits, k, norm)
    for t in range(6):
        nat_ids, nat_w = moe.route(logits[t].numpy(), k, norm)
        assert nat_ids.tolist() == ids[t].tolist()
        torch.testing.assert_close(torch.from_numpy(nat_w), weights[t], atol=1e-6, rtol=1e-6)


def test_moe_ffn_checks_its_arguments():
    ref, _, (router, gate, up, down) = make_ffn("Q8_0", 3, 2, True)
    gu = [e.w_gate_up.qm for e in ref.experts]
    dn = [e.w_down.qm for e in ref.experts]
    with pytest.raises(ValueError, match=r"n_used=4: expected 1\.\.3"):
        moe.MoeFfn(ref.router.qm, gu, dn, 4, True)
    short = QuantWeight(parts=(("F32", np.zeros((DIM, 32), np.float32).view(np.uint8)),), in_features=32)
    with pytest.raises(ValueError, match=r"experts_down\[1\]: expected \[256, 256\], got \[256, 32\]"):
        moe.MoeFfn(ref.router.qm, gu, [dn[0], Linear(short).qm, dn[2]], 2, True)
    with pytest.raises(ValueError, match="one of each per expert"):
        moe.MoeFfn(ref.router.qm, gu, dn[:2], 2, True)
    with pytest.raises(ValueError, match="router: expected"):
        moe.MoeFfn(ref.experts[0].w_down.qm, gu, dn, 2, True)
    with pytest.raises(TypeError, match="experts_gate_up"):
        moe.MoeFfn(ref.router.qm, [None] * 3, dn, 2, True)
