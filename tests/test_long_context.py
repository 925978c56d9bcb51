"""The long-context cache: exactness against dense attention, every knob, memory bounds, errors, chat."""

from __future__ import annotations

import dataclasses
import types
from pathlib import Path

import pytest
import torch

from ktquest.config import Config, ConfigError, LongContextConfig, load_config
from ktquest.generate import decode_one_token, prefill
from ktquest.kv.dense import DenseKVCache
from ktquest.kv.long_context import LongContextCache
from ktquest.kv.memory import candidate_copy_bytes, store_bytes
from ktquest.kv.selection import ada_budgets
from ktquest.models.loader import load_model
from ktquest.native.store import KVStore

CONFIGS = Path(__file__).resolve().parent.parent / "configs"
PRESETS = ["quest", "ktransformers", "snapkv", "ada_snapkv", "ada_quest", "dynamic"]
# "dynamic": ktransformers.yaml with KTransformers' own selection, DYNAMIC anchors (1 a block) shared by the heads
DYNAMIC = dict(anchor_type="DYNAMIC", anchor_num=1, head_select_mode="SHARED")

# Tolerances by stored type: the store part reads K/V rounded to kv_type while the dense reference
# keeps fp32. FP32: accumulation order only. FP16: 11-bit mantissa (2^-11 relative per element).
# BF16: 8-bit mantissa. Q8_0: 1/127 of a group's max; Q4_0: 1/7 (attention averages the error down).
TOL = {"FP32": 2e-5, "FP16": 3e-3, "BF16": 2e-2, "Q8_0": 3e-2, "Q4_0": 2.5e-1}


def dense_ref(q, k, v):
    """Causal attention: q [N, H, D], k/v [N, KVH, D] -> [N, H, D]."""
    G = q.shape[1] // k.shape[1]
    kk, vv = k.repeat_interleave(G, 1), v.repeat_interleave(G, 1)
    s = torch.einsum("thd,shd->hts", q, kk) / q.shape[-1] ** 0.5
    s = s.masked_fill(torch.ones(q.shape[0], q.shape[0], dtype=torch.bool).triu(1), float("-inf"))
    return torch.einsum("hts,shd->thd", s.softmax(-1), vv)


def preset(name: str, **lc_overrides) -> Config:
    if name == "dynamic":
        name, lc_overrides = "ktransformers", {**lc_overrides, **DYNAMIC}
    cfg = load_config(CONFIGS / f"{name}.yaml")
    return dataclasses.replace(cfg, long_context=dataclasses.replace(cfg.long_context, **lc_overrides))


def full_budget(name: str, block_size: int = 8, **kw) -> Config:
    """The preset with small windows and blocks and a budget that covers every block."""
    cfg = preset(name, block_size=block_size, init_windows_len=5, local_windows_len=20, second_select_num=1000,
                 preselect_block_count=1000, **kw)
    return dataclasses.replace(cfg, chunk_size=16, max_seq_len=256)


def run(cache, q, k, v, chunk: int, n_prefill: int, n_layers: int = 1, keep: bool = True) -> torch.Tensor | None:
    """Chunked prefill then one-token decode steps through cache.attend; returns out [N, H, D] of layer 0
    (None with keep=False: nothing kept, for memory measurements)."""
    outs, pos = [], 0
    while pos < q.shape[0]:
        t = min(chunk, n_prefill - pos) if pos < n_prefill else 1
        for layer in range(n_layers):
            o = cache.attend(layer, q[pos: pos + t], k[pos: pos + t], v[pos: pos + t], pos)
            if layer == 0 and keep:
                outs.append(o)
        pos += t
    return torch.cat(outs) if keep else None


def qkv(N=90, H=6, KVH=2, D=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(N, H, D, generator=g), torch.randn(N, KVH, D, generator=g),
            torch.randn(N, KVH, D, generator=g))


ARGS = types.SimpleNamespace(n_layers=3, n_heads=6, n_kv_heads=2, head_dim=32)


# ---- exactness at full budget ----


@pytest.mark.parametrize("kv_type", list(TOL))
@pytest.mark.parametrize("name", PRESETS)
def test_full_budget_equals_dense_attention(name, kv_type):
    cfg = full_budget(name, kv_type=kv_type, anchor_num=2)
    q, k, v = qkv()
    out = run(LongContextCache(ARGS, cfg, 256), q, k, v, 16, 70, n_layers=3)
    torch.testing.assert_close(out, dense_ref(q, k, v), atol=TOL[kv_type], rtol=TOL[kv_type])


