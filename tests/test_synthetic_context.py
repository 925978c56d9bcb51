"""tools/synthetic_context.py (bench_decode --synthetic): a made-up context decodes on from position N in the dense
cache and the long-context store; its K/V have the documented statistics; its needle blocks win the recorded
queries' selection and SnapKV's preselection; the AR(1) scan equals the recursion."""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import pytest
import torch

import ktquest
from ktquest.generate import decode_one_token

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "configs"
SMALL_LC = {"long_context.block_size": 8, "long_context.init_windows_len": 8, "long_context.local_windows_len": 64,
            "long_context.second_select_num": 8, "long_context.dense_layer_num": 0, "chunk_size": 64}
CASES = {
    "dense": (None, {}),
    "quest": (CONFIGS / "quest.yaml", SMALL_LC),
    "snapkv": (CONFIGS / "snapkv.yaml", {**SMALL_LC, "long_context.preselect_block_count": 40,
                                         "long_context.kv_type": "FP16"}),  # (head_dim 16: no Q8_0)
}
N = 1500  # not a multiple of the block size nor of the slab


def _tool():
    spec = importlib.util.spec_from_file_location("tool_synthetic_context", REPO / "tools" / "synthetic_context.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


sc = _tool()


def _filled(model, case: str, n: int = N):
    config, sets = CASES[case]
    eng = ktquest.load(model, config, threads=1, max_seq_len=n + 64, **sets)
    return eng, sc.fill(eng.cache, eng.model.args, n, slab=600)


@pytest.mark.parametrize("case", list(CASES))
def test_decodes_on_from_n(tiny_llama, case):
    eng, filled = _filled(tiny_llama.path, case)
    cache = eng.cache
    assert cache.pos == N == filled.n
    tok = 5
    for i in range(4):
        logits = decode_one_token(eng.model, cache, tok)
        assert torch.isfinite(logits).all()
        tok = int(logits.argmax())
        assert cache.pos == N + i + 1
    if case != "dense":
        assert all(cache.store.length(layer) == N + 4 for layer in range(cache.n_layers))
        assert cache.selection(1) is not None  # a decode step selected context blocks
    if case == "snapkv":  # the recorded queries point at the needles: SnapKV keeps most of them as candidates
        # (the tiny model's fast RoPE turns the mean key into some queries' way: a block may outbid a needle)
        for layer, needles in enumerate(filled.needle_blocks):
            cand = cache.candidates(layer)
            for h in range(needles.shape[0]):
                assert len(set(needles[h].tolist()) & set(cand[h].tolist())) >= 0.75 * needles.shape[1]


@pytest.mark.parametrize("case", ["dense", "snapkv"])
def test_a_hybrid_model_decodes_on_from_n(tmp_path, tiny_bpe, case):
    """A Qwen3.5-shaped model (partial rotary, gated attention): the attention layers' cache is filled, the
    DeltaNet states stand at N, and decode goes on from there."""
    from conftest import write_gguf
    from tiny_qwen35 import QWEN35_SPECS, build_qwen35, qwen35_gguf_tensors, qwen35_metadata

    spec = QWEN35_SPECS["qwen35"]
    path = write_gguf(tmp_path / "h.gguf", spec.arch, qwen35_metadata(spec),
                      qwen35_gguf_tensors(build_qwen35(spec, len(tiny_bpe.tokens)), spec), tiny_bpe)
    eng, _ = _filled(path, case)
    cache = eng.cache
    assert cache.pos == cache.main.pos == N and cache.states.hi == [N] * 3 and cache.states.ssm.abs().sum() > 0
    tok = 5
    for i in range(3):
        logits = decode_one_token(eng.model, cache, tok)
        assert torch.isfinite(logits).all()
        tok = int(logits.argmax())
        assert cache.pos == N + i + 1 and cache.states.hi == [N + i + 1] * 3


def test_statistics_as_documented(tiny_models):
    # (tiny qwen3: head_dim 32, RoPE base 1e6, as real models' slow pairs; tiny llama's base 1e4 at head_dim 16
    # turns the mean away within a few thousand positions)
    eng, filled = _filled(tiny_models("qwen3").path, "dense", n=4096)
    spec = sc.SyntheticKV()
    for layer in range(eng.cache.n_layers):
        k, v = (x[:, :4096].transpose(0, 1) for x in eng.cache.layer_kv(layer))  # [T, KVH, D]
        needle = torch.zeros(4096, dtype=torch.bool)
        for b in filled.needle_blocks[layer].flatten().tolist():
            needle[b * filled.block_size: (b + 1) * filled.block_size] = True
        st = sc.key_stats(k[~needle])
        assert st["key_norm"] == pytest.approx(spec.key_norm, rel=0.1)
        assert 0.6 < st["mean_share"] <= spec.mean_share + 0.02  # (RoPE turns some of the mean away)
        assert 0.6 < st["lag1_cos"] < 0.85 and 0.25 < st["lag8_cos"] < 0.6 and 0.0 < st["lag64_cos"] < 0.4
        assert v.norm(dim=-1).mean().item() == pytest.approx(spec.value_norm, rel=0.1)


def test_needles_win_and_anchors_differ(tiny_models):
    eng, filled = _filled(tiny_models("qwen3").path, "quest")
    store, bs = eng.cache.store, filled.block_size
    H, kvh = eng.model.args.n_heads, eng.model.args.n_kv_heads
    for layer, needles in enumerate(filled.needle_blocks):
        k = store.read(layer)[0]  # [N, KVH, D]
        nb = N // bs
        blocks = k[: nb * bs].view(nb, bs, kvh, -1)
        lo, hi = blocks.amin(1), blocks.amax(1)  # QUEST's anchors, [nb, KVH, D]
        assert torch.unique(torch.cat([lo, hi], -1).flatten(1), dim=0).shape[0] == nb  # no two blocks alike
        q = filled.query_dirs[layer].repeat_interleave(H // kvh, 0) * 14.0  # [H, D]: the recorded queries' way
        picks = store.select(layer, q.contiguous(), needles.shape[1], "SEPARATE", [(0, 1), (nb - 8, nb + 1)])
        for h in range(kvh):  # (QUEST's bounds are upper bounds: a noisy block may outbid a needle or two)
            assert len(set(picks[h].tolist()) & set(needles[h].tolist())) >= 0.75 * needles.shape[1]


@pytest.mark.parametrize("rho", [0.0, 0.0005, 0.25, 0.5, math.exp(-1 / 100)])
def test_ar1_scan_is_the_recursion(rho):
    g = torch.Generator().manual_seed(1)
    e, x0 = torch.randn(1000, 3, generator=g), torch.randn(3, generator=g)
    ref, x = torch.empty(1000, 3, dtype=torch.float64), x0.double()
    for t in range(1000):
        x = rho * x + e[t].double()
        ref[t] = x
    torch.testing.assert_close(sc.ar1(e, rho, x0).double(), ref, rtol=0, atol=1e-3 if rho < 1e-3 else 2e-5)


def test_refuses_other_caches_and_lengths(tiny_llama):
    eng = ktquest.load(tiny_llama.path, threads=1, max_seq_len=128)
    with pytest.raises(ValueError, match="n=129"):
        sc.fill(eng.cache, eng.model.args, 129)
    with pytest.raises(ValueError, match="dense or long_context"):
        sc.fill(object(), eng.model.args, 8)
