"""gemma3 against Hugging Face's Gemma3ForCausalLM on the same weights (QK-norm, sandwich norms, GeGLU, scaled
embeddings, sliding-window layers with their own RoPE), its cache (sliding windows + the global layers' dense
or long_context cache: ``ktquest/kv/sliding.py``), and the native decode step."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_long_context import full_budget
from test_model import FP32_ATOL, FP32_RTOL, prompt_ids

import ktquest
from ktquest.config import Config
from ktquest.engine import make_cache
from ktquest.generate import decode_one_token, prefill
from ktquest.kv import sliding
from ktquest.kv.sliding import HybridCache
from ktquest.models.llama import TorchDecoder
from ktquest.models.loader import load_model
from ktquest.native.decode import NativeDecoder, use_native_decode


def cache_for(model, cfg: Config = Config(chunk_size=16), max_seq_len: int = 128):
    return make_cache(cfg, model.args, max_seq_len, torch.device("cpu"), torch.float32)


def test_args_from_the_file(tiny_gemma3):
    model, _ = load_model(tiny_gemma3.path)
    a, cfg = model.args, tiny_gemma3.hf_model.config
    assert a.arch == "gemma3" and all(b.qk_norm and b.sandwich_norms and b.ffn == "geglu" for b in a.blocks)
    kinds = {"full_attention": "global", "sliding_attention": "sliding"}
    assert tuple(b.attention for b in a.blocks) == tuple(kinds[t] for t in cfg.layer_types)
    assert all(b.window == (cfg.sliding_window if b.attention == "sliding" else 0) for b in a.blocks)
    assert all(b.rope == (b.attention == "sliding") for b in a.blocks) and a.emb_scale == cfg.hidden_size ** 0.5
    assert (a.rope_theta, a.rope_theta_local) == (1e6, 10000.0)
    assert isinstance(cache_for(model), HybridCache)


@pytest.mark.parametrize("encoded", [False, True], ids=["fp32", "gguf"])
def test_logits_match_hf(tiny_gemma3, encoded):
    """Uneven prefill chunks longer and shorter than the window, then decode steps, vs one HF forward: every
    position's logits (the sliding layers' windows and RoPE, the global layers' whole past)."""
    path, hf = tiny_gemma3
    model, _ = load_model(path, encoded=encoded)
    use_native_decode(model, threads=2)  # the decode steps' native path when encoded
    tokens = prompt_ids(60, model.args.vocab_size)
    with torch.inference_mode():
        expected = hf(tokens[None]).logits[0]  # [60, V]
        cache = cache_for(model)
        got = [model(tokens[0:17], 0, cache), model(tokens[17:20], 17, cache), model(tokens[20:44], 20, cache)]
        got += [decode_one_token(model, cache, int(tokens[i]))[None] for i in range(44, 60)]
    tol = FP32_ATOL if not encoded else 2e-2  # encoded: the activations quantized for the GEMVs
    torch.testing.assert_close(torch.cat(got), expected, atol=tol, rtol=tol)


def test_native_decode_matches_the_torch_block(tiny_gemma3):
    """The native decode step (QK-norm, post-norms, GeGLU and each layer's RoPE table in cpp/decode/) gives
    the torch blocks' logits on the same encoded weights."""
    model, _ = load_model(tiny_gemma3.path, encoded=True)
    tokens = prompt_ids(50, model.args.vocab_size)
    runs = []
    for decoder in (TorchDecoder(model), NativeDecoder.build(model, threads=2)):
        model.decoder = decoder
        cache = cache_for(model)
        with torch.inference_mode():
            prefill(model, cache, tokens[:30], chunk_size=16)
            runs.append(torch.stack([decode_one_token(model, cache, int(tokens[i])) for i in range(30, 50)]))
    torch.testing.assert_close(runs[1], runs[0], atol=FP32_ATOL, rtol=FP32_RTOL)


@pytest.mark.parametrize("mode", ["dense", "quest", "snapkv"])
def test_a_planned_token_equals_the_block_by_block_one(tiny_gemma3, monkeypatch, mode):
    """Gemma 3 plans a native token like the others (HybridCache.plan_decode: the sliding layers' windows as
    dense layers, with table 1 of RoPE, beside the global layers' dense cache or store): its logits and the
    tokens after it are the block-by-block path's, also once the window buffer compacted."""
    from ktquest.kv import sliding
    from ktquest.native.plans import TokenPlan

    monkeypatch.setattr(sliding, "COMPACT_TOKENS", 4)
    ran = []
    run = TokenPlan.run
    monkeypatch.setattr(TokenPlan, "run", lambda plan, *args: (ran.append(plan), run(plan, *args))[1])
    model, _ = load_model(tiny_gemma3.path, encoded=True)
    native = NativeDecoder.build(model, threads=2)
    cfg = Config(chunk_size=16) if mode == "dense" else \
        dataclasses.replace(full_budget(mode, block_size=4, kv_type="FP32"), max_seq_len=128)
    cfg = dataclasses.replace(cfg, sliding_window_keep=1)  # (a chunk is kept: 16 positions past the window)
    prompt = prompt_ids(40, model.args.vocab_size, seed=3)
    runs = []
    for planned in (False, True):
        cache = cache_for(model, cfg)
        with torch.inference_mode():
            prefill(model, cache, prompt, 16)
            runs.append(torch.stack([native.decode(tok % model.args.vocab_size, cache, planned=planned)
                                     for tok in (5, 9, 11, 200, 7, 31, 2, 17, 23, 40, 1, 8)]))
        assert cache.pos == len(prompt) + 12 and min(cache.windows.base) > 0  # the buffers slid
    torch.testing.assert_close(runs[1], runs[0], atol=1e-4, rtol=1e-4)
    assert len(ran) == 12  # every token of the second run in one native call
    kinds = [layer[0] for layer in ran[-1].layers]
    sliding_layers = [b.attention == "sliding" for b in model.args.blocks]
    assert kinds == ["dense" if s or mode == "dense" else "store" for s in sliding_layers]


