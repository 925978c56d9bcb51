"""GLM-4 (``chatglm``: models/chatglm.py) and Phi-3 (``phi3``: models/phi3.py) against transformers' GlmForCausalLM
and Phi3ForCausalLM on the same weights: fused and separate q/k/v, the fused gate | up, partial RoPE over adjacent
pairs (GLM) and NEOX pairs (Phi-4-mini), LongRoPE's two factor sets chosen by the context; the native decode step
and a long-context preset on them."""

from __future__ import annotations

import pytest
import torch
from conftest import write_gguf
from test_long_context import full_budget
from test_moe import FP32_ATOL, FP32_RTOL, check_chunked_logits_match_hf, greedy_run, make_cache, prompt_ids
from tiny_glm_phi import GLM_PHI_SPECS, build_glm_phi, glm_phi_gguf_tensors, glm_phi_metadata

from ktquest.kv.long_context import LongContextCache
from ktquest.models.llama import TorchDecoder
from ktquest.models.loader import load_model
from ktquest.native.decode import NativeDecoder

ATOL = 2e-4  # fp32 against transformers' fp32: attention and the FFN summed in other orders


@pytest.fixture(scope="module")
def glm_phi_models(tmp_path_factory, tiny_bpe):
    """name -> (GGUF path, transformers model), each written once."""
    directory, made = tmp_path_factory.mktemp("glm_phi"), {}

    def get(name: str):
        if name not in made:
            spec = GLM_PHI_SPECS[name]
            hf = build_glm_phi(spec, len(tiny_bpe.tokens))
            path = write_gguf(directory / f"{name}.gguf", spec.arch, glm_phi_metadata(spec),
                              glm_phi_gguf_tensors(hf, spec), tiny_bpe)
            made[name] = (path, hf)
        return made[name]

    return get


@pytest.mark.parametrize("name", sorted(GLM_PHI_SPECS))
def test_blocks_from_the_file(glm_phi_models, name):
    spec = GLM_PHI_SPECS[name]
    model, _ = load_model(glm_phi_models(name)[0])
    a = model.args
    assert a.arch == spec.arch and a.head_dim == spec.hd and a.n_rot == spec.rope_dim
    assert all(b.fused_qkv == spec.fused_qkv and b.fused_gate_up and b.attention == "global" for b in a.blocks)
    assert all(b.qkv_bias == (spec.arch == "chatglm") for b in a.blocks)
    assert a.permuted_qk == (spec.arch == "chatglm")  # GLM rotates adjacent pairs
    assert (a.rope_scaling.type if a.rope_scaling else None) == ("longrope" if spec.original_ctx else None)


@pytest.mark.parametrize("encoded", [False, True], ids=["dequantized", "encoded"])
@pytest.mark.parametrize("name", sorted(GLM_PHI_SPECS))
def test_chunked_logits_match_transformers(glm_phi_models, name, encoded):
    """48 tokens prefilled in uneven chunks, then 8 decode steps, against one transformers forward (a cache of 64
    positions: Phi-3's short LongRoPE factors, as transformers takes them for 48 tokens)."""
    check_chunked_logits_match_hf(*glm_phi_models(name), encoded, tol=ATOL)


@pytest.mark.parametrize("name", sorted(GLM_PHI_SPECS))
def test_greedy_tokens_equal_transformers(glm_phi_models, name):
    """The engine's path: encoded weights, the native decode step (its fused q | k | v gathered into rotate-half
    order by the same permutation), greedy tokens equal transformers' generate (a cache of 64: the short
    LongRoPE factors, as transformers takes them for 32 tokens)."""
    path, hf = glm_phi_models(name)
    model, _ = load_model(path, max_seq_len=64, encoded=True)
    model.decoder = NativeDecoder.build(model, threads=2)
    prompt = prompt_ids(20, model.args.vocab_size, seed=5)
    with torch.inference_mode():
        expected = hf.generate(prompt[None], max_new_tokens=12, do_sample=False, min_new_tokens=12,
                               pad_token_id=0)[0, 20:].tolist()
    assert greedy_run(model, make_cache(model, 64), prompt, 12)[0] == expected


@pytest.mark.parametrize("name", ["phi3", "phi4_mini"])
def test_longrope_takes_the_long_factors_past_the_trained_context(glm_phi_models, name):
    """A prompt of 100 tokens, past the trained 64: transformers rotates it with the long factors, and so does a
    model whose cache holds 256 positions (llama.cpp's choice by the cache); a cache of 64 takes the short ones
    (the tables differ from position 1 on)."""
    path, hf = glm_phi_models(name)
    long_model, _ = load_model(path, max_seq_len=256)
    short_model, _ = load_model(path, max_seq_len=64)
    assert not torch.allclose(long_model.rope_cos[0, 1], short_model.rope_cos[0, 1])
    tokens = prompt_ids(100, long_model.args.vocab_size, seed=9)
    with torch.inference_mode():
        expected = hf(tokens[None]).logits[0]  # [100, V]
        cache = make_cache(long_model, 256)
        got = torch.cat([long_model(tokens[:61], 0, cache), long_model(tokens[61:], 61, cache)])
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=ATOL)


@pytest.mark.parametrize("name", ["chatglm", "phi4_mini"])
def test_quest_with_a_covering_budget_equals_dense(glm_phi_models, name):
    """The quest preset on every layer (its budget covering every block, fp32 K/V): the native decode step's
    greedy tokens and logits are a dense cache's, partial RoPE's gathered dims included."""
    model, _ = load_model(glm_phi_models(name)[0], encoded=True)
    model.decoder = NativeDecoder.build(model, threads=2)
    cfg = full_budget("quest", block_size=4, kv_type="FP32", anchor_num=2, dense_layer_num=0)
    prompt = torch.arange(3, 60) * 7 % 250
    tokens, logits = greedy_run(model, LongContextCache(model.args, cfg, 128), prompt, 8)
    model.decoder = TorchDecoder(model)
    ref_tokens, ref_logits = greedy_run(model, make_cache(model, 128), prompt, 8)
    assert tokens == ref_tokens
    torch.testing.assert_close(logits, ref_logits, atol=FP32_ATOL * 10, rtol=FP32_RTOL * 10)
