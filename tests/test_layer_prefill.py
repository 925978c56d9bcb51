"""Layer-major prefill (``prefill.order: layer``): attention with its LSE against a softmax reference; the same
logits, cache contents and greedy tokens as chunk-major prefill (dense, long_context with each preset's store
and selection, gemma3's hybrid cache; one prompt, a second turn after it, slabs); the device workspace it
reports and frees; a prompt stopped part-way leaves the cache as it was; the config's refusals."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
import torch

from ktquest.config import ConfigError, load_config
from ktquest.engine import make_cache
from ktquest.generate import decode_one_token, prefill
from ktquest.kv import attention, sliding
from ktquest.kv.attention import attention_lse
from ktquest.kv.long_context import LongContextCache
from ktquest.kv.sliding import HybridCache
from ktquest.models.loader import load_model

CONFIGS = Path(__file__).resolve().parent.parent / "configs"


def reference(q, k, v, scale, causal):
    """softmax(q k^T scale) v and its logsumexp, in float64: q [B, M, D], k/v [B, S, D]."""
    s = torch.einsum("bmd,bsd->bms", q.double(), k.double()) * scale
    if causal:
        s = s.masked_fill(torch.ones(q.shape[1], k.shape[1], dtype=torch.bool).triu(1), float("-inf"))
    return torch.einsum("bms,bsd->bmd", s.softmax(-1), v.double()), torch.logsumexp(s, -1)


# ---- attention_lse ----


@pytest.mark.parametrize("portable", [False, True], ids=["cpu-flash", "tiled"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("M,S", [(1, 1), (7, 19), (19, 19), (33, 129), (129, 129)])
def test_attention_lse_matches_softmax(monkeypatch, portable, causal, M, S):
    if causal and M != S:
        S = M
    g = torch.Generator().manual_seed(M * 1000 + S)
    q, k, v = (torch.randn(3, n, 16, generator=g) for n in (M, S, S))
    if portable:  # the path every device but the CPU in fp32 takes, in tiles smaller than the keys
        monkeypatch.setattr(attention, "FLASH_CPU", None)
        monkeypatch.setattr(attention, "LSE_TILE", 8)
    out, lse = attention_lse(q, k, v, 0.25, causal)
    ref_out, ref_lse = reference(q, k, v, 0.25, causal)
    torch.testing.assert_close(out.double(), ref_out, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(lse.double(), ref_lse, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("dtype,tol", [(torch.float16, 2e-3), (torch.bfloat16, 1.6e-2)])
def test_attention_lse_in_half_precision_from_strided_views(monkeypatch, dtype, tol):
    """The tiled path in the GPU's dtypes, on the views the layer-major read passes (a transposed q, the
    workspace's first rows): fp32 accumulation, so only the inputs' rounding shows."""
    monkeypatch.setattr(attention, "LSE_TILE", 16)
    g = torch.Generator().manual_seed(7)
    q = torch.randn(37, 4, 32, generator=g).to(dtype).transpose(0, 1)  # [4, 37, 32], strided
    kv = torch.randn(4, 2, 100, 32, generator=g).to(dtype)
    k, v = kv[:, 0, :61], kv[:, 1, :61]  # [4, 61, 32] views
    out, lse = attention_lse(q, k, v, 32 ** -0.5)
    assert out.dtype == lse.dtype == torch.float32
    ref_out, ref_lse = reference(q, k, v, 32 ** -0.5, False)
    torch.testing.assert_close(out.double(), ref_out, atol=tol, rtol=tol)
    torch.testing.assert_close(lse.double(), ref_lse, atol=tol, rtol=tol)


def test_attention_lse_causal_needs_a_square():
    q = torch.zeros(1, 4, 8)
    with pytest.raises(ValueError, match="causal needs as many queries as keys"):
        attention_lse(q, torch.zeros(1, 5, 8), torch.zeros(1, 5, 8), 1.0, causal=True)


def test_flash_splits_follows_pytorchs_heuristic():
    """The vectorized maximum against the heuristic, key length by key length."""
    def heuristic(bnm, sms2, nb, max_splits=128):  # flash_api.cpp's num_splits_heuristic
        if bnm >= 0.8 * sms2:
            return 1
        max_splits = min(max_splits, sms2, nb)
        eligible = [s == 1 or -(-nb // s) != -(-nb // (s - 1)) for s in range(1, max_splits + 1)]
        eff = [(bnm * s / sms2) / math.ceil(bnm * s / sms2) if e else 0.0
               for s, e in zip(range(1, max_splits + 1), eligible)]
        for s in range(1, max_splits + 1):
            if eligible[s - 1] and eff[s - 1] >= 0.85 * max(eff):
                return s
        return 1

    for heads, m_blocks, n_blocks, sms2 in [(2, 6, 300, 264), (1, 3, 40, 264), (12, 8, 4, 216), (3, 20, 129, 264)]:
        want = tuple(max(heuristic(heads * m, sms2, nb) for nb in range(1, n_blocks + 1))
                     for m in range(1, m_blocks + 1))
        assert attention.flash_splits(heads, m_blocks, n_blocks, sms2) == want


# ---- chunk-major == layer-major ----


def small_long_context(name: str, kv_type: str = "FP32", **prefill_keys):
    """A preset with windows and blocks small enough that the tiny prompts have context blocks."""
    over = [("long_context.block_size", 4), ("long_context.init_windows_len", 5),
            ("long_context.local_windows_len", 12), ("long_context.kv_type", kv_type), ("chunk_size", 16),
            ("max_seq_len", 256)] + [(f"prefill.{k}", v) for k, v in prefill_keys.items()]
    return load_config(CONFIGS / f"{name}.yaml", over)


def dense_config(**prefill_keys):
    return load_config(None, [("chunk_size", 16), ("max_seq_len", 256)] +
                       [(f"prefill.{k}", v) for k, v in prefill_keys.items()])


def read_turns(model, cfg, turns, order, slab=0, n_decode=6):
    """Prefill each token list of ``turns`` in turn (the ``order`` given), then decode greedily: the logits of
    every prompt's end, the greedy tokens and the cache."""
    cache = make_cache(cfg, model.args, 256, torch.device("cpu"), torch.float32)
    logits = [prefill(model, cache, t, cfg.chunk_size, order=order, slab_tokens=slab) for t in turns]
    tok, out = int(logits[-1].argmax()), []
    for _ in range(n_decode):
        out.append(tok)
        tok = int(decode_one_token(model, cache, tok).argmax())
    return logits, out, cache


