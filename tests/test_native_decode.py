"""The long_context decode step in native code (ktquest/native/decode.py, cpp/decode/): a whole planned token
against the block-by-block path, and the checks at the C++ boundary."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch

from ktquest import _C
from ktquest.config import Config, load_config
from ktquest.generate import decode_one_token, prefill
from ktquest.kv.long_context import LongContextCache
from ktquest.models.loader import load_model
from ktquest.native.decode import NativeDecoder, use_native_decode
from ktquest.native.plans import dense_layer
from ktquest.native.store import KVStore

CONFIGS = Path(__file__).resolve().parent.parent / "configs"


def preset(name: str, **lc_overrides) -> Config:
    cfg = load_config(CONFIGS / f"{name}.yaml")
    return dataclasses.replace(cfg, long_context=dataclasses.replace(cfg.long_context, **lc_overrides))


@pytest.mark.parametrize("name,kw", [
    ("quest", {}),                                           # fresh selections; 1 dense layer (attend all)
    ("quest", {"token_step": 3, "head_select_mode": "SHARED"}),  # reused selections, extended; one shared set
    ("quest", {"layer_step": 2, "dense_layer_num": 0}),      # layer 1 reads layer 0's picks of the token
    ("snapkv", {"layer_step": 3, "head_select_mode": "SHARED", "dense_layer_num": 0}),
    ("snapkv", {}),                                          # preselection, then select among the kept blocks
    ("ada_quest", {}),                                       # Ada-KV budgets split in the store; token_step 2
    ("ada_quest", {"token_step": 1, "sticky_blocks": 1}),
    ("ada_snapkv", {"preselect_refresh": 0}),                # ... over each head's candidates
    ("ada_snapkv", {"preselect_refresh": 3, "sticky_blocks": 1}),
    ("quest", {"sticky_blocks": 1}),                         # last step's blocks kept (the store's own state)
    ("snapkv", {"sticky_blocks": 1}),                        # ... among the candidates
    ("snapkv", {"preselect_refresh": 3}),                    # candidates refreshed by a selection from all
    ("snapkv", {"preselect_refresh": 2, "sticky_blocks": 1}),
    ("snapkv", {"preselect_refresh": 2, "layer_step": 2, "dense_layer_num": 0}),  # followers never refresh
    ("quest", {"rerank": 4}),                                # the anchors' 12 picks cut to 3 by attention mass
    ("snapkv", {"rerank": 2, "sticky_blocks": 1}),           # ... among the candidates, sticky blocks after it
    ("ada_snapkv", {"rerank": 3, "preselect_refresh": 3}),   # ... Ada-KV's split by mass, refreshed
])
def test_planned_token_matches_the_block_by_block_path(tiny_llama, name, kw):
    """A whole token in one native call (the cache's plan) gives the logits, the selections and the call
    statistics of the block-by-block path (qkv stage, cache.attend, out stage) on the same weights."""

    model, _ = load_model(tiny_llama.path, encoded=True)
    native = NativeDecoder.build(model, threads=2)
    lc = dict(block_size=4, init_windows_len=4, local_windows_len=8, second_select_num=3, preselect_block_count=6,
              dense_layer_num=1, kv_type="FP16", anchor_num=2, sticky_blocks=0)
    lc.update(kw)
    cfg = dataclasses.replace(preset(name, **lc), chunk_size=16, max_seq_len=256)
    prompt = torch.arange(3, 70) * 7 % 250
    runs = []
    for planned in (False, True):
        cache = LongContextCache(model.args, cfg, 256)
        commits = []  # the tokens that ran as one planned call
        commit = cache.commit_decode
        cache.commit_decode = lambda plan: (commits.append(plan.pos), commit(plan))
        with torch.inference_mode():
            logits = [prefill(model, cache, prompt, 16)]
            for i, tok in enumerate((5, 9, 11, 200, 7, 31, 64, 2, 90, 17, 3, 8, 40, 41)):
                logits.append(native.decode(tok, cache, planned=planned))
                if i == 6:  # the selections read half-way (a planned token keeps them in its buffers until read)
                    mid = [None if s is None else s.ids.clone() for s in map(cache.selection, range(model.args.n_layers))]
        assert len(commits) == (14 if planned else 0)
        sel = [None if s is None else s.ids.clone() for s in map(cache.selection, range(model.args.n_layers))]
        sel += [cache.candidates(i) for i in range(model.args.n_layers)]
        runs.append((torch.cat(logits), mid + sel, dataclasses.asdict(cache.stats)))
    (l0, s0, st0) = runs[0]
    assert sum(st0["select_calls"]) > 0
    assert (st0["refresh_calls"] > 0) == (cfg.long_context.preselect_refresh > 0)
    assert (sum(st0["reuse_calls"]) > 0) == (cfg.long_context.token_step > 1 or cfg.long_context.layer_step > 1)
    for l1, s1, st1 in runs[1:]:
        torch.testing.assert_close(l1, l0, atol=1e-5, rtol=1e-5)
        assert st1 == st0
        for a, b in zip(s0, s1):
            assert (a is None) == (b is None) and (a is None or torch.equal(a, b))


@pytest.mark.parametrize("planned", [False, True])
def test_refreshed_candidates_are_snapkvs_pick_and_the_last_refresh(tiny_llama, planned):
    """preselect_refresh R: every R decode steps after preselection a layer selects from every context block
    (picks outside the candidates allowed), and its candidates become SnapKV's own pick, the blocks that
    entered the context since, and these picks (the last refresh's dropped); the steps between select among
    the candidates, which only gain the blocks that enter the context."""
    model, _ = load_model(tiny_llama.path, encoded=True)
    native = NativeDecoder.build(model, threads=2)
    lc = dict(block_size=4, init_windows_len=4, local_windows_len=8, second_select_num=3, preselect_block_count=3,
              dense_layer_num=0, kv_type="FP16", sticky_blocks=0)
    prompt = torch.arange(3, 90) * 11 % 250
    tokens = (5, 9, 11, 200, 7, 31, 64, 2, 90, 17, 3, 8, 44, 45)
    L = model.args.n_layers

    def sets(t):
        return [set(row.tolist()) - {-1} for row in t]

    for R in (0, 4):
        cfg = dataclasses.replace(preset("snapkv", preselect_refresh=R, **lc), chunk_size=16, max_seq_len=256)
        cache = LongContextCache(model.args, cfg, 256)
        outside, dropped, base = 0, 0, {}
        with torch.inference_mode():
            prefill(model, cache, prompt, 16)
            for step, tok in enumerate(tokens, start=1):  # step: the planner's decode_step of this token
                before = [None if cache.candidates(i) is None else sets(cache.candidates(i)) for i in range(L)]
                lb_before = cache.context_blocks()[1]
                native.decode(tok, cache, planned=planned)
                lb = cache.context_blocks()[1]
                for layer in range(L):
                    new, picks = sets(cache.candidates(layer)), sets(cache.selection(layer).ids)
                    if step == 1:  # preselected at this step: SnapKV's own pick, and what it was chosen among
                        base[layer], base_lb = new, lb
                        continue
                    for h in range(len(new)):
                        assert picks[h] <= set(range(lb)) and len(picks[h]) <= 3
                        if R and (step - 1) % R == 0:  # a refresh
                            assert new[h] == base[layer][h] | set(range(base_lb, lb)) | picks[h]
                            outside += len(picks[h] - before[layer][h])
                            dropped += len(before[layer][h] - new[h])
                        else:
                            assert picks[h] <= before[layer][h] | set(range(lb_before, lb))
                            assert new[h] == before[layer][h] | set(range(lb_before, lb))
        assert cache.stats.refresh_calls == (0 if R == 0 else L * ((len(tokens) - 1) // R))
        assert (outside > 0) == (R > 0)  # a refresh picked blocks the prompt's queries had not kept
        assert (dropped > 0) == (R > 0)  # ... and the next one let some of them go


def test_native_decode_step_checks_its_arguments():
    H, KVH, D = 4, 2, 16
    st = KVStore(1, KVH, D, max_seq_len=64, block_size=8, kv_type="FP32", threads_num=1)
    q, k, v = torch.randn(H, D), torch.randn(KVH, D), torch.randn(KVH, D)
    wk, wv, out = torch.zeros(KVH, 16, D), torch.zeros(KVH, 16, D), torch.empty(H, D)
    st.decode_step(0, q, k, v, wk, wv, 0, 1, (0, 0), D ** -0.5, 1, out)  # no context block: the window alone
    torch.testing.assert_close(out, v.repeat_interleave(H // KVH, 0))  # one row: softmax weight 1
    assert st.length(0) == 1 and torch.equal(wk[:, 0], k)
    with pytest.raises(ValueError, match="w0=5 and width=3"):
        st.decode_step(0, q, k, v, wk, wv, 5, 3, (0, 0), D ** -0.5, 1, out)
    with pytest.raises(ValueError, match="skip"):
        st.decode_step(0, q, k, v, wk, wv, 1, 2, (1, 2), D ** -0.5, 1, out)
    with pytest.raises(ValueError, match=r"win_v: expected shape \[2, 16, 16\]"):
        st.decode_step(0, q, k, v, wk, torch.zeros(KVH, 8, D), 1, 2, (0, 0), D ** -0.5, 1, out)
    with pytest.raises(ValueError, match="non-finite"):
        st.decode_step(0, torch.full((H, D), float("nan")), k, v, wk, wv, 1, 2, (0, 0), D ** -0.5, 1, out)
    assert st.length(0) == 1  # refused calls append nothing


def test_a_refused_decode_step_changes_nothing():
    """decode_step validates q, scale and the token's k/v before it writes anything, and puts the window rows back
    when the store part refuses later: the window, the store and out stay as they were (a NaN row was left in
    the window before)."""
    H, KVH, D = 4, 2, 16
    st = KVStore(1, KVH, D, max_seq_len=8, block_size=4, kv_type="FP16", threads_num=1)
    st.append(0, torch.randn(4, KVH, D), torch.randn(4, KVH, D))  # one full context block
    q, k, v = torch.randn(H, D), torch.randn(KVH, D), torch.randn(KVH, D)
    wk, wv = torch.randn(KVH, 16, D), torch.randn(KVH, 16, D)
    out = torch.full((H, D), 7.0)
    before = (wk.clone(), wv.clone())

    def step(q=q, k=k, v=v, scale=D ** -0.5, blocks=None):
        st.decode_step(0, q, k, v, wk, wv, 3, 5, (0, 0), scale, 1, out, blocks=blocks)

    nan = torch.full((KVH, D), float("nan"))
    for call, error, match in [
        (lambda: step(k=nan), ValueError, "k contains a non-finite value"),
        (lambda: step(v=nan), ValueError, "v contains a non-finite value"),
        (lambda: step(k=k * 1e5), ValueError, "overflows kv_type FP16"),
        (lambda: step(q=torch.full((H, D), float("inf"))), ValueError, "q contains a non-finite value"),
        (lambda: step(scale=float("nan")), ValueError, "scale=nan is not finite"),
        (lambda: step(blocks=[5]), IndexError, "block id 5 is out of range"),  # refused after the row was written
    ]:
        with pytest.raises(error, match=match):
            call()
        assert torch.equal(wk, before[0]) and torch.equal(wv, before[1])
        assert st.length(0) == 4 and torch.equal(out, torch.full((H, D), 7.0))
    step(blocks=[0])
    assert st.length(0) == 5 and torch.equal(wk[:, 3], k) and not torch.equal(out, torch.full((H, D), 7.0))
    st.append(0, torch.randn(3, KVH, D), torch.randn(3, KVH, D))  # full: the next step is refused up front
    wk0 = wk.clone()
    with pytest.raises(ValueError, match="KV store is full"):
        st.decode_step(0, q, k * 2, v, wk, wv, 4, 5, (0, 0), D ** -0.5, 1, out)
    assert torch.equal(wk, wk0) and st.length(0) == 8


def test_a_refused_token_rolls_back_every_layer(tiny_llama):
    """A planned token (_C.decode_token) is all or nothing: when layer i refuses the token (here its store is
    full), the layers before it lose the token again (store length, window rows) and x is restored."""
    model, _ = load_model(tiny_llama.path, encoded=True)
    layers = NativeDecoder.build(model, threads=1).blocks
    a, L = model.args, model.args.n_layers
    assert L >= 2
    cache = LongContextCache(a, preset("quest", block_size=4, init_windows_len=4, local_windows_len=8), 64)
    plan = cache.plan_decode(0)
    st = cache.store
    kvh, d = a.n_kv_heads, a.head_dim
    st.append(L - 1, torch.randn(64, kvh, d), torch.randn(64, kvh, d))  # the last layer's store is full
    x = np.random.default_rng(0).standard_normal(a.dim).astype(np.float32)
    cs, sn = np.ones((1, d), np.float32), np.zeros((1, d), np.float32)
    windows = [(layer[1], layer[2]) for layer in plan.layers]  # ('store', win_k, win_v, step)
    x0, wins0 = x.copy(), [(k.copy(), v.copy()) for k, v in windows]
    with pytest.raises(ValueError, match=f"layer {L - 1} holds 64 tokens"):
        plan.run(layers, x, cs, sn, np.zeros(L, np.int32), 1)
    assert [st.length(i) for i in range(L)] == [0] * (L - 1) + [64]
    assert np.array_equal(x, x0)
    for (k, v), (k0, v0) in zip(windows, wins0):
        assert np.array_equal(k, k0) and np.array_equal(v, v0)


def test_decode_layer_takes_any_even_head_dim():
    """DecodeLayer's RoPE works on one head at a time in a buffer of its own size (it was a fixed 1024 floats,
    checked in one binding only); its heads and eps are checked where it is built."""
    rng = np.random.default_rng(0)
    dim, D, ffn = 32, 1056, 64

    mats = {}

    def q8(out, inp):  # an F32 matrix read in place (the name is the old Q8_0 pack's)
        mats[out, inp] = rng.standard_normal((out, inp)).astype(np.float32)
        return _C.QuantMatrix([("F32", mats[out, inp].view(np.uint8))])

    ones = np.ones(dim, np.float32)
    wqkv = q8(3 * D, dim)
    layer = _C.DecodeLayer(ones, ones, 1e-5, wqkv, q8(dim, D), q8(2 * ffn, dim), q8(dim, ffn), 1, 1, D)
    x = rng.standard_normal(dim).astype(np.float32)
    ang = rng.standard_normal(D).astype(np.float32)
    cos, sin = np.cos(ang), np.sin(ang)
    out = np.zeros(3 * D, np.float32)
    layer.qkv(x, cos, sin, out, 1)
    w = mats[3 * D, dim].astype(np.float64)  # [3D, dim]
    xn = x / np.sqrt(np.mean(x.astype(np.float64) ** 2) + 1e-5)

    def rope(ref):
        for h in range(2):  # rotate-half RoPE on q and k: y[i] = x[i] cos[i] + x[(i + D/2) % D] sin[i]
            r = ref[h * D : (h + 1) * D]
            ref[h * D : (h + 1) * D] = r * cos + np.roll(r, -D // 2) * sin
        return ref

    np.testing.assert_allclose(out, rope(w @ xn), rtol=1e-4, atol=1e-4)
    # qkv_perm: the projection gathered before RoPE (a llama file's interleaved q/k rows)
    perm = rng.permutation(3 * D).astype(np.int32)
    layer = _C.DecodeLayer(ones, ones, 1e-5, wqkv, q8(dim, D), q8(2 * ffn, dim), q8(dim, ffn), 1, 1, D, perm)
    layer.qkv(x, cos, sin, out, 1)
    np.testing.assert_allclose(out, rope((w @ xn)[perm]), rtol=1e-4, atol=1e-4)
    for bad in (perm[:-1], np.zeros(3 * D, np.int32)):
        with pytest.raises(ValueError, match="qkv_perm"):
            _C.DecodeLayer(ones, ones, 1e-5, wqkv, q8(dim, D), q8(2 * ffn, dim), q8(dim, ffn), 1, 1, D, bad)
    for args, match in [((1, 1, 0), "head_dim=0 must be even"), ((1, 1, 7), "head_dim=7 must be even"),
                        ((3, 2, 64), "n_heads=3 must be a positive multiple of n_kv_heads=2"),
                        ((0, 1, 64), "n_heads=0")]:
        with pytest.raises(ValueError, match=match):
            _C.DecodeLayer(ones, ones, 1e-5, wqkv, q8(dim, D), q8(2 * ffn, dim), q8(dim, ffn), *args)
    with pytest.raises(ValueError, match="eps=nan"):
        _C.DecodeLayer(ones, ones, float("nan"), wqkv, q8(dim, D), q8(2 * ffn, dim), q8(dim, ffn), 1, 1, D)


def test_native_token_step_checks_every_layer_first(tiny_llama):
    """_C.decode_token checks every layer's arguments before the first layer runs."""

    model, _ = load_model(tiny_llama.path, encoded=True)
    blocks = NativeDecoder.build(model, threads=1).blocks
    a, L = model.args, model.args.n_layers
    cache = LongContextCache(a, preset("quest", block_size=4, init_windows_len=4, local_windows_len=8), 64)
    st = cache.store
    plan = cache.plan_decode(0)  # the first token: the window alone, no context block
    x, cs = np.zeros(a.dim, np.float32), np.zeros((1, a.head_dim), np.float32)
    rope = np.zeros(L, np.int32)
    (_, wk, wv, none), *_ = plan.layers
    wins = [(layer[1], layer[2]) for layer in plan.layers]

    def call(blocks=blocks, x=x, layers=None, store=st.native, rope=rope, cos=cs):
        layers = [("store", k, v, none) for k, v in wins] if layers is None else layers
        _C.decode_token(blocks, x, cos, cos, rope, layers, 0.125, 1, store, 0, 1, 0, 0)

    with pytest.raises(ValueError, match=f"one layer plan per block .* got {L - 1} and {L}"):
        call(blocks=blocks[:-1])
    with pytest.raises(TypeError, match=r"blocks\[1\]: expected a DecodeLayer"):
        call(blocks=[blocks[0], "not a layer"])
    with pytest.raises(TypeError, match=r"layers\[1\]\[3\]: expected a StorePlan"):
        call(layers=[("store", wk, wv, none), ("store", wk, wv, (0, None))])
    with pytest.raises(ValueError, match="blocks: expected 1 \\(shared\\) or n_kv_heads"):  # checked when planned
        _C.StorePlan.attend(st.native, np.zeros((a.n_kv_heads + 1, 2), np.int32))
    elsewhere = KVStore(L, a.n_kv_heads, a.head_dim, max_seq_len=64, block_size=4)
    with pytest.raises(ValueError, match="a StorePlan made for another store"):
        call(layers=[("store", wk, wv, none), ("store", wk, wv,
                                                _C.StorePlan.attend(elsewhere.native, np.zeros((1, 1), np.int32)))])
    with pytest.raises(ValueError, match=r"layers\[0\]: expected \('dense'"):
        call(layers=[wins[0][0]] + [("store", k, v, none) for k, v in wins[1:]])
    with pytest.raises(ValueError, match=r"layers: 1 store layers, the store has 2"):
        call(layers=[("store", wk, wv, none), ("dense", wk, wv, 0, 0, 0)])
    with pytest.raises(ValueError, match=r"a store layer, but no store was given"):
        call(store=None)
    with pytest.raises(ValueError, match=r"rope\[1\]=1: expected a table of cos/sin, 0..0"):
        call(rope=np.array([0, 1], np.int32))
    with pytest.raises(ValueError, match=r"sin: expected shape"):
        _C.decode_token(blocks, x, cs, np.zeros((2, a.head_dim), np.float32), rope,
                        [("store", k, v, none) for k, v in wins], 0.125, 1, st.native, 0, 1, 0, 0)
    with pytest.raises(ValueError, match=r"x: expected shape"):
        call(x=np.zeros(a.dim + 1, np.float32))
    other = KVStore(L, a.n_kv_heads + 1, a.head_dim, max_seq_len=64, block_size=4)
    with pytest.raises(ValueError, match="KV heads"):
        call(store=other.native)
    with pytest.raises(TypeError, match="store: expected a KVStore or None, got"):
        call(store=st)  # the facade, not the native store
    assert all(st.length(i) == 0 for i in range(L))  # nothing ran
    call()  # the same call with good arguments: one token in every layer's store
    assert all(st.length(i) == 1 for i in range(L))


def test_dense_token_in_one_call_matches_the_block_by_block_path(tiny_model):
    """A dense cache's token in one native call (DenseKVCache.plan_decode -> _C.decode_token) gives the
    logits and the cache of the block-by-block path (qkv stage, cache.attend, out stage), across a growth of
    the cache's capacity (GROW_TOKENS)."""
    from ktquest.kv import dense
    from ktquest.kv.dense import DenseKVCache

    path, _ = tiny_model
    model, _ = load_model(path, encoded=True)
    native = NativeDecoder.build(model, threads=2)
    a = model.args
    prompt = torch.arange(3, 40) * 7 % a.vocab_size
    runs = []
    for planned in (False, True):
        cache = DenseKVCache(a.n_layers, a.n_kv_heads, a.head_dim, 64, threads=2)
        with torch.inference_mode():
            logits = [prefill(model, cache, prompt, 16)]
            for tok in (5, 9, 11, 200, 7, 31):
                logits.append(native.decode(tok % a.vocab_size, cache, planned=planned))
        assert cache.pos == len(prompt) + 6
        runs.append((torch.stack(logits), [cache.layer_kv(i)[0][:, : cache.pos].clone() for i in range(a.n_layers)]))
    torch.testing.assert_close(runs[1][0], runs[0][0], rtol=1e-5, atol=1e-5)
    for k1, k0 in zip(runs[1][1], runs[0][1]):
        torch.testing.assert_close(k1, k0, rtol=1e-6, atol=1e-6)
    # the plan grows every layer to hold its token first
    old = dense.GROW_TOKENS
    try:
        dense.GROW_TOKENS = 16
        cache = DenseKVCache(a.n_layers, a.n_kv_heads, a.head_dim, 64, threads=1)
        with torch.inference_mode():
            prefill(model, cache, prompt[:16], 16)
            assert cache.capacity == 16
            native.decode(3, cache)
        assert cache.capacity == 32 and cache.pos == 17
    finally:
        dense.GROW_TOKENS = old


def test_decode_token_checks_its_dense_layers(tiny_llama):
    model, _ = load_model(tiny_llama.path, encoded=True)
    blocks = NativeDecoder.build(model, threads=1).blocks
    a = model.args
    caches = [(np.zeros((a.n_kv_heads, 8, a.head_dim), np.float32),) * 2 for _ in blocks]
    x, cs = np.zeros(a.dim, np.float32), np.zeros((1, a.head_dim), np.float32)
    rope = np.zeros(len(blocks), np.int32)

    def call(layers, scale=0.125):
        _C.decode_token(blocks, x, cs, cs, rope, layers, scale, 1)

    with pytest.raises(ValueError, match="one layer plan per block"):
        call([dense_layer(k, v, 0) for k, v in caches[:-1]])
    with pytest.raises(ValueError, match=r"layers\[0\]: row w0=8 and skip \[0, 0\) must satisfy"):
        call([dense_layer(k, v, 8) for k, v in caches])
    with pytest.raises(ValueError, match=r"layers\[0\]: row w0=3 and skip \[2, 5\) must satisfy"):
        call([dense_layer(k, v, 3, (2, 5)) for k, v in caches])
    with pytest.raises(TypeError, match=r"layers\[0\].w0: expected an integer"):
        call([("dense", *caches[0], 1.5, 0, 0)] + [dense_layer(k, v, 0) for k, v in caches[1:]])
    bad = [(np.zeros((a.n_kv_heads, 8, a.head_dim + 1), np.float32),) * 2] + caches[1:]
    with pytest.raises(ValueError, match=r"layers\[0\].k: expected shape"):
        call([dense_layer(k, v, 0) for k, v in bad])
    with pytest.raises(ValueError, match="scale"):
        call([dense_layer(k, v, 0) for k, v in caches], float("nan"))
    with pytest.raises(TypeError, match=r"layers\[0\].skip0: expected an integer, got <class 'bool'>"):
        call([("dense", *caches[0], 1, False, 0)] + [dense_layer(k, v, 0) for k, v in caches[1:]])
    with pytest.raises(ValueError, match=r"layers\[0\].w0: .* does not fit in 64 bits"):
        call([("dense", *caches[0], 2**64, 0, 0)] + [dense_layer(k, v, 0) for k, v in caches[1:]])
    call([dense_layer(k, v, np.int64(7), (np.int32(2), 5)) for k, v in caches])  # numpy integers are integers
    assert np.isfinite(x).all()


@pytest.mark.parametrize("name", ["quest", "snapkv"])
def test_a_prompts_last_chunk_of_one_token_is_read_exactly(tiny_llama, name):
    """On the native path too, a prompt whose last chunk is one token reads it as the prompt's (every block,
    its query recorded for SnapKV), not as a sparse decode step: the same logits, recorded queries and
    candidates as the prompt read in chunks that end otherwise, and the same tokens after."""
    model, _ = load_model(tiny_llama.path, encoded=True)
    use_native_decode(model, 2)
    assert isinstance(model.decoder, NativeDecoder)
    lc = dict(block_size=4, init_windows_len=4, local_windows_len=8, second_select_num=2, preselect_block_count=4,
              dense_layer_num=0, kv_type="FP16", anchor_num=2)
    cfg = dataclasses.replace(preset(name, **lc), chunk_size=32, max_seq_len=256)
    prompt = torch.arange(3, 68) * 7 % 250  # 65 tokens: chunks of 16 end with one token, of 20 with five
    caches, logits = [], []
    for chunk in (16, 20):
        cache = LongContextCache(model.args, cfg, 256)
        with torch.inference_mode():
            out = [prefill(model, cache, prompt, chunk)]
            for tok in (5, 9, 11, 200):
                out.append(decode_one_token(model, cache, tok))
        caches.append(cache)
        logits.append(torch.stack(out))
    torch.testing.assert_close(logits[0], logits[1], atol=2e-3, rtol=1e-3)  # (chunking: ~3e-4; a sparse step: ~3)
    a, b = caches
    assert a.planner.q_win_span == b.planner.q_win_span == (65 - a.planner.q_win.shape[1], 65)
    torch.testing.assert_close(a.planner.q_win, b.planner.q_win, atol=2e-3, rtol=1e-3)
    for layer in range(model.args.n_layers):
        ca, cb = a.candidates(layer), b.candidates(layer)
        assert (ca is None) == (cb is None) == (name == "quest") and (ca is None or torch.equal(ca, cb))