@pytest.mark.parametrize("tile", [1, 3, 7, 10**9])
def test_window_attention_in_query_tiles_equals_dense(monkeypatch, tile):
    """The windows' flash attention runs in query tiles, each against its last query's key columns: any tile
    (one token, sizes that do not divide a pass, one tile for all) gives dense attention. Passes of 13 tokens
    start inside the init window, mid-block and after the local window left rows behind."""
    from ktquest.kv import long_context_pass
    monkeypatch.setattr(long_context_pass, "FLASH_TILE", tile)
    cfg = full_budget("quest", kv_type="FP32")
    q, k, v = qkv(N=100)
    cache = LongContextCache(ARGS, cfg, 256)
    assert cache.placement.flash  # torch's CPU flash kernel: the tiled path is the one tested
    out = run(cache, q, k, v, 13, 91, n_layers=3)
    torch.testing.assert_close(out, dense_ref(q, k, v), atol=TOL["FP32"], rtol=TOL["FP32"])


@pytest.fixture(scope="module")
def tiny(tiny_llama):
    model, _ = load_model(tiny_llama.path)
    return model


@pytest.mark.parametrize("kv_type", ["FP32", "FP16", "BF16"])  # the tiny model's head_dim (16) rules out Q*
@pytest.mark.parametrize("name", PRESETS)
def test_full_budget_logits_equal_dense(tiny, name, kv_type):
    a = tiny.args
    cfg = full_budget(name, block_size=4, kv_type=kv_type, anchor_num=2)
    lcache = LongContextCache(a, cfg, 256)
    dcache = DenseKVCache(a.n_layers, a.n_kv_heads, a.head_dim, 256)
    prompt = torch.arange(3, 60) * 7 % 250
    tol = TOL[kv_type] * 10  # logits: the error of two layers, amplified by the output projection
    torch.testing.assert_close(prefill(tiny, lcache, prompt, 16), prefill(tiny, dcache, prompt, 16),
                               atol=tol, rtol=tol)
    for tok in (5, 9, 11, 200, 7):
        torch.testing.assert_close(decode_one_token(tiny, lcache, tok), decode_one_token(tiny, dcache, tok),
                                   atol=tol, rtol=tol)


# ---- knobs ----


def sparse_cfg(**kw) -> Config:
    lc = {"block_size": 8, "init_windows_len": 8, "local_windows_len": 16, "second_select_num": 2, "kv_type": "FP32",
              "anchor_type": "QUEST", "head_select_mode": "SEPARATE"}
    lc.update(kw)
    return Config(mode="long_context", chunk_size=16, max_seq_len=256, long_context=LongContextConfig(**lc))


def decode_steps(cache, q, k, v, n_prefill, n_layers=3):
    run(cache, q, k, v, 16, n_prefill, n_layers=n_layers)
    return cache.stats


def test_token_and_layer_step_select_only_when_due():
    q, k, v = qkv(N=110)
    st = decode_steps(LongContextCache(ARGS, sparse_cfg(token_step=3), 256), q, k, v, 100)
    assert st.select_calls == [4, 4, 4] and st.reuse_calls == [6, 6, 6]  # steps 1, 4, 7, 10 of 10
    st = decode_steps(LongContextCache(ARGS, sparse_cfg(layer_step=2), 256), q, k, v, 100)
    assert st.select_calls == [10, 0, 10] and st.reuse_calls == [0, 10, 0]


def test_reused_selection_is_extended_by_new_context_blocks():
    q, k, v = qkv(N=140)
    cache = LongContextCache(ARGS, sparse_cfg(token_step=100, second_select_num=1), 256)
    run(cache, q, k, v, 16, 100, n_layers=3)  # 40 decode steps: the context grows by 5 blocks
    sel = cache.selection(0)
    assert sel.lb == cache.context_blocks()[1] and sel.ids.shape[1] == 1 + (sel.lb - 10)
    assert cache.stats.select_calls[0] == 1


def test_dense_layers_see_every_block_and_windows_never_go_through_selection():
    q, k, v = qkv(N=110)
    cache = LongContextCache(ARGS, sparse_cfg(dense_layer_num=1, second_select_num=1), 256)
    st = decode_steps(cache, q, k, v, 100)
    assert st.full_calls == [10, 0, 0] and st.select_calls == [0, 10, 10]
    ids = cache.selection(1).ids
    lb = cache.context_blocks()[1]
    assert ((ids == -1) | ((ids >= 1) & (ids < lb))).all()  # never the init block 0 or the local blocks


