"""The gated delta rule's native kernels (cpp/delta/: AVX2 and its scalar twin, heads in parallel) against the
torch reference of the recurrence (models/delta_net.delta_rule): odd head counts and dims, value dims that are
not whole vectors, a state carried across calls (chunk edges), thread counts, and arguments of the wrong
shape."""

from __future__ import annotations

import pytest
import torch

from ktquest import _C
from ktquest.models.delta_net import delta_rule, l2_normalize


def inputs(T: int, Hk: int, Hv: int, Dk: int, Dv: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q = l2_normalize(torch.randn(T, Hk, Dk, generator=gen), 1e-6) * Dk ** -0.5
    k = l2_normalize(torch.randn(T, Hk, Dk, generator=gen), 1e-6)
    v = torch.randn(T, Hv, Dv, generator=gen)
    g = -torch.rand(T, Hv, generator=gen) * 2.0  # decays exp(g) in (0.13, 1]
    beta = torch.rand(T, Hv, generator=gen)
    S = torch.randn(Hv, Dk, Dv, generator=gen) * 0.3
    return q, k, v, g, beta, S


def native(q, k, v, g, beta, S, threads: int = 2, grouped: bool = False):
    out = torch.empty_like(v)
    _C.gated_delta_rule(q.numpy(), k.numpy(), v.numpy(), g.numpy(), beta.numpy(), S.numpy(), out.numpy(), threads,
                        grouped)
    return out


@pytest.mark.parametrize("T, Hk, Hv, Dk, Dv", [(1, 1, 1, 8, 8), (37, 3, 9, 17, 20), (5, 2, 6, 16, 24),
                                               (9, 4, 4, 32, 72), (3, 1, 3, 128, 130), (2, 16, 32, 128, 128)])
def test_native_matches_the_reference(force_scalar, T, Hk, Hv, Dk, Dv):
    q, k, v, g, beta, S = inputs(T, Hk, Hv, Dk, Dv)
    S_ref, S_nat = S.clone(), S.clone()
    want = delta_rule(q, k, v, g, beta, S_ref)
    got = native(q, k, v, g, beta, S_nat)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(S_nat, S_ref, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("Hk, Hv", [(2, 6), (3, 9), (4, 4)])
def test_grouped_heads_read_their_groups_k(force_scalar, Hk, Hv):
    """Value head h reads q/k head h // (Hv / Hk) with grouped (qwen3next's order), h % Hk without."""
    q, k, v, g, beta, S = inputs(7, Hk, Hv, 16, 24, seed=5)
    for grouped in (False, True):
        S_ref, S_nat = S.clone(), S.clone()
        want = delta_rule(q, k, v, g, beta, S_ref, grouped)
        torch.testing.assert_close(native(q, k, v, g, beta, S_nat, grouped=grouped), want, atol=2e-5, rtol=2e-5)
        torch.testing.assert_close(S_nat, S_ref, atol=2e-5, rtol=2e-5)
    r = Hv // Hk
    S1, S2 = S.clone(), S.clone()  # grouped: head h against the tiled rule on k heads spread by repeat_interleave
    want = delta_rule(q.repeat_interleave(r, 1), k.repeat_interleave(r, 1), v, g, beta, S1)
    torch.testing.assert_close(native(q, k, v, g, beta, S2, grouped=True), want, atol=2e-5, rtol=2e-5)


def test_the_state_carries_across_calls(force_scalar):
    """Tokens fed in runs of 1, 4 and 18 give the bits of one call over all 23 (a chunk edge changes nothing)."""
    q, k, v, g, beta, S = inputs(23, 2, 6, 16, 24, seed=3)
    S_one, S_runs = S.clone(), S.clone()
    whole = native(q, k, v, g, beta, S_one)
    parts = [native(q[a:b].contiguous(), k[a:b].contiguous(), v[a:b].contiguous(), g[a:b].contiguous(),
                    beta[a:b].contiguous(), S_runs) for a, b in ((0, 1), (1, 5), (5, 23))]
    assert torch.equal(torch.cat(parts), whole) and torch.equal(S_runs, S_one)


def test_threads_do_not_change_the_bits():
    q, k, v, g, beta, S = inputs(11, 3, 9, 16, 40, seed=4)
    runs = [(native(q, k, v, g, beta, s := S.clone(), threads), s) for threads in (1, 2, 5)]
    for out, s in runs[1:]:
        assert torch.equal(out, runs[0][0]) and torch.equal(s, runs[0][1])


@pytest.mark.parametrize("change, needle", [
    (lambda a: a | {"k": a["k"][:, :, :-1].contiguous()}, "k: expected shape [4, 2, 16], got [4, 2, 15]"),
    (lambda a: a | {"S": a["S"][:5].contiguous()}, "S: expected shape [6, 16, 24], got [5, 16, 24]"),
    (lambda a: a | {"g": a["g"].double()}, "g: expected a numpy array of dtype float32"),
    (lambda a: a | {"o": a["o"][:, ::2]}, "o: expected shape"),
    (lambda a: a | {"q": a["q"][:, :1].contiguous(), "k": a["k"][:, :1].contiguous()}, None),  # Hk 1: fine
    (lambda a: a | {"q": a["q"][:, :1].repeat(1, 4, 1), "k": a["k"][:, :1].repeat(1, 4, 1)},
     "Hv=6: a multiple of Hk=4"),
])
def test_arguments_of_the_wrong_shape_are_one_error(change, needle):
    q, k, v, g, beta, S = inputs(4, 2, 6, 16, 24)
    a = change({"q": q, "k": k, "v": v, "g": g, "beta": beta, "S": S, "o": torch.empty_like(v)})
    args = [a[n].numpy() for n in ("q", "k", "v", "g", "beta", "S", "o")]
    if needle is None:
        _C.gated_delta_rule(*args, 1)
        return
    with pytest.raises((ValueError, TypeError), match=needle.replace("[", r"\[").replace("]", r"\]")):
        _C.gated_delta_rule(*args, 1)