def prompt(n: int, seed: int = 0, vocab: int = 200) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n,), generator=g).tolist()


TURNS = {"one prompt": [prompt(87)], "two turns": [prompt(61), prompt(37, seed=1)],
         "a chunk and one token": [prompt(81), prompt(17, seed=4)],  # a last chunk of one: still the prompt
         "short second turn": [prompt(70), prompt(2, seed=2)], "into the init window": [prompt(3), prompt(50, seed=3)]}


def assert_same_store(a: LongContextCache, b: LongContextCache) -> None:
    assert a.pos == b.pos
    for layer in range(a.n_layers):
        assert a.store.length(layer) == b.store.length(layer) == a.pos
        ka, va = a.store.read_range(layer, 0, a.pos)
        kb, vb = b.store.read_range(layer, 0, b.pos)
        torch.testing.assert_close(ka, kb, atol=2e-5, rtol=1e-5)
        torch.testing.assert_close(va, vb, atol=2e-5, rtol=1e-5)
    # The device windows: the init window's rows, and the local window's positions (which rows hold them
    # depends on when each cache compacted its buffer)
    init, lo = min(a.init_end, a.pos), max(a.windows.local_start(a.pos), a.init_end)
    for wa, wb in ((a.windows.k, b.windows.k), (a.windows.v, b.windows.v)):
        torch.testing.assert_close(wa[:, :, :init], wb[:, :, :init], atol=2e-5, rtol=1e-5)
        if a.pos > lo:
            ra, rb = a.windows.row(lo), b.windows.row(lo)
            torch.testing.assert_close(wa[:, :, ra: ra + a.pos - lo], wb[:, :, rb: rb + a.pos - lo], atol=2e-5,
                                       rtol=1e-5)
    span = a.planner.q_win_span
    assert span == b.planner.q_win_span
    n = span[1] - span[0]
    W = a.planner.q_win.shape[1]
    torch.testing.assert_close(a.planner.q_win[:, W - n:], b.planner.q_win[:, W - n:], atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("turns", list(TURNS), ids=list(TURNS))
@pytest.mark.parametrize("name", ["dense", "quest", "snapkv", "ada_quest"])
def test_layer_order_equals_chunk_order(tiny_llama, name, turns):
    model, _ = load_model(tiny_llama.path)
    cfg = dense_config() if name == "dense" else small_long_context(name)
    lc, oc, cc = read_turns(model, cfg, TURNS[turns], "chunk")
    ll, ol, cl = read_turns(model, cfg, TURNS[turns], "layer")
    for a, b in zip(lc, ll):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    assert oc == ol
    if name != "dense":
        assert_same_store(cc, cl)
        assert cc.planner.decode_step == cl.planner.decode_step


@pytest.mark.parametrize("order", ["chunk", "layer"])
def test_a_prompt_after_a_truncation_inside_the_local_window(tiny_llama, order):
    """Truncated to a point the local window still holds, but whose own local window starts before the
    buffer's: the positions between come back from the store, and the next prompt sees every one of them."""
    model, _ = load_model(tiny_llama.path)
    cfg = small_long_context("quest")
    first, second = prompt(90), prompt(3, seed=6)  # short: its local window reaches back before buf0
    cache = make_cache(cfg, model.args, 256, torch.device("cpu"), torch.float32)
    prefill(model, cache, first, cfg.chunk_size, order=order)
    tok = int(decode_one_token(model, cache, 7).argmax())
    for _ in range(12):  # decode moves the window's buffer on
        tok = int(decode_one_token(model, cache, tok).argmax())
    n = cache.windows.buf0 + 1
    assert cache.windows.local_start(n) < cache.windows.buf0 <= n  # the case
    cache.truncate(n)
    tokens = (first + [7])[:n] if n <= 91 else None
    assert tokens is not None
    got = prefill(model, cache, second, cfg.chunk_size, order=order)
    fresh = make_cache(cfg, model.args, 256, torch.device("cpu"), torch.float32)
    prefill(model, fresh, tokens, cfg.chunk_size, order=order)
    want = prefill(model, fresh, second, cfg.chunk_size, order=order)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("slab", [1, 16, 23, 1000])
def test_slabs_equal_one_read(tiny_llama, slab):
    model, _ = load_model(tiny_llama.path)
    cfg = small_long_context("quest")
    turns = [prompt(90)]
    lc, oc, cc = read_turns(model, cfg, turns, "chunk")
    ll, ol, cl = read_turns(model, cfg, turns, "layer", slab=slab)
    torch.testing.assert_close(lc[0], ll[0], atol=1e-4, rtol=1e-4)
    assert oc == ol
    assert_same_store(cc, cl)


@pytest.mark.parametrize("kv_type", ["FP16", "BF16"])  # (Q8_0 needs head_dim 32: the tiny models have 16)
def test_a_lossy_store_gets_the_prompt_in_its_type(tiny_llama, kv_type):
    """Layer order attends the prompt's own K/V at the compute dtype while it is read (chunk order reads the
    earlier chunks back from the store): the logits stay within the store type's rounding of chunk order, and
    the store then holds the same encoded blocks."""
    model, _ = load_model(tiny_llama.path)
    cfg = small_long_context("quest", kv_type)
    lc, _, cc = read_turns(model, cfg, [prompt(80)], "chunk", n_decode=1)
    ll, _, cl = read_turns(model, cfg, [prompt(80)], "layer", n_decode=1)
    torch.testing.assert_close(lc[0], ll[0], atol=0.05, rtol=0.05)
    k1, _ = cc.store.read_range(0, 0, 80)  # layer 0's K/V do not depend on attention: identical encodings
    k2, _ = cl.store.read_range(0, 0, 80)
    assert torch.equal(k1, k2)


def test_gemma3_hybrid_cache(tiny_gemma3):
    model, _ = load_model(tiny_gemma3.path)
    for cfg in (dense_config(), small_long_context("quest")):
        turns = [prompt(75), prompt(30, seed=5)]  # longer than the tiny models' sliding windows
        lc, oc, _ = read_turns(model, cfg, turns, "chunk")
        ll, ol, cl = read_turns(model, cfg, turns, "layer")
        assert isinstance(cl, HybridCache)
        for a, b in zip(lc, ll):
            torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
        assert oc == ol


# ---- device memory ----


def test_the_workspace_is_one_layer_of_the_prompt_and_is_freed(tiny_llama, monkeypatch):
    model, _ = load_model(tiny_llama.path)
    cfg = small_long_context("quest", slab_tokens=32, order="layer")
    cache = make_cache(cfg, model.args, 256, torch.device("cpu"), torch.float32)
    seen = []
    real = cache.prompt_layers

    def spy(start, n):
        p = real(start, n)
        seen.append((n, p.device_bytes, p.k.nbytes + p.v.nbytes, p))
        return p

    monkeypatch.setattr(cache, "prompt_layers", spy)
    prefill(model, cache, prompt(80), cfg.chunk_size, order="layer", slab_tokens=32)
    a, W = model.args, cache.planner.q_win.shape[1]
    assert [n for n, *_ in seen] == [32, 32, 16]
    for n, nbytes, workspace, p in seen:
        assert workspace == 2 * a.n_kv_heads * n * a.head_dim * 4  # one layer's K/V of the slab
        # reported: that, each layer's last min(W, n) queries, the past windows gathered for a chunk
        rows = 2 * a.n_kv_heads * (n + cache.windows.k.shape[2]) + a.n_layers * min(W, n) * a.n_heads
        assert nbytes == cache.prefill_device_bytes(n) == rows * a.head_dim * 4
        assert p.k is None and p.v is None  # freed once the slab is in the store


# ---- stopped part-way ----


@pytest.mark.parametrize("name", ["dense", "quest", "quest-fp16", "gemma3"])
@pytest.mark.parametrize("stop_at", ["first chunk", "half-way", "last chunk"])
def test_an_interrupted_prompt_leaves_the_cache_as_it_was(tiny_llama, tiny_models, monkeypatch, name, stop_at):
    model, _ = load_model((tiny_models("gemma3") if name == "gemma3" else tiny_llama).path)
    # gemma3: sliding windows of 8 kept in 8 - 1 + 16 + 4 rows, so the second prompt moves them many times
    monkeypatch.setattr(sliding, "COMPACT_TOKENS", 4)
    calls_in_all = 5 * model.args.n_layers  # 70 tokens in chunks of 16, layer after layer
    stop_at = {"first chunk": 1, "half-way": calls_in_all // 2, "last chunk": calls_in_all}[stop_at]
    cfg = dense_config() if name == "dense" else small_long_context("quest", "FP16" if "fp16" in name else "FP32")
    cfg = dataclasses.replace(cfg, sliding_window_keep=16)
    first, second, third = prompt(60), prompt(70, seed=1), prompt(9, seed=2)
    _, expected, _ = read_turns(model, cfg, [first, third], "layer")
    cache = make_cache(cfg, model.args, 256, torch.device("cpu"), torch.float32)
    prefill(model, cache, first, cfg.chunk_size, order="layer")
    calls = []

    def progress(done, total):
        calls.append(done)
        if len(calls) == stop_at:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        prefill(model, cache, second, cfg.chunk_size, on_progress=progress, order="layer")
    assert cache.pos == len(first)
    logits = prefill(model, cache, third, cfg.chunk_size, order="layer")
    tok, out = int(logits.argmax()), []
    for _ in range(len(expected)):
        out.append(tok)
        tok = int(decode_one_token(model, cache, tok).argmax())
    assert out == expected


def test_an_interrupted_slab_keeps_the_slabs_before_it(tiny_llama):
    model, _ = load_model(tiny_llama.path)
    cfg = small_long_context("quest")
    tokens = prompt(100)
    cache = make_cache(cfg, model.args, 256, torch.device("cpu"), torch.float32)

    def progress(done, total):
        if done > 70:  # in the third slab of 32
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        prefill(model, cache, tokens, cfg.chunk_size, on_progress=progress, order="layer", slab_tokens=32)
    assert cache.pos == 64 and all(cache.store.length(i) == 64 for i in range(cache.n_layers))
    got = prefill(model, cache, tokens[64:], cfg.chunk_size, order="layer")
    _, _, ref = read_turns(model, cfg, [tokens], "chunk", n_decode=0)
    want = prefill(model, make_cache(cfg, model.args, 256, torch.device("cpu"), torch.float32), tokens,
                   cfg.chunk_size)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert_same_store(ref, cache)


def test_a_prompt_that_starts_before_the_end_drops_the_rest_and_an_abort_keeps_that(tiny_llama):
    model, _ = load_model(tiny_llama.path)
    cfg = small_long_context("quest")
    first, second = prompt(80), prompt(30, seed=8)
    cache = make_cache(cfg, model.args, 256, torch.device("cpu"), torch.float32)
    prefill(model, cache, first, cfg.chunk_size, order="layer")
    read = cache.prompt_layers(50, 30)  # positions 50.. again: the cache keeps 50 tokens
    assert cache.pos == 50
    read.abort()
    assert cache.pos == 50 and cache.store.length(0) == 50
    got = prefill(model, cache, second, cfg.chunk_size, order="layer")
    fresh = make_cache(cfg, model.args, 256, torch.device("cpu"), torch.float32)
    prefill(model, fresh, first[:50], cfg.chunk_size)
    torch.testing.assert_close(got, prefill(model, fresh, second, cfg.chunk_size), atol=1e-4, rtol=1e-4)


def test_progress_counts_up_to_the_prompt(tiny_llama):
    model, _ = load_model(tiny_llama.path)
    cfg = dense_config()
    cache = make_cache(cfg, model.args, 256, torch.device("cpu"), torch.float32)
    seen = []
    prefill(model, cache, prompt(40), 16, on_progress=lambda d, t: seen.append((d, t)), order="layer")
    assert len(seen) == 3 * model.args.n_layers and seen == sorted(seen) and seen[-1] == (40, 40)


# ---- config ----


def test_config_refusals():
    with pytest.raises(ConfigError, match="prefill.order"):
        load_config(CONFIGS / "million.yaml", [("prefill.order", "layer")])
    with pytest.raises(ConfigError, match="prefill.order.*DYNAMIC"):
        load_config(CONFIGS / "ktransformers.yaml", [("prefill.order", "layer"), ("long_context.anchor_type", "DYNAMIC")])
    with pytest.raises(ConfigError, match="prefill.order"):
        load_config(None, [("prefill.order", "rows")])
    with pytest.raises(ConfigError, match="prefill.slab_tokens"):
        load_config(None, [("prefill.slab_tokens", -1)])
    cfg = load_config(CONFIGS / "quest.yaml", [("prefill.order", "layer"), ("prefill.slab_tokens", 4096)])
    assert dataclasses.asdict(cfg.prefill)["order"] == "layer"


# ---- through the engine ----


def counting(prefill_layers, reads: list[int]):
    def wrapped(tokens, *args):
        reads.append(len(tokens))
        return prefill_layers(tokens, *args)

    return wrapped


@pytest.mark.parametrize("config", ["dense", "quest"])
def test_a_chat_reads_its_turns_layer_by_layer(tiny_llama, config):
    """The same replies as chunk order, turn after turn (each turn's prompt read layer-major at cache.pos)."""
    import ktquest

    replies = {}
    for order in ("chunk", "layer"):
        cfg = dense_config(order=order) if config == "dense" else small_long_context("quest", order=order)
        eng = ktquest.load(tiny_llama.path, cfg, max_new_tokens=8, threads=1, device="cpu")  # (fp32: exact)
        layer_reads: list[int] = []
        eng.model.prefill_layers = counting(eng.model.prefill_layers, layer_reads)
        chat = eng.chat_session(system="be brief", document="some words " * 4)
        replies[order] = [chat.send(m).text for m in ("hello there", "and then?", "one more")]
        assert len(layer_reads) == (3 if order == "layer" else 0)
    assert replies["chunk"] == replies["layer"] and all(replies["layer"])


def test_the_engine_reports_the_device_bound(tiny_llama):
    import ktquest
    from ktquest.kv.memory import chunk_activation_bytes, prompt_token_device_bytes

    eng = ktquest.load(tiny_llama.path, small_long_context("quest", order="layer", slab_tokens=64), threads=1,
                       device="cpu")
    a = eng.model.args
    logits = a.vocab_size * 8  # the prompt's last logits, in the compute dtype (fp32 here) and in fp32
    tokens = eng.max_seq_len * prompt_token_device_bytes(a)  # the whole prompt's, not the slab's
    assert eng.prefill_device_bytes() == (eng.cache.prefill_device_bytes(64) + chunk_activation_bytes(a, 16)
                                          + logits + tokens)
    assert eng.cache.prefill_device_bytes(64) >= 2 * a.n_kv_heads * 64 * a.head_dim * 4
    eng = ktquest.load(tiny_llama.path, small_long_context("quest"), threads=1, device="cpu")
    assert eng.prefill_device_bytes() == 0  # chunk order holds no workspace