def test_preselection_restricts_candidates():
    q, k, v = qkv(N=110)
    cache = LongContextCache(ARGS, sparse_cfg(preselect_block=True, preselect_block_count=3,
                                              second_select_num=2), 256)
    run(cache, q, k, v, 16, 100, n_layers=3)
    assert cache.stats.preselect_calls == 3
    for layer in range(3):
        allowed = cache.candidates(layer)  # 3 preselected, then the blocks that left the local window since
        assert (allowed[:, :3] >= 0).all() and allowed.shape[1] == 3 + cache.context_blocks()[1] - 10
        picked = cache.selection(layer).ids
        for h in range(2):
            assert set(picked[h][picked[h] >= 0].tolist()) <= set(allowed[h].tolist())


def test_ada_budgets_sum_floor_and_spread():
    g = torch.Generator().manual_seed(1)
    peaked = torch.full((1, 40), -8.0)
    peaked[0, 3] = 5.0
    spread = torch.randn(1, 40, generator=g) * 0.01
    scores = torch.cat([peaked, spread, peaked]).exp()  # head 1 attends broadly
    b = ada_budgets(scores, 30, 0.2)
    assert int(b.sum()) == 30 and (b >= int(0.2 * 30 / 3)).all()
    assert b[1] > b[0] and b[1] > b[2]


def test_ada_decode_budgets_per_head():
    q, k, v = qkv(N=110)
    cache = LongContextCache(ARGS, sparse_cfg(ada_budget=True, second_select_num=2), 256)
    run(cache, q, k, v, 16, 100, n_layers=3)
    ids = cache.selection(0).ids
    assert int((ids >= 0).sum()) == 4  # the layer's total, 2 blocks x 2 KV heads


# ---- memory ----


def test_device_kv_bytes_do_not_grow_with_the_prompt():
    cfg = dataclasses.replace(sparse_cfg(), max_seq_len=2048, chunk_size=64)
    sizes = []
    for n in (64, 500, 1500):
        q, k, v = qkv(N=n)
        cache = LongContextCache(ARGS, cfg, 2048)
        run(cache, q, k, v, 64, n, n_layers=3)
        sizes.append(cache.device_kv_bytes())
        assert cache.store.length(0) == n
    assert sizes[0] == sizes[1] == sizes[2]
    if torch.cuda.is_available():  # the same on a GPU, measured by the allocator
        peaks = []
        for n in (500, 1500):
            torch.cuda.reset_peak_memory_stats()
            q, k, v = (x.cuda() for x in qkv(N=n))
            base = torch.cuda.memory_allocated()
            run(LongContextCache(ARGS, cfg, 2048, device="cuda"), q, k, v, 64, n, n_layers=3, keep=False)
            peaks.append(torch.cuda.max_memory_allocated() - base)
        assert peaks[1] < peaks[0] * 1.5


def test_a_chunk_larger_than_the_context_does_not_size_the_window():
    """No pass is longer than max_seq_len: chunk_size 16384 with max_seq_len 256 is a chunk of 256."""
    cfg = dataclasses.replace(sparse_cfg(), chunk_size=16384)
    cache = LongContextCache(ARGS, cfg, 256)
    assert cache.chunk_size == 256 and cache.windows.k.shape[2] == 8 + 16 + 8 + 256  # init + local + block + chunk
    q, k, v = qkv(N=256)
    run(cache, q, k, v, 256, 250, n_layers=3)  # a 250-token pass in one chunk, then decode to the end
    assert cache.pos == 256


# ---- errors ----


