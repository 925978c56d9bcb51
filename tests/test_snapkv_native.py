"""SnapKV's scores read in place by the store (``KVStore.snapkv_scores``, cpp/select/snapkv.h) against their torch
twin (``snapkv_token_scores`` + ``block_scores_from_tokens`` on an fp32 copy of the keys), both kernel twins; and
the candidates a long-context cache chooses as each layer finishes a prompt, against today's torch preselection:
every preset that preselects, both prefill orders, Gemma 3's global layers, a prompt that ends mid-chunk."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch

from ktquest.config import load_config
from ktquest.generate import decode_one_token, prefill
from ktquest.kv.selection import (
    block_scores_from_tokens,
    preselect_blocks,
    snapkv_preselect,
    snapkv_token_scores,
)
from ktquest.models.loader import load_model
from ktquest.native.store import KVStore

CONFIGS = Path(__file__).resolve().parent.parent / "configs"


def filled_store(kv_type: str, KVH: int, D: int, N: int, bs: int, threads: int = 2, seed: int = 0) -> KVStore:
    g = torch.Generator().manual_seed(seed)
    st = KVStore(1, KVH, D, N + 64, bs, kv_type, "QUEST", 2, threads)
    k = torch.randn(N, KVH, D, generator=g)
    k[:, :, :4] += 3 * torch.randn(N, 1, 1, generator=g)  # keys that share a direction: scores spread widely
    st.append(0, k, torch.randn(N, KVH, D, generator=g))
    return st


def torch_twin(st: KVStore, q, q_pos0, n_keys, n_blocks, pool=7, merge="mean"):
    k = st.read_keys(0, 0, n_keys)
    return block_scores_from_tokens(snapkv_token_scores(q, k, q_pos0, pool, merge), st.block_size, n_blocks)


CASES = [  # KVH, G, D, N, block_size, kv_type, W, pool, merge, q_pos0 (None: the window ends at N), n_blocks
    (2, 3, 64, 1000, 16, "FP16", 32, 7, "mean", None, 62),
    (3, 3, 64, 777, 8, "Q8_0", 20, 7, "max", None, 97),  # a partial last block scored
    (1, 2, 16, 300, 64, "FP32", 32, 1, "mean", None, 5),
    (2, 1, 8, 100, 4, "BF16", 100, 5, "max", None, 25),  # the window is every key
    (4, 4, 128, 2100, 16, "Q4_0", 32, 7, "mean", None, 120),
    (2, 4, 32, 640, 8, "FP16", 16, 13, "mean", 500, 80),  # keys past the window: no query sees them
    (1, 8, 24, 90, 4, "FP32", 7, 3, "max", 40, 23),  # D % 8 != 0 with AVX2: the scalar twin
]


@pytest.mark.parametrize("force_scalar", [False, True], indirect=True)
@pytest.mark.parametrize("case", CASES)
def test_scores_and_picks_equal_the_torch_twin(force_scalar, case):
    KVH, G, D, N, bs, kv_type, W, pool, merge, q_pos0, nb = case
    st = filled_store(kv_type, KVH, D, N, bs)
    q = torch.randn(W, KVH * G, D, generator=torch.Generator().manual_seed(1))
    q_pos0 = N - W if q_pos0 is None else q_pos0
    got = st.snapkv_scores(0, q, q_pos0, N, nb, pool, merge)
    want = torch_twin(st, q, q_pos0, N, nb, pool, merge)
    assert got.shape == (KVH, nb) and got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=2e-5, atol=1e-7)
    for count, ada in ((nb // 4, False), (nb // 3, True)):
        a = preselect_blocks(got, count, ada=ada, exclude=[(0, 1)])
        b = preselect_blocks(want, count, ada=ada, exclude=[(0, 1)])
        assert [x.tolist() for x in a] == [x.tolist() for x in b]


def test_threads_give_the_same_bits():
    one, two = filled_store("FP16", 2, 64, 3000, 8, threads=1), filled_store("FP16", 2, 64, 3000, 8, threads=2)
    q = torch.randn(32, 6, 64)
    assert torch.equal(one.snapkv_scores(0, q, 2968, 3000, 370), two.snapkv_scores(0, q, 2968, 3000, 370))


@pytest.mark.parametrize("seed", range(4))
def test_equal_blocks_tie_and_the_lower_block_wins(seed):
    """Blocks 3 and 9 hold the same keys, scored alone by the window (the rest zero keys): equal scores, as in the
    twin, and a pick of one takes block 3."""
    KVH, D, bs, N = 1, 16, 8, 200
    k = torch.zeros(N, KVH, D)
    g = torch.Generator().manual_seed(seed)
    spike = torch.randn(bs, KVH, D, generator=g)
    k[3 * bs: 4 * bs], k[9 * bs: 10 * bs] = spike, spike
    st = KVStore(1, KVH, D, 256, bs, "FP32", "QUEST", 2, 2)
    st.append(0, k, torch.randn(N, KVH, D, generator=g))
    q = spike.mean(0, keepdim=True).expand(8, 2, D).contiguous() * 8  # [W, H, D]
    got = st.snapkv_scores(0, q, N - 8, N, 20, pool_kernel=1)
    assert got[0, 3] == got[0, 9] and got[0, 3] > got[0, 5]
    want = torch_twin(st, q, N - 8, N, 20, pool=1)
    assert want[0, 3] == want[0, 9]
    assert preselect_blocks(got, 1)[0].tolist() == preselect_blocks(want, 1)[0].tolist() == [3]


@pytest.mark.parametrize("change, match", [
    (dict(q=torch.randn(4, 3, 16)), "q heads|multiple of n_kv_heads"),
    (dict(q_pos0=99), r"the window of 4 queries from q_pos0=99 is not inside the keys \[0, 100\)"),
    (dict(n_keys=101), "n_keys=101 is not inside the layer's 100 tokens"),
    (dict(n_blocks=14), r"n_blocks=14 is not allowed: 0..ceil\(n_keys / block_size\) = 13"),
    (dict(pool=4), r"pool=4 is not allowed: an odd integer in \[1, 255\]"),
    (dict(pool=257), r"pool=257 is not allowed"),
    (dict(q=torch.randn(8193, 4, 16)), r"a window of 8193 queries is not allowed: 1 <= W and W x 2 query heads a KV "
                                       r"head <= 16384"),
    (dict(q_pos0=2**63 - 2), r"the window of 4 queries from q_pos0=9223372036854775806 is not inside"),
    (dict(q=torch.full((4, 4, 16), float("nan"))), "non-finite|NaN|finite"),
    (dict(q=torch.randn(4, 4, 8)), r"q: expected shape \[\*, \*, 16\]"),
    (dict(q=torch.randn(4, 4, 16).double()), "q"),
    (dict(merge="sum"), "gqa_merge='sum' is not allowed"),
])
def test_bad_requests_are_refused_naming_the_field(change, match):
    st = filled_store("FP32", 2, 16, 100, 8)
    args = dict(q=torch.randn(4, 4, 16), q_pos0=96, n_keys=100, n_blocks=13, pool=7, merge="mean") | change
    with pytest.raises((ValueError, TypeError), match=match):
        st.snapkv_scores(0, args["q"], args["q_pos0"], args["n_keys"], args["n_blocks"], args["pool"], args["merge"])
    with pytest.raises((ValueError, IndexError)):
        st.snapkv_scores(3, torch.randn(4, 4, 16), 96, 100, 13)  # no layer 3


# ---- the cache: candidates chosen as the prompt is read ----


def torch_candidates(cache, layer: int) -> torch.Tensor:
    """Today's torch preselection of ``layer`` by the cache's recorded queries (kv/plan.py before the store
    scored them): the keys copied out, SnapKV's scores in torch, the same picks."""
    pl, lc = cache.planner, cache.lc
    a, b = pl.q_win_span
    nb = min(cache.first_decode_lb(b), b // lc.block_size)
    qw = pl.q_win[layer, pl.q_win.shape[1] - (b - a):].float()
    tokens = snapkv_token_scores(qw, cache.store.read_keys(layer, 0, b), a, lc.preselect_pool_kernel,
                                 lc.ada_gqa_merge)
    sets = snapkv_preselect(block_scores_from_tokens(tokens, lc.block_size, nb), lc, exclude=[(0, pl.ib)])
    out = torch.full((len(sets), max(1, max(len(s) for s in sets))), -1, dtype=torch.int32)
    for i, s in enumerate(sets):
        out[i, : len(s)] = s.to(torch.int32)
    return out


def small(name: str, order: str = "chunk", **lc):
    over = [("long_context.block_size", 4), ("long_context.init_windows_len", 5),
            ("long_context.local_windows_len", 12), ("long_context.kv_type", "FP16"),
            ("long_context.preselect_block_count", 6), ("long_context.second_select_num", 3),
            ("long_context.dense_layer_num", 1), ("chunk_size", 16), ("max_seq_len", 256),
            ("prefill.order", order)] + [(f"long_context.{k}", v) for k, v in lc.items()]
    return load_config(CONFIGS / f"{name}.yaml", over)


def check_read_candidates(model, cache, prompts, order):
    """Each prompt read (then a decode step): every sparse layer's candidates are there once the prompt is in,
    before any decode step, equal to today's torch preselection; the decode step chooses none."""
    n_layers = cache.n_layers
    for prompt in prompts:
        before = cache.stats.preselect_calls
        logits = prefill(model, cache, prompt, 16, order=order)
        sparse = range(cache.lc.dense_layer_num, n_layers)
        assert cache.stats.preselect_calls == before + len(sparse)
        assert not any(cache.planner.presel_pending[i] for i in sparse)
        for layer in sparse:
            assert torch.equal(cache.candidates(layer), torch_candidates(cache, layer)), layer
        for layer in range(cache.lc.dense_layer_num):
            assert cache.candidates(layer) is None
        decode_one_token(model, cache, int(logits.argmax()))
        assert cache.stats.preselect_calls == before + len(sparse)  # the first decode step only used them


# 157 = 9 x 16 + 13 tokens: ends mid-chunk; 17 = 16 + 1: its last token is a chunk of one (also in layer order)
PROMPTS = [torch.arange(3, 160) * 7 % 250, torch.arange(9, 50) * 11 % 250, torch.arange(2, 19) * 5 % 250]


# (million.yaml reads its prompts sparsely, which only chunk order does: the config refuses the layer order)
@pytest.mark.parametrize("name, order", [(n, o) for n in ("snapkv", "ada_snapkv", "ktransformers", "million")
                                         for o in ("chunk", "layer") if (n, o) != ("million", "layer")])
def test_candidates_are_chosen_as_the_prompt_is_read(tiny_llama, name, order):
    model, _ = load_model(tiny_llama.path)
    cfg = small(name, order)
    from ktquest.kv.long_context import LongContextCache

    cache = LongContextCache(model.args, cfg, 256)
    check_read_candidates(model, cache, PROMPTS, order)


def test_a_window_over_several_passes(tiny_llama):
    """A prompt of 163 tokens (its last chunk 3), then 5 more read at once after it: the window's 32 queries span
    the last chunks and the two prompts; the candidates of each are today's torch preselection's."""
    model, _ = load_model(tiny_llama.path)
    from ktquest.kv.long_context import LongContextCache

    cache = LongContextCache(model.args, small("snapkv"), 256)
    for n, prompt in enumerate((torch.arange(3, 166) * 5 % 250, torch.arange(1, 6) * 3 % 250)):
        prefill(model, cache, prompt, 16)
        assert cache.planner.q_win_span == (cache.pos - 32, cache.pos)
        assert cache.stats.preselect_calls == (n + 1) * (cache.n_layers - 1)
        for layer in range(1, cache.n_layers):
            assert torch.equal(cache.candidates(layer), torch_candidates(cache, layer))


def test_gemma3_global_layers(tiny_gemma3):
    model, _ = load_model(tiny_gemma3.path)
    from ktquest.engine import make_cache

    cfg = dataclasses.replace(small("snapkv", dense_layer_num=0), max_seq_len=128)
    cache = make_cache(cfg, model.args, 128, torch.device("cpu"), torch.float32)
    main = cache.main
    prompt = torch.arange(3, 100) * 7 % model.args.vocab_size
    logits = prefill(model, cache, prompt, 16)
    sparse = range(main.lc.dense_layer_num, main.n_layers)
    assert main.stats.preselect_calls == len(sparse) > 0
    for layer in sparse:
        assert torch.equal(main.candidates(layer), torch_candidates(main, layer))
    decode_one_token(model, cache, int(logits.argmax()))
    assert main.stats.preselect_calls == len(sparse)


def test_retuned_candidates_are_chosen_at_the_next_decode_step(tiny_llama):
    """A retune of SnapKV's count: no prompt is read, so the next decode step preselects (the store's scores),
    as the torch preselection would."""
    model, _ = load_model(tiny_llama.path)
    from ktquest.kv.long_context import LongContextCache

    cache = LongContextCache(model.args, small("snapkv"), 256)
    logits = prefill(model, cache, PROMPTS[0], 16)
    cache.retune(dataclasses.replace(cache.lc, preselect_block_count=4))
    want = [torch_candidates(cache, layer) for layer in range(cache.n_layers)]
    decode_one_token(model, cache, int(logits.argmax()))
    for layer in range(1, cache.n_layers):
        got = cache.candidates(layer)
        assert got is not None and np.array_equal(got[:, : want[layer].shape[1]].numpy(), want[layer].numpy())


# small blocks and windows for the tiny llama through ktquest.load (as small() does for a cache)
ENGINE_SETS = {"long_context.block_size": 4, "long_context.init_windows_len": 5, "long_context.local_windows_len": 12,
               "long_context.preselect_block_count": 6, "long_context.dense_layer_num": 1,
               "long_context.kv_type": "FP16", "chunk_size": 16, "max_seq_len": 256}


def test_a_question_after_a_kv_file_load(tiny_llama, tmp_path):
    """A document saved, loaded by another engine, then a question read after it (as ``--load-kv`` does): the
    question's read ends in the preselection, whose candidates are today's torch preselection's."""
    import ktquest

    a = ktquest.load(tiny_llama.path, CONFIGS / "snapkv.yaml", threads=1, max_new_tokens=4, **ENGINE_SETS)
    s = a.chat_session(document="The keeper painted the door green. " * 6)
    s.read_document()
    s.save(tmp_path / "doc.kvq")
    b = ktquest.load(tiny_llama.path, CONFIGS / "snapkv.yaml", threads=1, max_new_tokens=4, **ENGINE_SETS)
    b.load_session(tmp_path / "doc.kvq")
    cache, n = b.cache, b.cache.stats.preselect_calls
    prefill(b.model, cache, torch.arange(5, 19) * 3 % 250, 16)
    assert cache.stats.preselect_calls == n + cache.n_layers - 1
    for layer in range(1, cache.n_layers):
        assert torch.equal(cache.candidates(layer), torch_candidates(cache, layer))


def test_the_candidates_copies_are_made_as_the_prompt_is_read(tiny_llama):
    """The store's copies of the candidates (anchor rows, K/V tiles) exist once the prompt is in, keyed as the
    first decode step asks: that step finds them and copies nothing."""
    model, _ = load_model(tiny_llama.path)
    from ktquest.kv.long_context import LongContextCache

    cache = LongContextCache(model.args, small("snapkv"), 256)
    assert cache.store.cand_nbytes() == cache.store.cand_copies() == 0
    logits = prefill(model, cache, PROMPTS[0], 16)
    copies = cache.store.cand_copies()
    assert cache.store.cand_nbytes() > 0 and copies >= 2 * sum(  # anchor rows and tiles of every candidate
        int((cache.candidates(layer) >= 0).sum()) for layer in range(1, cache.n_layers))
    decode_one_token(model, cache, int(logits.argmax()))
    assert cache.store.cand_copies() == copies


def test_cache_candidates_refuses_bad_lists():
    st = filled_store("FP32", 2, 16, 100, 8)
    excl = np.array([[0, 1], [10, 100]], np.int64)
    with pytest.raises((ValueError, IndexError), match="block id 40 is out of range|out of range"):
        st.cache_candidates(0, np.array([[2, 40], [3, 4]], np.int32), excl)
    with pytest.raises(ValueError, match="allowed: expected shape"):
        st.cache_candidates(0, np.array([[2, 3]], np.int32), excl)
    st.cache_candidates(0, np.array([[2, 3], [3, 4]], np.int32), excl)
    assert st.cand_nbytes() > 0


def test_a_document_read_alone_leaves_the_choice_to_what_follows(tiny_llama):
    """``Engine.read`` (a document before any message): no SnapKV pass at its end; the question read after it
    chooses the candidates, once."""
    import ktquest

    eng = ktquest.load(tiny_llama.path, CONFIGS / "snapkv.yaml", threads=1, max_new_tokens=2, **ENGINE_SETS)
    s = eng.chat_session(document="The keeper painted the door green. " * 6)
    s.read_document()
    cache = eng.cache
    assert cache.stats.preselect_calls == 0 and all(cache.candidates(i) is None for i in range(cache.n_layers))
    s.send("What colour?")
    assert cache.stats.preselect_calls == cache.n_layers - 1


def test_an_interrupted_layer_major_prompt_leaves_the_planner_as_it_was(tiny_llama):
    """A layer-major prompt stopped after some layers chose their candidates: the planner keeps the last
    prompt's window, candidates and statistics; read again whole, the prompt chooses today's torch picks."""
    model, _ = load_model(tiny_llama.path)
    from ktquest.kv.long_context import LongContextCache

    cache = LongContextCache(model.args, small("snapkv", "layer", dense_layer_num=0), 256)
    logits = prefill(model, cache, PROMPTS[0], 16, order="layer")
    decode_one_token(model, cache, int(logits.argmax()))
    pl = cache.planner
    span, calls = pl.q_win_span, cache.stats.preselect_calls
    before = [None if c is None else c.clone() for c in map(cache.candidates, range(cache.n_layers))]
    q_win = pl.q_win.clone()
    seen, staged = [], []

    def stop(done, total):  # in layer 1's first chunk: layer 0 chose its candidates (staged)
        seen.append(done)
        if len(seen) == 3 + 1:
            staged.extend(pl._staged)
            raise KeyboardInterrupt

    prompt = torch.arange(4, 52) * 3 % 250  # 48 tokens: 3 chunks a layer
    with pytest.raises(KeyboardInterrupt):
        prefill(model, cache, prompt, 16, on_progress=stop, order="layer")
    cache.truncate(cache.pos)  # (as the engine's sequence rewinds to what it holds)
    assert staged == [0]
    assert pl.q_win_span == span and torch.equal(pl.q_win, q_win) and not pl._staged
    assert cache.stats.preselect_calls == calls
    for layer in range(cache.n_layers):
        assert (before[layer] is None and cache.candidates(layer) is None) or torch.equal(cache.candidates(layer),
                                                                                          before[layer])
    check_read_candidates(model, cache, [prompt], "layer")