def test_a_plan_the_windows_refuse_is_aborted(tiny_gemma3, monkeypatch):
    """HybridCache.plan_decode begins the global cache's plan first: when the sliding windows then refuse the
    token, that plan is aborted (each plan is committed or aborted) and the cache stays as it was."""
    model, _ = load_model(tiny_gemma3.path, encoded=True)
    cfg = dataclasses.replace(full_budget("quest", block_size=4, kv_type="FP32"), max_seq_len=128)
    cache = cache_for(model, cfg)
    native = NativeDecoder.build(model, threads=1)
    with torch.inference_mode():
        prefill(model, cache, prompt_ids(30, model.args.vocab_size), 16)
        native.decode(5, cache)
    aborted = []
    abort = cache.main.abort_decode
    monkeypatch.setattr(cache.main, "abort_decode", lambda plan: (aborted.append(plan), abort(plan))[1])

    def refuse(pos):
        raise ValueError("refused")

    monkeypatch.setattr(cache.windows, "plan_decode", refuse)
    with pytest.raises(ValueError, match="refused"):
        cache.plan_decode(cache.pos)
    assert len(aborted) == 1 and aborted[0].pos == 31 and cache.pos == 31
    monkeypatch.undo()
    with torch.inference_mode():
        native.decode(7, cache)  # the next plan of the same token runs
    assert cache.pos == 32


@pytest.mark.parametrize("name", ["quest", "snapkv"])
def test_long_context_full_budget_equals_dense(tiny_gemma3, name):
    """long_context on the global layers with a budget covering every block = dense, past the windows."""
    model, _ = load_model(tiny_gemma3.path)
    cfg = dataclasses.replace(full_budget(name, block_size=4, kv_type="FP32"), max_seq_len=128)
    lcache, dcache = cache_for(model, cfg), cache_for(model)
    assert lcache.main.n_layers == len(model.args.global_layers)  # the store holds the global layers only
    prompt = prompt_ids(70, model.args.vocab_size, seed=2)
    torch.testing.assert_close(prefill(model, lcache, prompt, 16), prefill(model, dcache, prompt, 16),
                               atol=1e-4, rtol=1e-4)
    for tok in (5, 9, 11, 200, 7):
        torch.testing.assert_close(decode_one_token(model, lcache, tok), decode_one_token(model, dcache, tok),
                                   atol=1e-4, rtol=1e-4)


def test_window_buffer_slides_and_rewinds(tiny_models, monkeypatch):
    """Past the buffer's rows the oldest positions make way; a rewind within the kept positions is exact (the
    logits of the same tokens again), one further back is refused and ``rewind_point`` says 0."""
    monkeypatch.setattr(sliding, "COMPACT_TOKENS", 4)
    model, _ = load_model(tiny_models("gemma3").path)
    tokens = prompt_ids(100, model.args.vocab_size, seed=4)
    cache = cache_for(model, Config(chunk_size=8, sliding_window_keep=8))
    w = cache.windows
    assert w.rows == w.window - 1 + 8 + 4 and w.window == model.args.blocks[0].window  # 19 rows for 100 positions
    with torch.inference_mode():
        ref = [model(tokens[:1], 0, cache)] + [decode_one_token(model, cache, int(t))[None] for t in tokens[1:]]
    assert w.base[0] > 0 and cache.pos == 100
    assert cache.rewind_point(95) == 95 and cache.rewind_point(80) == 0
    cache.truncate(95)
    with torch.inference_mode():
        again = [model(tokens[95:97], 95, cache)] + [decode_one_token(model, cache, int(t))[None]
                                                     for t in tokens[97:]]
    torch.testing.assert_close(torch.cat(again), torch.cat(ref)[95:], atol=FP32_ATOL, rtol=FP32_RTOL)
    with pytest.raises(ValueError, match="no longer hold positions"):
        cache.truncate(80)
    assert cache.pos == 100  # refused: nothing changed