def test_invalid_knobs_are_clear_errors(monkeypatch):
    with pytest.raises(ConfigError, match="anchor_num.*QUEST"):
        LongContextConfig(anchor_type="QUEST", anchor_num=3)
    with pytest.raises(ConfigError, match="local_windows_len"):
        Config(mode="long_context", max_seq_len=100, long_context=LongContextConfig(local_windows_len=100))
    with pytest.raises(ConfigError, match="block_size"):
        Config(mode="long_context", max_seq_len=100, long_context=LongContextConfig(
            block_size=128, init_windows_len=0, local_windows_len=10))
    with pytest.raises(ConfigError, match="ada_alpha"):
        LongContextConfig(ada_alpha=1.5)
    with pytest.raises(ConfigError, match="head_dim"):  # Q8_0/Q4_0 need head_dim % 32 == 0
        LongContextCache(types.SimpleNamespace(n_layers=1, n_heads=2, n_kv_heads=1, head_dim=16),
                         sparse_cfg(kv_type="Q4_0"), 256)
    huge = 1 << 33  # 2**30 blocks of 8: a layout that exists, far more than the RAM
    with pytest.raises(ConfigError, match=r"max_seq_len.*GiB"):
        LongContextCache(ARGS, dataclasses.replace(sparse_cfg(), max_seq_len=huge), huge)
    huge = 1 << 40  # 2**37 blocks: past the store's int32 block ids, refused by its layout
    with pytest.raises(ConfigError, match=r"max_seq_len=1099511627776 .*block ids are int32"):
        LongContextCache(ARGS, dataclasses.replace(sparse_cfg(), max_seq_len=huge), huge)
    # RAM that passes the check, then a reservation that fails (here: past the address space): a ConfigError
    # naming max_seq_len and the bytes, not a MemoryError (a bad_alloc) from the store's constructor
    monkeypatch.setattr("ktquest.kv.memory.available_ram", lambda: 1 << 62)
    huge = 1 << 40  # 2**30 blocks of 1024: 3 layers x 2 KV heads x 2**40 tokens x 32 x 2 x 2 bytes ~ 768 TiB
    with pytest.raises(ConfigError, match=r"max_seq_len=1099511627776 is not allowed: KVStore: reserving "
                                          r"\d+ bytes .*failed.*; lower max_seq_len"):
        lc = LongContextConfig(block_size=1024, init_windows_len=1024, local_windows_len=1024, kv_type="FP16")
        LongContextCache(ARGS, Config(mode="long_context", max_seq_len=huge, long_context=lc), huge)
    monkeypatch.undo()
    for kv_type, anchor_type, anchor_num in [("FP16", "QUEST", 2), ("FP32", "QUEST", 2), ("Q8_0", "BLOCK_MEAN", 1),
                                             ("FP16", "BLOCK_MAX", 1), ("BF16", "DYNAMIC", 3), ("Q4_0", "FIXED", 2)]:
        # the estimate is the store's own count when full (2 layers, 3 KV heads, 100 tokens = 6 blocks of 16 + 4)
        lc = LongContextConfig(kv_type=kv_type, block_size=16, anchor_type=anchor_type, anchor_num=anchor_num)
        st = KVStore(2, 3, 64, 100, block_size=16, kv_type=kv_type, anchor_type=anchor_type, anchor_num=anchor_num)
        for layer in range(2):
            st.append(layer, torch.randn(100, 3, 64), torch.randn(100, 3, 64))
        assert store_bytes(lc, 2, 3, 64, 100) == st.nbytes(), (kv_type, anchor_type)
    for kv_type, int8 in [("FP16", True), ("FP16", False), ("Q8_0", False), ("FP32", True)]:
        # the copy of the preselected candidates at its starting size: the store's own count after a step
        # over preselect_block_count candidates per KV head (2 layers, 3 KV heads, 100 blocks of 8)
        lc = LongContextConfig(kv_type=kv_type, block_size=8, preselect_block=True, preselect_block_count=40,
                               second_select_num=10, int8_candidates=int8)
        st = KVStore(2, 3, 64, 800, block_size=8, kv_type=kv_type, int8_candidates=int8)
        g = torch.Generator().manual_seed(3)
        for layer in range(2):
            st.append(layer, torch.randn(800, 3, 64), torch.randn(800, 3, 64))
            allowed = [sorted(torch.randperm(100, generator=g)[:40].tolist()) for _ in range(3)]
            st.select_attend(layer, torch.randn(9, 64), 10, "SEPARATE", allowed=allowed)
        assert candidate_copy_bytes(lc, 2, 3, 64, 800) == st.cand_nbytes() > 2 * 3 * 104 * 2 * 8 * 64, kv_type
    cache = LongContextCache(ARGS, sparse_cfg(), 256)
    q, k, v = qkv(N=40)
    with pytest.raises(ValueError, match="chunk_size"):
        cache.attend(0, q[:20], k[:20], v[:20], 0)


# ---- the hierarchical index ----


