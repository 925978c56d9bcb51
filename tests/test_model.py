"""The model against an independent reference (HF transformers on the same weights), and the KV cache's
attention against a naive softmax(QK^T)V."""

from __future__ import annotations

import math

import pytest
import torch

from ktquest.generate import decode_one_token, prefill
from ktquest.kv.dense import DenseKVCache
from ktquest.models.llama import TorchDecoder
from ktquest.models.loader import load_model
from ktquest.native.decode import NativeDecoder

FP32_ATOL = 1e-4
FP32_RTOL = 1e-4
TOLERANCES = {torch.float16: (5e-2, 1e-2), torch.bfloat16: (2.5e-1, 5e-2)}  # (atol, rtol) on logits ~ +-5


def make_cache(model, max_seq_len: int) -> DenseKVCache:
    a = model.args
    return DenseKVCache(a.n_layers, a.n_kv_heads, a.head_dim, max_seq_len)


def prompt_ids(n: int, vocab: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))


# ---- reference: naive causal GQA attention ----


def ref_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start_pos: int) -> torch.Tensor:
    """q: [T, H, D] at positions start_pos.., k/v: [S, KVH, D] at 0..S-1 -> [T, H, D]."""
    t, h, d = q.shape
    group = h // k.shape[1]
    k = k.repeat_interleave(group, dim=1)  # [S, H, D]
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("thd,shd->hts", q, k) / math.sqrt(d)  # [H, T, S]
    qpos = torch.arange(start_pos, start_pos + t)[:, None]
    kpos = torch.arange(k.shape[0])[None, :]
    scores = scores.masked_fill(kpos > qpos, float("-inf"))
    return torch.einsum("hts,shd->thd", scores.softmax(-1), v)


@pytest.mark.parametrize("chunks", [[1], [7], [5, 1, 1, 9], [19, 7, 129], [1, 64]])
@pytest.mark.parametrize("heads", [(4, 2), (3, 3), (6, 1)])
def test_dense_cache_attend_matches_reference(chunks, heads):
    h, kvh = heads
    d, n_layers = 16, 2
    total = sum(chunks)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(total, h, d, generator=g)
    k = torch.randn(total, kvh, d, generator=g)
    v = torch.randn(total, kvh, d, generator=g)
    cache = DenseKVCache(n_layers, kvh, d, max_seq_len=total + 3)
    pos = 0
    for t in chunks:
        for layer in range(n_layers):
            out = cache.attend(layer, q[pos:pos + t], k[pos:pos + t], v[pos:pos + t], pos)
            expected = ref_attention(q[pos:pos + t], k[:pos + t], v[:pos + t], pos)
            torch.testing.assert_close(out, expected, atol=FP32_ATOL, rtol=FP32_RTOL)
        pos += t
        assert cache.pos == pos


def test_cache_accepts_non_contiguous_views():
    cache = DenseKVCache(1, 2, 8, 16)
    qkv = torch.randn(5, 4 + 2 + 2, 8)  # a fused projection's output, sliced like Attention does
    q, k, v = qkv[:, :4], qkv[:, 4:6], qkv[:, 6:]
    torch.testing.assert_close(cache.attend(0, q, k, v, 0), ref_attention(q, k, v, 0), atol=FP32_ATOL,
                               rtol=FP32_RTOL)


# ---- the model vs Hugging Face transformers ----


def test_qwen3_blocks_from_the_file(tiny_models):
    """qwen3 (models/qwen3.py): every block has QK-norm and no biases; head_dim is the file's key_length, not
    dim / n_heads; q/k rows are in order (no qk permutation)."""
    model, _ = load_model(tiny_models("qwen3").path)
    a = model.args
    assert a.arch == "qwen3" and a.head_dim == 32 and a.dim // a.n_heads == 16 and not a.permuted_qk
    assert all(b.qk_norm and not b.qkv_bias and not b.sandwich_norms and b.attention == "global" and
               b.ffn == "swiglu" for b in a.blocks)
    assert model.layers[0].attn.q_norm is not None and model.layers[0].attn.wqkv.bias is None


def test_logits_match_hf(tiny_model):
    """Prefill in uneven chunks with every position's logits, then decode steps, vs one HF forward. The
    model is built for the cache's 64 tokens (LongRoPE picks its factors by it, HF by the 48 it sees)."""
    path, hf = tiny_model
    model, _ = load_model(path, max_seq_len=64)
    tokens = prompt_ids(48, model.args.vocab_size)
    with torch.inference_mode():
        expected = hf(tokens[None]).logits[0]  # [48, V]
        cache = make_cache(model, 64)
        got = [model(tokens[0:17], 0, cache), model(tokens[17:24], 17, cache),
               model(tokens[24:40], 24, cache)]
        got += [model(tokens[i:i + 1], i, cache) for i in range(40, 48)]  # decode, one token at a time
    torch.testing.assert_close(torch.cat(got), expected, atol=FP32_ATOL, rtol=FP32_RTOL)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_half_precision_close_to_hf(tiny_models, name, dtype):
    path, hf = tiny_models(name)
    model, _ = load_model(path, dtype=dtype)
    a = model.args
    tokens = prompt_ids(40, a.vocab_size)
    with torch.inference_mode():
        expected = hf(tokens[None]).logits[0]
        cache = DenseKVCache(a.n_layers, a.n_kv_heads, a.head_dim, 48, dtype=dtype)
        got = [model(tokens[:30], 0, cache)] + [model(tokens[i:i + 1], i, cache) for i in range(30, 40)]
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(torch.cat(got).float(), expected, atol=atol, rtol=rtol)


