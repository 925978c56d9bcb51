"""RoPE scalings beyond the ones every tiny model sweeps (``test_model.test_logits_match_hf``): LongRoPE's
choice of factors by the cache's capacity, and dynamic NTK from the config, against Hugging Face's Llama."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from conftest import TINY_SPECS, build_hf_model, gguf_metadata, hf_to_gguf_tensors, write_gguf
from test_model import FP32_ATOL, FP32_RTOL, make_cache, prompt_ids

import ktquest
from ktquest.generate import prefill
from ktquest.models.loader import load_model, read_gguf
from ktquest.models.rope import rope_frequencies

# ---- LongRoPE (Phi-3): rope_factors_long/short.weight ----


def test_longrope_args(tiny_models):
    s = read_gguf(tiny_models("llama_longrope").path).args.rope_scaling
    rope = TINY_SPECS["llama_longrope"].rope
    assert (s.type, s.original_context_length, s.freq_factors) == ("longrope", 64, None)
    assert s.long_factors == pytest.approx(rope["long_factor"]) and s.short_factors == pytest.approx(
        rope["short_factor"])
    assert s.attn_factor == pytest.approx(math.sqrt(1 + math.log(4) / math.log(64)))  # the converter's


@pytest.mark.parametrize("n, factors", [(100, "long"), (64, "short")])
def test_longrope_matches_hf(tiny_models, n, factors):
    """A model built for n tokens uses the long factors past the trained 64 (llama.cpp: n_ctx > n_ctx_orig),
    the short ones up to it; HF picks by the sequence it sees, so a prompt of n tokens agrees."""
    path, hf = tiny_models("llama_longrope")
    model, _ = load_model(path, max_seq_len=n)
    s = model.args.rope_scaling
    inv_freq, mscale = rope_frequencies(model.args, n)
    plain = 10000.0 ** (-torch.arange(0, 16, 2, dtype=torch.float64) / 16)
    chosen = torch.tensor(getattr(s, f"{factors}_factors"), dtype=torch.float64)
    torch.testing.assert_close(inv_freq, plain / chosen)
    assert mscale == s.attn_factor
    tokens = prompt_ids(n, model.args.vocab_size, seed=7)
    with torch.inference_mode():
        expected = hf(tokens[None]).logits[0]
        cache = make_cache(model, n)
        prefill(model, cache, tokens[:-8], chunk_size=32)
        got = model(tokens[-8:], n - 8, cache)
    torch.testing.assert_close(got, expected[-8:], atol=FP32_ATOL, rtol=FP32_RTOL)


def test_longrope_without_the_type_key(tmp_path, tiny_bpe):
    """Phi-3 files of older converters carry the two tensors but no rope.scaling.type: still LongRoPE."""
    spec, vocab = TINY_SPECS["llama_longrope"], len(tiny_bpe.tokens)
    md, tensors = gguf_metadata(spec, vocab), hf_to_gguf_tensors(build_hf_model(spec, vocab), spec)
    old = {k: v for k, v in md.items() if k != "llama.rope.scaling.type"}
    new, old = (read_gguf(write_gguf(tmp_path / f"{name}.gguf", "llama", m, tensors, tiny_bpe))
                .args.rope_scaling for name, m in (("new", md), ("old", old)))
    assert old == new and old.type == "longrope"


# ---- dynamic NTK: the config's rope_scaling: dynamic ----


def _hf_dynamic(tiny_bpe, factor: float):
    """HF's Llama with rope_type "dynamic" on the tiny llama's weights (they do not depend on the rope)."""
    spec = dataclasses.replace(TINY_SPECS["llama"], rope={"rope_type": "dynamic", "factor": factor})
    return build_hf_model(spec, len(tiny_bpe.tokens))


def test_dynamic_ntk_from_the_config_matches_hf(tiny_llama, tiny_bpe):
    """``rope_scaling: dynamic`` through ktquest.load (Engine -> build_model -> the RoPE tables): one forward
    of L = max_seq_len tokens, past the trained 256, equals HF's dynamic rope over the same L tokens."""
    n = TINY_SPECS["llama"].ctx + 44
    hf = _hf_dynamic(tiny_bpe, 2.0)
    eng = ktquest.load(tiny_llama.path, max_seq_len=n, threads=1, rope_scaling="dynamic",
                       rope_scaling_factor=2.0)
    assert (eng.args.rope_scaling.type, eng.args.rope_scaling.factor) == ("dynamic", 2.0)
    tokens = prompt_ids(n, eng.args.vocab_size, seed=8)
    with torch.inference_mode():
        expected = hf(tokens[None]).logits[0]
        got = eng.model(tokens, 0, eng.cache)
        plain, _ = load_model(tiny_llama.path, max_seq_len=n)
        unscaled = plain(tokens, 0, make_cache(plain, n))
    torch.testing.assert_close(got, expected, atol=FP32_ATOL, rtol=FP32_RTOL)
    assert (unscaled - expected).abs().max() > 100 * FP32_ATOL  # the scaling is what made them agree


def test_dynamic_ntk_within_the_trained_context_and_unset(tiny_llama, tiny_models):
    """Up to the trained context dynamic NTK leaves the tables alone; unset, the file's scaling stays."""
    n = TINY_SPECS["llama"].ctx
    dyn = ktquest.load(tiny_llama.path, max_seq_len=n, threads=1, rope_scaling="dynamic",
                       rope_scaling_factor=4.0)
    plain = ktquest.load(tiny_llama.path, max_seq_len=n, threads=1)
    torch.testing.assert_close(dyn.model.rope_cos, plain.model.rope_cos, atol=0, rtol=0)
    torch.testing.assert_close(dyn.model.rope_sin, plain.model.rope_sin, atol=0, rtol=0)
    linear = ktquest.load(tiny_models("llama_linear").path, threads=1)
    assert plain.args.rope_scaling is None and linear.args.rope_scaling.type == "linear"
    replaced = ktquest.load(tiny_models("llama_linear").path, threads=1, rope_scaling="dynamic",
                            rope_scaling_factor=2.0)
    assert replaced.args.rope_scaling.type == "dynamic"  # the config's scaling replaces the file's
