"""The internlm2 arch (InternLM2 / InternLM2.5) against its own modeling code (``tiny_internlm2``): the file
as llama.cpp's converter writes it (fused wqkv split, Q/K rows permuted, llama's tensor names), dense and
long-context attention.

The dense logits of every prefill/decode pattern are in ``test_model.test_logits_match_hf`` (the
``internlm2`` tiny model is one of its ``TINY_SPECS``).
"""

from __future__ import annotations

import torch
from conftest import TINY_SPECS
from test_model import FP32_ATOL, FP32_RTOL, prompt_ids

from ktquest.config import Config, LongContextConfig
from ktquest.kv.long_context import LongContextCache
from ktquest.models.loader import load_model, qk_perm, read_gguf


def test_internlm2_args_and_layout(tiny_models):
    c = read_gguf(tiny_models("internlm2").path)
    a, spec = c.args, TINY_SPECS["internlm2"]
    assert (a.arch, a.n_layers, a.dim, a.n_heads, a.n_kv_heads, a.head_dim, a.ffn_dim, a.context_length) == \
        ("internlm2", spec.n_layers, spec.dim, spec.n_heads, spec.n_kv_heads, spec.dim // spec.n_heads,
         spec.ffn, spec.ctx)
    assert (a.rope_scaling, a.qkv_bias, a.tie_embeddings) == (None, False, False)
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