@pytest.mark.parametrize("G", [1, 2, 7])
def test_index_group_decodes_the_same_tokens(tiny, tiny_llama, G):
    """quest (4-token blocks, 4 blocks a step, every layer selecting) on the tiny model: with index_group
    the same greedy tokens and the same logits, bit for bit, as the flat scan, through ktquest.load too. With
    groups of 1 block the bound is the block's own score (plus rounding): blocks are pruned."""
    import ktquest

    cfg = preset("quest", block_size=4, init_windows_len=4, local_windows_len=16, second_select_num=4,
                 dense_layer_num=0)
    cfg = dataclasses.replace(cfg, chunk_size=32, max_seq_len=256)
    caches = [LongContextCache(tiny.args, dataclasses.replace(cfg, long_context=dataclasses.replace(
        cfg.long_context, index_group=ig)), 256) for ig in (0, G)]
    assert caches[1].store.index_group == G
    prompt = torch.arange(3, 200) * 7 % 250
    logits = [prefill(tiny, c, prompt, 32) for c in caches]
    scored = candidates = 0
    for _ in range(16):
        assert torch.equal(logits[0], logits[1])
        tok = int(logits[0].argmax())
        logits = [decode_one_token(tiny, c, tok) for c in caches]
        stats = caches[1].store.last_index_stats()
        assert stats["groups"] > 0
        scored, candidates = scored + stats["blocks_scored"], candidates + stats["candidates"]
    assert torch.equal(logits[0], logits[1])
    assert scored < candidates if G == 1 else scored <= candidates
    sets = {"max_seq_len": 256, "chunk_size": 32, "threads": 1, "long_context.block_size": 4,
            "long_context.init_windows_len": 4, "long_context.local_windows_len": 16,
            "long_context.second_select_num": 4, "long_context.dense_layer_num": 0}
    flat, indexed = (ktquest.load(tiny_llama.path, CONFIGS / "quest.yaml", **sets, **{"long_context.index_group": ig})
                     for ig in (0, G))
    assert indexed.cache.store.index_group == G
    text = "the cat sat on the mat and " * 12
    assert flat.generate(text, max_new_tokens=12) == indexed.generate(text, max_new_tokens=12)
    assert indexed.cache.store.last_index_stats()["groups"] > 0


@pytest.mark.slow
def test_index_group_on_the_bundled_model(bundled_gguf):
    """quest on SmolLM2 (real keys: a source file's 450 tokens, 8-token blocks, 16 a step past a 64-token local
    window): the same greedy reply with index_group 1 and 4; with groups of one block (bound = the block's
    score plus rounding) the last layer's pick skipped blocks."""
    import ktquest

    sets = {"max_seq_len": 1024, "threads": 2, "long_context.local_windows_len": 64,
            "long_context.second_select_num": 16}
    text = (Path(__file__).resolve().parent / "test_config.py").read_text()[:1600]
    engines = [ktquest.load(bundled_gguf, CONFIGS / "quest.yaml", **sets, **{"long_context.index_group": ig})
               for ig in (0, 1, 4)]
    replies = [e.generate(text, max_new_tokens=10) for e in engines]
    assert replies[1] == replies[0] and replies[2] == replies[0]
    stats = engines[1].cache.store.last_index_stats()
    assert stats["groups"] > 0 and stats["blocks_scored"] < stats["candidates"], stats


# ---- truncate ----


@pytest.mark.parametrize("anchor_type", ["QUEST", "BLOCK_MAX", "BLOCK_MEAN", "FIXED"])
def test_store_truncate_recomputes_partial_block_anchors(anchor_type):
    k, v = torch.randn(30, 2, 32), torch.randn(30, 2, 32)
    a, b = (KVStore(2, 2, 32, 100, 8, "FP16", anchor_type, 3 if anchor_type == "FIXED" else 2) for _ in range(2))
    a.append(1, k, v)
    a.truncate(-1, 21)
    b.append(1, k[:21], v[:21])
    (x, cx), (y, cy) = a.anchors(1), b.anchors(1)
    assert a.length(1) == 21 and torch.equal(cx, cy)
    for h in range(2):
        for blk in range(3):
            n = int(cx[h, blk])
            assert torch.equal(x[h, blk, :n], y[h, blk, :n])
    torch.testing.assert_close(a.read_range(1, 4, 21)[1], b.read(1)[1][4:])
    with pytest.raises(IndexError):
        a.truncate(0, 50)


