"""The internlm2 arch (InternLM2 / InternLM2.5) against its own modeling code (``tiny_internlm2``): the file
as llama.cpp's converter writes it (fused wqkv split, Q/K rows permuted, llama's tensor names), dense and
long-context attention, and the dynamic NTK RoPE of InternLM2.5's long-context models from the config.

The dense logits of every prefill/decode pattern are in ``test_model.test_logits_match_hf`` (the
``internlm2`` tiny model is one of its ``TINY_SPECS``).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import TINY_SPECS, build_hf_model
from test_model import FP32_ATOL, FP32_RTOL, make_cache, prompt_ids

from ktquest.config import Config, LongContextConfig
from ktquest.kv.long_context import LongContextCache
from ktquest.models.args import RopeScaling
from ktquest.models.loader import load_model, qk_perm, read_gguf


def test_internlm2_args_and_layout(tiny_models):
    c = read_gguf(tiny_models("internlm2").path)
    a, spec = c.args, TINY_SPECS["internlm2"]
    assert (a.arch, a.n_layers, a.dim, a.n_heads, a.n_kv_heads, a.head_dim, a.ffn_dim, a.context_length) == \
        ("internlm2", spec.n_layers, spec.dim, spec.n_heads, spec.n_kv_heads, spec.dim // spec.n_heads,
         spec.ffn, spec.ctx)
    assert (a.rope_scaling, a.blocks[0].qkv_bias, a.tie_embeddings, a.permuted_qk) == (None, False, False, True)
    assert c.metadata["general.architecture"] == "internlm2" and "internlm2.vocab_size" not in c.metadata
    assert qk_perm(a) is not None  # Q/K rows interleaved by the converter, as llama's


def test_long_context_full_budget_matches_the_reference(tiny_models):
    """A long-context cache whose budget covers every block (blocks of 4, a prompt of 15 blocks, most of them
    behind the windows) gives the reference's logits, in prefill chunks and decode steps."""
    path, ref = tiny_models("internlm2")
    model, _ = load_model(path, max_seq_len=128)
    lc = LongContextConfig(block_size=4, init_windows_len=4, local_windows_len=8, second_select_num=1000,
                           kv_type="FP32")
    cache = LongContextCache(model.args, Config(mode="long_context", chunk_size=16, max_seq_len=128,
                                                long_context=lc), 128)
    tokens = prompt_ids(70, model.args.vocab_size, seed=5)
    with torch.inference_mode():
        expected = ref(tokens[None]).logits[0]  # [70, V]
        got = [model(tokens[a:b], a, cache) for a, b in ((0, 16), (16, 32), (32, 48), (48, 60))]
        got += [model(tokens[i:i + 1], i, cache) for i in range(60, 70)]  # decode: the selection's path
    torch.testing.assert_close(torch.cat(got), expected, atol=FP32_ATOL, rtol=FP32_RTOL)


@pytest.mark.parametrize("factor", [1.0, 2.5])
def test_dynamic_ntk_matches_internlm2_rotary(tiny_models, tiny_bpe, factor):
    """InternLM2.5's long-context models use dynamic NTK (rope_scaling type "dynamic" in their config; not in
    the GGUF): the config's ``rope_scaling: dynamic`` for a cache of L > the trained context equals
    InternLM2's DynamicNTKScalingRotaryEmbedding over a sequence of L tokens."""
    spec = TINY_SPECS["internlm2"]
    n = spec.ctx + 44
    ref = build_hf_model(dataclasses.replace(spec, rope={"rope_type": "dynamic", "factor": factor}),
                         len(tiny_bpe.tokens))  # the file's weights: they do not depend on the rope
    model, _ = load_model(tiny_models("internlm2").path, max_seq_len=n,
                          rope_scaling=RopeScaling(type="dynamic", factor=factor))
    tokens = prompt_ids(n, model.args.vocab_size, seed=6)
    with torch.inference_mode():
        expected = ref(tokens[None]).logits[0]
        got = model(tokens, 0, make_cache(model, n))
    torch.testing.assert_close(got, expected, atol=FP32_ATOL, rtol=FP32_RTOL)