@pytest.mark.parametrize("name", ["llama", "qwen2", "internlm2"])
def test_long_positions_match_hf(tiny_models, name):
    """Positions near the end of the trained context (RoPE tables far out), prefill chunk after a past."""
    path, hf = tiny_models(name)
    model, _ = load_model(path)
    n = model.args.context_length
    tokens = prompt_ids(n, model.args.vocab_size, seed=3)
    with torch.inference_mode():
        expected = hf(tokens[None]).logits[0, -8:]
        cache = make_cache(model, n)
        prefill(model, cache, tokens[:-8], chunk_size=100)
        got = model(tokens[-8:], n - 8, cache)
    torch.testing.assert_close(got, expected, atol=FP32_ATOL, rtol=FP32_RTOL)


@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_chunk_size_does_not_change_logits(tiny_models, name):
    model, _ = load_model(tiny_models(name).path)
    tokens = prompt_ids(30, model.args.vocab_size)
    results = []
    for chunk in (1, 7, 30):
        cache = make_cache(model, 40)
        last = prefill(model, cache, tokens, chunk_size=chunk)
        assert cache.pos == 30
        with torch.inference_mode():
            nxt = model(tokens[:1], 30, cache)[0]  # one decode step reads the whole cache
        results.append((last, nxt, torch.stack([cache.layer_kv(i)[0][:, :31] for i in range(cache.n_layers)])))
    for last, nxt, keys in results[1:]:
        torch.testing.assert_close(last, results[0][0], atol=FP32_ATOL, rtol=FP32_RTOL)
        torch.testing.assert_close(nxt, results[0][1], atol=FP32_ATOL, rtol=FP32_RTOL)
        torch.testing.assert_close(keys, results[0][2], atol=FP32_ATOL, rtol=FP32_RTOL)


def test_last_only_is_the_last_row(tiny_llama):
    model, _ = load_model(tiny_llama.path)
    tokens = prompt_ids(12, model.args.vocab_size)
    with torch.inference_mode():
        full = model(tokens, 0, make_cache(model, 16))
        last = model(tokens, 0, make_cache(model, 16), last_only=True)
    assert last.shape == (1, model.args.vocab_size)
    torch.testing.assert_close(last[0], full[-1], atol=FP32_ATOL, rtol=FP32_RTOL)


def test_tied_embeddings_share_storage(tiny_models):
    tied, _ = load_model(tiny_models("llama_tied").path)
    assert tied.tok_embeddings.weight.data_ptr() == tied.output.weight.data_ptr()
    untied, _ = load_model(tiny_models("llama").path)
    assert untied.tok_embeddings.weight.data_ptr() != untied.output.weight.data_ptr()
    tied, _ = load_model(tiny_models("llama_tied").path, encoded=True)  # one mapping of the file's table
    assert tied.tok_embeddings.quant is tied.output.quant is not None


def test_positions_past_the_rope_tables_raise(tiny_llama):
    model, _ = load_model(tiny_llama.path)
    n = model.args.context_length
    with pytest.raises(ValueError, match=f"max_seq_len {n}"), torch.inference_mode():
        model(torch.zeros(2, dtype=torch.long), n - 1, make_cache(model, n + 4))
    longer, _ = load_model(tiny_llama.path, max_seq_len=n + 4)  # RoPE tables beyond the trained context
    cache = make_cache(model, n + 4)
    prefill(longer, cache, [0] * (n - 1), chunk_size=128)
    with torch.inference_mode():
        assert torch.isfinite(longer(torch.zeros(2, dtype=torch.long), n - 1, cache)).all()


# ---- the bundled model ----


@pytest.mark.slow
def test_bundled_model_greedy_next_token(bundled_gguf):
    model, contents = load_model(bundled_gguf)
    a = contents.args
    assert (a.arch, a.n_layers, a.dim, a.n_heads, a.n_kv_heads, a.head_dim, a.ffn_dim, a.vocab_size) == \
        ("llama", 30, 576, 9, 3, 64, 1536, 49152)
    assert (a.rope_theta, a.context_length, a.tie_embeddings, a.blocks[0].qkv_bias) == (100000.0, 8192, True, False)
    # "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n", as ids.
    ids = [1, 4093, 198, 1780, 314, 260, 3575, 282, 4649, 47, 2, 198, 1, 520, 9531, 198]
    picks = []
    for _ in range(2):
        logits = prefill(model, make_cache(model, 64), ids, chunk_size=5)
        assert logits.shape == (49152,) and torch.isfinite(logits).all()
        picks.append(int(logits.argmax()))
    assert picks[0] == picks[1]