@pytest.mark.parametrize("keep", [30, 3])  # 3: inside the init window, nothing to refill
def test_cache_truncate_then_continue_equals_dense(keep):
    q, k, v = qkv(N=90)
    cfg = full_budget("quest", kv_type="FP32")
    cache = LongContextCache(ARGS, cfg, 256)
    run(cache, q, k, v, 16, 80, n_layers=3)
    assert cache.init_end > 3
    cache.truncate(keep)  # before the local window: the device window is refilled from the store
    out = []
    for pos in range(keep, 45):
        for layer in range(3):
            o = cache.attend(layer, q[pos: pos + 1], k[pos: pos + 1], v[pos: pos + 1], pos)
            if layer == 0:
                out.append(o)
    torch.testing.assert_close(torch.cat(out), dense_ref(q[:45], k[:45], v[:45])[keep:45], atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("layer", [0, 1])  # the cut chunk's pass stops in the first layer, or the last
def test_ctrl_c_in_prefill_keeps_whole_chunks_and_continues_as_dense(tiny, layer):
    """Prefill interrupted in its 3rd chunk: the store keeps the chunks read whole (what the cut pass appended
    to its first layers is dropped), and reading on from there decodes dense's tokens."""
    from ktquest.config import GenerationConfig
    from ktquest.generate import generate
    from ktquest.sequence import Sequence

    class Interrupting(LongContextCache):
        calls = 0

        def attend(self, layer_idx, q, k, v, start_pos):
            out = super().attend(layer_idx, q, k, v, start_pos)
            if layer_idx == layer and q.shape[0] > 1:
                Interrupting.calls += 1
                if Interrupting.calls == 3:
                    raise KeyboardInterrupt
            return out

    a = tiny.args
    assert a.n_layers == 2
    cache = Interrupting(a, full_budget("quest", block_size=4, kv_type="FP32"), 256)
    prompt = (torch.arange(3, 60) * 7 % 250).tolist()
    gen = GenerationConfig(max_new_tokens=6)
    seq = Sequence(cache)
    res = generate(tiny, seq, prompt, gen, set(), chunk_size=16)
    kept = 32 if layer == 0 else 48
    assert (res.stopped_by, res.n_prompt, cache.pos, seq.ids) == ("interrupted", kept, kept, prompt[:kept])
    assert all(cache.store.length(i) == kept for i in range(a.n_layers))
    rest = generate(tiny, seq, prompt[kept:], gen, set(), chunk_size=16)
    full = generate(tiny, Sequence(DenseKVCache(a.n_layers, a.n_kv_heads, a.head_dim, 256)), prompt, gen, set(), 16)
    assert rest.tokens == full.tokens


# ---- chat ----


def test_chat_two_turns_long_context_equals_dense(tiny_llama):
    import ktquest

    sets = {"max_seq_len": 256, "chunk_size": 16, "threads": 1, "max_new_tokens": 6}
    dense = ktquest.load(tiny_llama.path, **sets)
    lc = {"block_size": 4, "init_windows_len": 4, "local_windows_len": 8, "second_select_num": 1000, "kv_type": "FP32"}
    sparse = ktquest.load(tiny_llama.path, mode="long_context", **sets, **{f"long_context.{k}": v for k, v in lc.items()})
    assert isinstance(sparse.cache, LongContextCache)
    a, b = dense.chat_session(document="a b c d " * 10), sparse.chat_session(document="a b c d " * 10)
    for text in ("hello there", "and again"):
        ra, rb = a.send(text), b.send(text)
        assert ra.text == rb.text
        assert ra.stats.context_tokens == rb.stats.context_tokens == sparse.cache.store.length(0)


def test_prompt_longer_than_max_seq_len_is_refused_before_work(tiny_llama):
    import ktquest
    from ktquest.engine import PromptTooLongError

    eng = ktquest.load(tiny_llama.path, mode="long_context", max_seq_len=32, threads=1,
                       **{"long_context.block_size": 4, "long_context.init_windows_len": 4,
                          "long_context.local_windows_len": 8})
    with pytest.raises(PromptTooLongError, match="prompt too long"):
        eng.generate("the cat sat on the mat " * 20)
    assert eng.cache.pos == 0 and eng.cache.store.length(0) == 0


def test_a_truncate_inside_the_local_window_keeps_every_position_attended():
    """Truncated to a point the window buffer still holds, but whose local window starts before the buffer
    does: a short chunk after it attends every position once (the ones before the buffer come back from the
    store), as dense attention does."""
    cfg = full_budget("quest", kv_type="FP32")  # 8-token blocks, init 5, local 20, chunk 16
    q, k, v = qkv(N=120)
    cache = LongContextCache(ARGS, cfg, 256)
    run(cache, q[:100], k[:100], v[:100], 16, 64, n_layers=ARGS.n_layers)  # 64 prefilled, 36 decoded
    n = cache.windows.buf0 + 1
    assert cache.windows.local_start(n) < cache.windows.buf0 < n
    cache.truncate(n)
    out = [cache.attend(i, q[n: n + 3], k[n: n + 3], v[n: n + 3], n) for i in range(ARGS.n_layers)][0]
    torch.testing.assert_close(out, dense_ref(q[: n + 3], k[: n + 3], v[: n + 3])[n:], atol=TOL["FP32"],
                               rtol=TOL["FP32"])


@pytest.mark.parametrize("cut", ["truncate", "no truncate", "before the store"])
def test_a_pass_cut_after_it_compacted_the_windows_leaves_every_position_attended(cut):
    """A prompt's pass compacts the window buffer up to its own local window, past the local window of the
    positions held before it. Cut in its first layer (Ctrl-C: generate truncates to the tokens held; or an
    error no one truncates after, after or before the layer stored the chunk), a shorter pass from the same
    position then attends every position once, as dense attention does."""
    cfg = full_budget("quest", kv_type="FP32")  # 8-token blocks, init 5, local 20, chunk 16
    q, k, v = qkv(N=90)
    cache = LongContextCache(ARGS, cfg, 256)
    run(cache, q[:64], k[:64], v[:64], 16, 64, n_layers=ARGS.n_layers)
    if cut == "before the store":
        cache.begin_pass(64, 16)  # the pass's geometry, then an error in layer 0's attention
    else:
        cache.attend(0, q[64:80], k[64:80], v[64:80], 64)  # layer 0 only: the pass is cut there
    assert cache.windows.buf0 > cache.windows.local_start(64)
    if cut == "truncate":
        cache.truncate(64)
    out = [cache.attend(i, q[64:67], k[64:67], v[64:67], 64) for i in range(ARGS.n_layers)][0]
    want = dense_ref(q[:67], k[:67], v[:67])[64:]
    torch.testing.assert_close(out, want, atol=TOL["FP32"], rtol=TOL["FP32"])


# ---- retune, and rewinds that keep the prompt's queries ----


def _tiny_cfg(name: str, **lc) -> Config:
    cfg = preset(name, block_size=4, init_windows_len=4, local_windows_len=16, second_select_num=6, kv_type="FP16",
                 int8_candidates=False, **lc)
    return dataclasses.replace(cfg, chunk_size=32, max_seq_len=256)


@pytest.mark.parametrize("name", ["quest", "snapkv"])
@pytest.mark.parametrize("native", [True, False])
def test_rerank_reaches_the_store_on_the_forward_pass(tiny, name, native):
    """long_context.rerank through the model's forward pass, on the native per-layer step (decode_native ->
    step_plan) and on torch's (decode_context -> select_attend, as off the CPU): the store runs the second stage
    (its time is reported) and picks other blocks than the anchors' top k alone."""
    picks, staged = {}, {}
    prompt = torch.arange(3, 180) * 7 % 250
    for rr in (1, 4):
        cache = LongContextCache(tiny.args, _tiny_cfg(name, preselect_block_count=24, dense_layer_num=0, rerank=rr), 256)
        cache.shape = dataclasses.replace(cache.shape, native_decode=native)
        logits, seen, ran = prefill(tiny, cache, prompt, 32), [], []
        for _ in range(8):
            logits = decode_one_token(tiny, cache, int(logits.argmax()))
            seen += [cache.selection(i).ids.clone() for i in range(tiny.args.n_layers)]
            ran.append(cache.store.last_timing()["rerank_ms"] > 0)
        picks[rr], staged[rr] = seen, ran
    assert all(staged[4]) and not any(staged[1])
    assert any(not torch.equal(a, b) for a, b in zip(picks[1], picks[4]))


@pytest.mark.parametrize("name", ["quest", "snapkv"])
def test_retune_decodes_as_a_cache_loaded_with_the_knobs(tiny, name):
    """A filled cache retuned (second_select_num, sticky_blocks, dense_layer_num, rerank) decodes bit for bit as one
    loaded with those knobs and fed the same prompt; retuned back, as one loaded with the first; a knob the
    prompt was read with (block_size) is refused, naming it."""
    base = _tiny_cfg(name, preselect_block_count=12)
    knobs = dict(second_select_num=3, sticky_blocks=2, dense_layer_num=0, rerank=3)
    other = dataclasses.replace(base, long_context=dataclasses.replace(base.long_context, **knobs))
    prompt = torch.arange(3, 180) * 7 % 250
    a, b, c = (LongContextCache(tiny.args, cfg, 256) for cfg in (base, other, base))
    la, lb, lc = (prefill(tiny, x, prompt, 32) for x in (a, b, c))
    old = a.retune(other.long_context)
    assert old == base.long_context and a.store.sticky_blocks == 2 and a.lc.rerank == 3
    for _ in range(10):
        assert torch.equal(la, lb)
        tok = int(lb.argmax())
        la, lb = decode_one_token(tiny, a, tok), decode_one_token(tiny, b, tok)
    assert torch.equal(la, lb)
    a.retune(old)
    a.truncate(len(prompt) - 1)  # the same last prompt token read again (a chunk of 1: other rounding), as c
    la = prefill(tiny, a, prompt[-1:], 32)
    for _ in range(6):
        torch.testing.assert_close(la, lc, atol=1e-4, rtol=1e-4)
        tok = int(lc.argmax())
        la, lc = decode_one_token(tiny, a, tok), decode_one_token(tiny, c, tok)
    with pytest.raises(ConfigError, match="long_context.block_size is not a decode-time knob"):
        a.retune(dataclasses.replace(a.lc, block_size=8))


def test_retuned_preselection_answers_a_prompt_read_again_as_a_loaded_cache(tiny):
    """quest retuned to Ada-SnapKV's knobs (preselect_block, its count, ada_budget) after a reply, the
    question's last token read again: the candidates, the logits and the tokens of a cache loaded with them
    that did the same, bit for bit; retuned back, none."""
    base = _tiny_cfg("quest", dense_layer_num=0)
    knobs = dict(preselect_block=True, preselect_block_count=10, ada_budget=True, sticky_blocks=1, preselect_refresh=3)
    other = dataclasses.replace(base, long_context=dataclasses.replace(base.long_context, **knobs))
    prompt = torch.arange(3, 170) * 13 % 250
    a, c = LongContextCache(tiny.args, base, 256), LongContextCache(tiny.args, other, 256)
    for x in (a, c):
        prefill(tiny, x, prompt, 32)
        for tok in (5, 9, 11):
            decode_one_token(tiny, x, tok)
    a.retune(other.long_context)
    la, lc = (prefill(tiny, x, prompt[-1:], 32) for x in (a.truncate(len(prompt) - 1) or a,
                                                            c.truncate(len(prompt) - 1) or c))
    for _ in range(8):
        assert torch.equal(la, lc)
        tok = int(lc.argmax())
        la, lc = decode_one_token(tiny, a, tok), decode_one_token(tiny, c, tok)
        for layer in range(tiny.args.n_layers):
            assert a.candidates(layer) is not None and torch.equal(a.candidates(layer), c.candidates(layer))
    assert a.stats.refresh_calls > 0 and a.stats.refresh_calls == c.stats.refresh_calls
    a.retune(base.long_context)
    decode_one_token(tiny, a, 7)
    assert all(a.candidates(layer) is None for layer in range(tiny.args.n_layers))


@pytest.mark.parametrize("cut", [1, 5, 40])
def test_a_rewound_prompt_preselects_as_when_read_whole(tiny, cut):
    """SnapKV scores the context with the prompt's last preselect_window queries: rewound by ``cut`` tokens
    after a reply and read on, the prompt keeps the queries before the cut, so the candidates and the
    logits are those of the prompt read whole."""
    cfg = _tiny_cfg("snapkv", preselect_block_count=10, preselect_window=8, dense_layer_num=0)
    prompt = torch.arange(3, 190) * 11 % 250
    a, b = LongContextCache(tiny.args, cfg, 256), LongContextCache(tiny.args, cfg, 256)
    prefill(tiny, a, prompt, 32)
    for tok in (5, 9, 11):
        decode_one_token(tiny, a, tok)
    a.truncate(len(prompt) - cut)
    la, lb = prefill(tiny, a, prompt[-cut:], 32), prefill(tiny, b, prompt, 32)
    la, lb = decode_one_token(tiny, a, int(lb.argmax())), decode_one_token(tiny, b, int(lb.argmax()))
    selecting = range(cfg.long_context.dense_layer_num, tiny.args.n_layers)
    assert len(selecting) > 0
    for layer in selecting:
        assert torch.equal(a.candidates(layer), b.candidates(layer))
    torch.testing.assert_close(la, lb, atol=1e-4, rtol=1e-4)