@pytest.mark.parametrize("rewind", [8, 1024])
def test_chat_turns_equal_fresh_reads(tiny_models, monkeypatch, rewind):
    """A second chat turn keeps the common prefix (or starts over where the windows no longer reach back to
    it) and answers as a cache that reads the whole conversation afresh does."""
    monkeypatch.setattr(sliding, "COMPACT_TOKENS", 4)
    path = tiny_models("gemma3").path
    sets = dict(threads=1, max_new_tokens=12, temperature=0.0, max_seq_len=256, chunk_size=8,
                sliding_window_keep=rewind)
    kept, fresh = ktquest.load(path, **sets), ktquest.load(path, **sets)
    turns = ["the cat sat on the mat; the dog sat on the log.", "Hello world! The capital", "Once upon a time"]
    a, b = kept.chat_session(), fresh.chat_session()
    for text in turns:
        fresh.cache.reset()  # b reads the whole conversation again each turn
        assert a.send(text).text == b.send(text).text
        assert kept.cache.pos == fresh.cache.pos
    # a new conversation: its first turn shares only the template's opening with the cache
    a.reset(keep_cache=True)
    fresh.cache.reset()
    b.reset()
    ra, rb = a.send(turns[0]), b.send(turns[0])
    assert ra.text == rb.text
    # the windows reached back to the opening only with the longer buffer; otherwise all was read again
    assert (ra.stats.prompt_tokens < rb.stats.prompt_tokens) == (rewind > 8)


def test_bad_files_and_layers_are_refused(tiny_models, tiny_bpe, tmp_path):
    """A gemma3 file without its sliding window or a sandwich norm is a GGUFError naming it; the native layer
    checks the shapes of its optional norms and its activation at the C++ boundary."""
    import numpy as np
    from conftest import GEMMA3_SPECS, gguf_metadata, hf_to_gguf_tensors, write_gguf

    from ktquest import _C
    from ktquest.formats.gguf import GGUFError

    spec, hf = GEMMA3_SPECS["gemma3"], tiny_models("gemma3").hf_model
    md, tensors = gguf_metadata(spec, len(tiny_bpe.tokens)), hf_to_gguf_tensors(hf, spec)
    del md["gemma3.attention.sliding_window"]
    with pytest.raises(GGUFError, match="gemma3.attention.sliding_window"):
        load_model(write_gguf(tmp_path / "a.gguf", "gemma3", md, tensors, tiny_bpe))
    md, tensors = gguf_metadata(spec, len(tiny_bpe.tokens)), hf_to_gguf_tensors(hf, spec)
    del tensors["blk.3.post_ffw_norm.weight"]
    with pytest.raises(GGUFError, match="missing tensor 'blk.3.post_ffw_norm.weight'"):
        load_model(write_gguf(tmp_path / "b.gguf", "gemma3", md, tensors, tiny_bpe))

    model, _ = load_model(tiny_models("gemma3").path, encoded=True)
    b, a = model.layers[0], model.args
    packs = [m.qm for m in (b.attn.wqkv, b.attn.wo, b.ffn.w_gate_up, b.ffn.w_down)]
    norm = b.attn_norm.weight.numpy()
    args = (norm, norm, 1e-6, *packs, a.n_heads, a.n_kv_heads, a.head_dim)
    with pytest.raises(ValueError, match=rf"q_norm: expected shape \[{a.head_dim}\]"):
        _C.DecodeLayer(*args, q_norm=norm)
    with pytest.raises(ValueError, match=rf"post_ffn_norm: expected shape \[{a.dim}\]"):
        _C.DecodeLayer(*args, post_ffn_norm=np.ones(a.head_dim, np.float32))
    with pytest.raises(ValueError, match="ffn='relu' is not allowed"):
        _C.DecodeLayer(*args, ffn="relu")


# ---- the bundled Gemma 3 270M ----


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["dense", "long_context"])
def test_bundled_gemma3_golden(bundled_gemma3, mode):
    """The bundled Gemma 3 270M base: its shape from the file, a fixed greedy completion, and a pass key ~1,000
    tokens before the question (twice the sliding window back: only the global layers reach it)."""
    from ktquest.eval.tasks import FILLER

    eng = ktquest.load(bundled_gemma3, threads=2, max_new_tokens=12, temperature=0.0, max_seq_len=2048, mode=mode)
    a = eng.args
    assert (a.arch, a.n_layers, a.dim, a.n_heads, a.n_kv_heads, a.head_dim, a.ffn_dim, a.vocab_size) == \
        ("gemma3", 18, 640, 4, 1, 256, 2048, 262144)
    assert (a.blocks[0].window, a.global_layers, a.rope_theta, a.context_length) == (512, (5, 11, 17), 1e6, 32768)
    assert eng.tokenizer.chat_template is None
    assert eng.generate("The capital of France is") == " the capital of the country of France. It is the largest"
    units = [FILLER[i % len(FILLER)] for i in range(260)]
    doc = " ".join(units[:40] + ["The pass key is 748213. Remember it. 748213 is the pass key."] + units[40:])
    prompt = doc + "\n\nWhat is the pass key? The pass key is"
    assert 1200 < len(eng.tokenizer.encode(prompt)) < 1400
    assert eng.generate(prompt).startswith(" 748213.")
