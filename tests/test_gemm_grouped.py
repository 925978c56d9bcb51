"""The grouped int8 GEMM (cpp/gemm/gemm_int8.h ``gemm_int8_grouped``: many matrices on their own rows of x in one
call, what a mixture of experts' prefill chunk needs) gives each matrix's ``gemm_int8`` on its rows bit for bit,
on both kernel paths, also reading each row's token of x through an index; the MoE FFN that uses it gives the
per-expert path's output bit for bit; bad arguments are one error."""

from __future__ import annotations

import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from ktquest.layers.linear import QuantWeight
from ktquest.models.ffn import MoEFeedForward
from ktquest.native import matrix

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
from random_blocks import random_blocks  # noqa: E402


def encoded(rows: int, cols: int, qtype: str, seed: int) -> QuantWeight:
    t = getattr(gguf.GGMLQuantizationType, qtype)
    n = rows * cols // gguf.GGML_QUANT_SIZES[t][0]
    data = np.ascontiguousarray(random_blocks(t, np.random.default_rng(seed), n, 0.05)).view(np.uint8)
    return QuantWeight(parts=((qtype, data.reshape(rows, -1)),), in_features=cols)


@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K", "Q4_0", "Q5_1"])
def test_grouped_equals_each_matrix_on_its_rows(force_scalar, qtype):
    cols = 512 if qtype.endswith("_K") else 96
    mats = [matrix.QuantMatrix(list(encoded(40, cols, qtype, s).parts), None) for s in range(5)]
    sizes = [7, 0, 1, 13, 3]  # an empty group, a group of one, groups not a multiple of the tile's 3 tokens
    offsets = np.cumsum([0, *sizes]).astype(np.int64)
    x = np.random.default_rng(1).standard_normal((offsets[-1], cols)).astype(np.float32)
    y = np.full((offsets[-1], 40), np.nan, np.float32)
    matrix.gemm_int8_grouped(mats, offsets, x, y, 2)
    for e, m in enumerate(mats):
        a, b = offsets[e], offsets[e + 1]
        if b > a:
            want = np.empty((b - a, 40), np.float32)
            matrix.gemm_int8(m, np.ascontiguousarray(x[a:b]), want, 1)
            np.testing.assert_array_equal(y[a:b], want)


@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K", "Q5_1"])
def test_grouped_rows_read_through_an_index(force_scalar, qtype):
    """With rows, grouped row i reads x row rows[i] (a token routed to several experts is read, and quantized,
    once): each group is its matrix's gemm_int8 on the gathered rows, bit for bit; tokens repeated and unused."""
    cols = 512 if qtype.endswith("_K") else 96
    mats = [matrix.QuantMatrix(list(encoded(24, cols, qtype, s).parts), None) for s in range(4)]
    sizes = [5, 0, 9, 4]
    offsets = np.cumsum([0, *sizes]).astype(np.int64)
    rng = np.random.default_rng(2)
    x = rng.standard_normal((11, cols)).astype(np.float32)
    rows = rng.integers(0, 10, offsets[-1]).astype(np.int64)  # token 10 unused
    y = np.full((offsets[-1], 24), np.nan, np.float32)
    matrix.gemm_int8_grouped(mats, offsets, x, y, 2, rows)
    for e, m in enumerate(mats):
        a, b = offsets[e], offsets[e + 1]
        if b > a:
            want = np.empty((b - a, 24), np.float32)
            matrix.gemm_int8(m, np.ascontiguousarray(x[rows[a:b]]), want, 1)
            np.testing.assert_array_equal(y[a:b], want)