# ---- the native decode step (ktquest/native/decode.py, cpp/decode/) ----


def test_native_decode_matches_the_torch_block(tiny_model):
    """The native decode step (the blocks' native stages around the cache's attention, native RMSNorm and LM
    head GEMV) gives the logits of the torch ops on the same encoded weights (every tiny model: biases, tied
    embeddings, each RoPE scaling), over decode steps after a chunked prefill."""
    path, _ = tiny_model
    model, _ = load_model(path, encoded=True)
    tokens = prompt_ids(40, model.args.vocab_size)
    runs = []
    for decoder in (TorchDecoder(model), NativeDecoder.build(model, threads=2)):
        model.decoder = decoder
        cache = make_cache(model, 64)
        with torch.inference_mode():
            prefill(model, cache, tokens[:30], chunk_size=16)
            runs.append(torch.stack([decode_one_token(model, cache, int(tokens[i])) for i in range(30, 40)]))
    model.decoder = TorchDecoder(model)
    # fp32 throughout; the native RMSNorm sums in double and the RoPE/SwiGLU loops round in another order.
    torch.testing.assert_close(runs[1], runs[0], atol=FP32_ATOL, rtol=FP32_RTOL)


def test_native_decode_refuses_bad_tokens_and_positions(tiny_llama):
    model, _ = load_model(tiny_llama.path, max_seq_len=4)
    assert NativeDecoder.build(model, threads=1) is None  # dequantized weights: decode_one_token takes forward()
    model, _ = load_model(tiny_llama.path, max_seq_len=4, encoded=True)
    nat = NativeDecoder.build(model, threads=1)
    cache = make_cache(model, 8)
    V = model.args.vocab_size
    with pytest.raises(IndexError, match=f"token id {V} is outside the vocabulary"):
        nat.decode(V, cache)
    with pytest.raises(IndexError, match="token id -1"):
        nat.decode(-1, cache)
    assert cache.pos == 0
    assert nat.decode(1, cache).shape == (V,) and cache.pos == 1
    for t in range(3):
        nat.decode(t, cache)
    with pytest.raises(ValueError, match="rope tables"):  # position 4 of a model built for 4
        nat.decode(1, cache)
    assert cache.pos == 4


def test_native_decode_needs_every_weight_encoded(tiny_llama):
    from ktquest.layers.linear import Linear

    model, _ = load_model(tiny_llama.path, encoded=True)
    assert NativeDecoder.build(model, threads=1) is not None
    down = model.layers[1].ffn.w_down
    model.layers[1].ffn.w_down = Linear(torch.from_numpy(down.quant.dequantize()))
    assert NativeDecoder.build(model, threads=1) is None


def test_native_decode_layer_checks_its_arguments(tiny_llama):
    import numpy as np

    from ktquest import _C

    model, _ = load_model(tiny_llama.path, encoded=True)
    layer = NativeDecoder.build(model, threads=1).blocks[0]
    block = model.layers[0]
    a = block.attn
    dim = model.args.dim
    with pytest.raises(ValueError, match=r"x: expected shape \[" + str(dim)):
        layer.qkv(np.zeros(dim + 1, np.float32), np.zeros(a.head_dim, np.float32),
                  np.zeros(a.head_dim, np.float32), np.zeros((a.n_heads + 2 * a.n_kv_heads) * a.head_dim,
                                                             np.float32), 1)
    with pytest.raises(ValueError, match="n_threads"):
        layer.out(np.zeros(a.n_heads * a.head_dim, np.float32), np.zeros(dim, np.float32), 0)
    packs = [m.qm for m in (a.wqkv, a.wo, block.ffn.w_gate_up, block.ffn.w_down)]
    norm = block.attn_norm.weight.numpy()
    with pytest.raises(ValueError, match=r"wo: expected \["):  # wqkv where wo belongs
        _C.DecodeLayer(norm, norm, 1e-5, packs[0], packs[0], packs[2], packs[3], a.n_heads, a.n_kv_heads, a.head_dim)
    with pytest.raises(ValueError, match="multiple of n_kv_heads"):
        _C.DecodeLayer(norm, norm, 1e-5, *packs, a.n_heads + 1, a.n_kv_heads, a.head_dim)


def test_native_rms_norm_matches_torch():
    import numpy as np

    from ktquest import _C

    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(576, generator=g) * 3, torch.randn(576, generator=g)
    ref = torch.nn.functional.rms_norm(x.double(), (576,), w.double(), 1e-5).float()  # torch reference
    out = np.empty(576, np.float32)
    _C.rms_norm(x.numpy(), w.numpy(), 1e-5, out)
    torch.testing.assert_close(torch.from_numpy(out), ref, atol=1e-6, rtol=1e-5)
    with pytest.raises(ValueError, match=r"w: expected shape \[576\]"):
        _C.rms_norm(x.numpy(), w[:5].numpy(), 1e-5, out)
    with pytest.raises(TypeError, match="out: expected a numpy array of dtype float32"):
        _C.rms_norm(x.numpy(), w.numpy(), 1e-5, out.astype(np.float64))