def encoded_moe(seed: int, router_seed: int, dim: int = 256, width: int = 512, n_exp: int = 6) -> MoEFeedForward:
    """A MoE FFN of n_exp experts in the file's encoding (gate and up Q4_K, down Q6_K), 2 used a token; the
    experts' weights from seeds seed, seed + 10 and seed + 20 (plus the expert's index)."""
    gate = [encoded(width, dim, "Q4_K", seed + e) for e in range(n_exp)]
    up = [encoded(width, dim, "Q4_K", seed + 10 + e) for e in range(n_exp)]
    down = [encoded(dim, width, "Q6_K", seed + 20 + e) for e in range(n_exp)]
    router = torch.randn(n_exp, dim, generator=torch.Generator().manual_seed(router_seed))
    return MoEFeedForward(router, gate, up, down, n_used=2, norm_topk=True)


def test_a_moe_ffn_on_encoded_experts_gives_the_per_expert_bits():
    ffn, dim = encoded_moe(10, 2), 256
    x = torch.randn(40, dim, generator=torch.Generator().manual_seed(3))
    assert ffn._groupable(x)
    got = ffn(x)
    ffn._groupable = lambda xs: False  # one expert at a time
    torch.testing.assert_close(got, ffn(x), atol=0, rtol=0)


def test_bad_arguments_are_one_error():
    a = matrix.QuantMatrix(list(encoded(16, 256, "Q4_K", 0).parts), None)
    b = matrix.QuantMatrix(list(encoded(32, 256, "Q4_K", 1).parts), None)
    x, y = np.zeros((4, 256), np.float32), np.zeros((4, 16), np.float32)
    with pytest.raises(ValueError, match=r"mats\[1\]: every matrix must have mats\[0\]'s shape \[16, 256\]"):
        matrix.gemm_int8_grouped([a, b], np.array([0, 2, 4], np.int64), x, y, 1)
    with pytest.raises(ValueError, match="offsets: must not decrease"):
        matrix.gemm_int8_grouped([a, a], np.array([0, 3, 2], np.int64), x, y, 1)
    with pytest.raises(ValueError, match=r"x: expected shape \[5, 256\]"):
        matrix.gemm_int8_grouped([a, a], np.array([0, 3, 5], np.int64), x, y, 1)
    with pytest.raises(TypeError, match=r"mats\[0\]: expected a QuantMatrix"):
        matrix.gemm_int8_grouped(["no"], np.array([0, 4], np.int64), x, y, 1)
    with pytest.raises(IndexError, match=r"rows\[2\] = 4 is outside the 4 rows of x"):
        matrix.gemm_int8_grouped([a, a], np.array([0, 2, 4], np.int64), x, y, 1, np.array([0, 3, 4, 1], np.int64))
    with pytest.raises(IndexError, match=r"rows\[0\] = -1 is outside"):
        matrix.gemm_int8_grouped([a, a], np.array([0, 2, 4], np.int64), x, y, 1, np.array([-1, 3, 2, 1], np.int64))
    with pytest.raises(ValueError, match=r"rows: expected shape \[4\], got \[3\]"):
        matrix.gemm_int8_grouped([a, a], np.array([0, 2, 4], np.int64), x, y, 1, np.array([0, 1, 2], np.int64))


@pytest.mark.parametrize("counts", [[10, 6, 13, 5, 7, 9], [10, 0, 13, 5, 0, 9], [10, 2, 13, 0, 7, 8]])
def test_grouped_experts_in_place_or_gathered_give_the_per_expert_bits(counts):
    """The experts' rows grouped by expert, each a token of x read in place: with every group big or empty, the
    down call writes the grouped rows in place; with some groups of a few tokens (their GEMV), the big groups'
    rows are taken apart first. Either way each row is its expert's output on its token, bit for bit the
    one-expert-at-a-time path."""
    ffn, dim = encoded_moe(40, 4, n_exp=len(counts)), 256
    x = torch.randn(30, dim, generator=torch.Generator().manual_seed(5))
    src = torch.randint(0, 30, (sum(counts),), generator=torch.Generator().manual_seed(6))
    got = ffn._experts(x, src, counts)
    ffn._groupable = lambda x: False  # one expert at a time
    torch.testing.assert_close(got, ffn._experts(x, src, counts), atol=0, rtol=0)
