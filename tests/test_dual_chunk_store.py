"""Dual chunk attention with the long-context cache (kv/long_context_pass.py attend_layer_dca, the store's query
rotations): on the tiny qwen2 whose file carries dual chunk keys (chunks of 24 positions: three chunks in a
hundred tokens), every preset with a budget that covers the context equals dense DCA, in both prefill orders
and through decode steps; with a small budget each layer's picks are the top blocks by the score of the rotation
the paper gives each block's chunk, computed here from the stored keys' min and max."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import TINY_SPECS, build_hf_model, gguf_metadata, hf_to_gguf_tensors, write_gguf

from ktquest.config import ConfigError, load_config
from ktquest.engine import make_cache
from ktquest.generate import decode_one_token, prefill
from ktquest.kv.dense import DenseKVCache
from ktquest.models.dual_chunk import DualChunk
from ktquest.models.loader import load_model
from ktquest.native.decode import NativeDecoder

CONFIGS = Path(__file__).resolve().parent.parent / "configs"
C, W = 32, 8  # chunk_size, local_size: chunks of L = 24 positions (3 blocks of 8)
DC = DualChunk(C, W)
TOKENS = torch.arange(3, 103) * 7 % 250  # 100 tokens: positions in chunks 0-4


@pytest.fixture(scope="module")
def dca_file(tmp_path_factory, tiny_bpe):
    spec = TINY_SPECS["qwen2"]
    hf = build_hf_model(spec, len(tiny_bpe.tokens))
    tensors, md = hf_to_gguf_tensors(hf, spec), gguf_metadata(spec, len(tiny_bpe.tokens))
    keys = {"qwen2.dual_chunk_attention.chunk_size": C, "qwen2.dual_chunk_attention.local_size": W}
    return write_gguf(tmp_path_factory.mktemp("dca") / "dca.gguf", "qwen2", md | keys, tensors, tiny_bpe)


def config(name: str, order: str = "chunk", prefill: dict | None = None, **lc):
    over = [("long_context.block_size", 8), ("long_context.init_windows_len", 8),
            ("long_context.local_windows_len", 16), ("long_context.second_select_num", 64),
            ("long_context.preselect_block_count", 64), ("long_context.sticky_blocks", 0),
            ("long_context.kv_type", "FP32"),
            ("chunk_size", 16), ("max_seq_len", 128), ("prefill.order", order)]
    over += [(f"prefill.{k}", v) for k, v in (prefill or {}).items()]
    return load_config(CONFIGS / f"{name}.yaml", over + [(f"long_context.{k}", v) for k, v in lc.items()])


def run(model, cache, order: str, prompt: int = 70) -> torch.Tensor:
    """A prompt of ``prompt`` tokens (then the rest of TOKENS as decode steps): the logits of every decoded
    position [100 - prompt + 1, V]."""
    with torch.inference_mode():
        out = [prefill(model, cache, TOKENS[:prompt], 16, order=order)]
        out += [decode_one_token(model, cache, int(t)) for t in TOKENS[prompt:]]
    return torch.stack(out)


def dense(model, prompt: int = 70) -> torch.Tensor:
    a = model.args
    return run(model, DenseKVCache(a.n_layers, a.n_kv_heads, a.head_dim, 128, dual_chunk=a.dual_chunk), "chunk",
               prompt)


@pytest.fixture(scope="module")
def model(dca_file):
    m, _ = load_model(dca_file, max_seq_len=128, encoded=True)
    m.decoder = NativeDecoder.build(m, threads=2)
    assert m.args.dual_chunk == DC
    return m


@pytest.mark.parametrize("name, order", [("quest", "chunk"), ("quest", "layer"), ("snapkv", "chunk"),
                                         ("ada_snapkv", "layer"), ("ktransformers", "chunk"), ("million", "chunk"),
                                         ("ada_quest", "layer")])
def test_a_covering_budget_equals_dense_dca(model, name, order):
    """Prompts of 70 tokens (chunks 0-2; the layer-major read and the chunk passes across chunk edges) and 37
    (decode steps then cross two edges), every block attended: dense DCA's logits."""
    cfg = config(name, order)
    for prompt in (70, 37):
        cache = make_cache(cfg, model.args, 128, torch.device("cpu"), torch.float32)
        assert cache.dual_chunk == DC
        torch.testing.assert_close(run(model, cache, order, prompt), dense(model, prompt), atol=2e-4, rtol=2e-4)


def quest_scores(cache, layer: int, qv: torch.Tensor, pos: int) -> torch.Tensor:
    """QUEST's score of every block for the decode query at ``pos`` from its rotations qv [3, H, D], each block by
    the rotation the paper gives its chunk (the same chunk: intra, the one before: successive, earlier: inter),
    from the min and max of the block's stored keys: [KVH, n_blocks]."""
    bs, n = cache.lc.block_size, DC.length
    k, _ = cache.store.read(layer)  # [N, KVH, D]
    nb = k.shape[0] // bs
    blocks = k[: nb * bs].view(nb, bs, *k.shape[1:])
    lo, hi = blocks.amin(1), blocks.amax(1)  # [nb, KVH, D]
    ci, cb = pos // n, torch.arange(nb) * bs // n
    rot = torch.where(cb == ci, 0, torch.where(cb == ci - 1, 1, 2))  # [nb]
    kvh = k.shape[1]
    q = qv[rot].view(nb, kvh, -1, k.shape[2])  # [nb, KVH, G, D]
    return torch.maximum(q * lo[:, :, None], q * hi[:, :, None]).sum((2, 3)).t()  # [KVH, nb]


def test_a_small_budget_picks_by_each_blocks_rotation(model):
    """quest with 3 blocks a KV head: at decode steps in chunks 2-4 every sparse layer's picks are the top 3 of
    the context blocks by the rotation-aware QUEST scores of its query."""
    cfg = config("quest", second_select_num=3, dense_layer_num=1)
    cache = make_cache(cfg, model.args, 128, torch.device("cpu"), torch.float32)
    seen = {}
    attend = cache.attend

    def spy(layer, q, k, v, start):
        seen[layer] = q[:, -1].clone()  # [3, H, D]
        return attend(layer, q, k, v, start)

    cache.attend = spy
    checked = 0
    with torch.inference_mode():
        prefill(model, cache, TOKENS[:50], 16)
        for t in TOKENS[50:]:
            pos = cache.pos
            decode_one_token(model, cache, int(t))
            if not DC.active(pos + 1):
                continue
            for layer in range(1, model.args.n_layers):
                sel = cache.selection(layer)
                ib, lb = cache.shape.ib, sel.lb
                s = quest_scores(cache, layer, seen[layer], pos)[:, ib:lb]
                want = (s.topk(3, dim=1).indices + ib).sort(dim=1).values
                assert torch.equal(sel.ids[:, :3].long(), want), (pos, layer)
                checked += 1
    assert checked >= 40


def test_knobs_dca_cannot_take_turn_it_off_or_are_refused(dca_file, capsys):
    """A block size that does not divide the chunks, and DYNAMIC anchors: off by default (said on stderr), a
    ConfigError with dual_chunk.mode on. Otherwise the engine runs DCA in long_context and says so."""
    import ktquest

    small = {"long_context.local_windows_len": 16, "long_context.init_windows_len": 8}
    eng = ktquest.load(model=str(dca_file), config="quest", max_seq_len=128, threads=2,
                       **small, **{"long_context.block_size": 8})
    assert eng.args.dual_chunk == DC and "dual chunk attention: chunks of 24" in capsys.readouterr().err
    for bad, why in (({"long_context.block_size": 16}, "does not divide"),
                     ({"long_context.block_size": 8, "long_context.anchor_type": "DYNAMIC"}, "DYNAMIC")):
        off = ktquest.load(model=str(dca_file), config="quest", max_seq_len=128, threads=2, **small, **bad)
        assert off.args.dual_chunk is None and why in capsys.readouterr().err
        with pytest.raises(ConfigError, match=why):
            ktquest.load(model=str(dca_file), config="quest", max_seq_len=128, **small, **bad,
                         **{"dual_chunk.mode": "on"})


def test_a_kv_file_of_a_dca_long_context_session(dca_file, tmp_path):
    """Saved past the first chunk and loaded into a fresh engine: the same next reply as the session that kept
    going (the recorded rotations come back for SnapKV)."""
    import ktquest

    opts = dict(model=str(dca_file), config="snapkv", max_seq_len=128, threads=2, max_new_tokens=6,
                **{"long_context.block_size": 8, "long_context.local_windows_len": 16,
                   "long_context.init_windows_len": 8, "long_context.preselect_block_count": 3,
                   "long_context.kv_type": "FP16"})
    a = ktquest.load(**opts)
    a.generate("tiny " * 45)
    a.save_kv(tmp_path / "s.kv")
    b = ktquest.load(**opts)
    b.load_kv(tmp_path / "s.kv")
    assert b.generate(" more tiny words") == a.generate(" more tiny words")


def test_sparse_prefill_selects_with_each_chunks_bounds(model, monkeypatch):
    """million's sparse prefill past the first chunk (exact only for the first 16 tokens, 2 blocks a KV head): each
    chunk's selection is asked with the block bounds of that chunk (a pass that crosses an edge asks twice), and
    the prompt's logits stay finite."""
    from ktquest.native.store import KVStore

    asked = []
    select = KVStore.select

    def spy(self, layer, q, k, mode="SEPARATE", exclude_ranges=(), allowed=None, ada_alpha=None, variants=None):
        asked.append((q.shape[0] if variants is None else q.shape[1], variants))
        return select(self, layer, q, k, mode, exclude_ranges, allowed, ada_alpha, variants)

    monkeypatch.setattr(KVStore, "select", spy)
    cfg = config("million", prefill={"exact_tokens": 16, "blocks": 2, "exact_tail": 0})
    cache = make_cache(cfg, model.args, 128, torch.device("cpu"), torch.float32)
    with torch.inference_mode():
        logits = prefill(model, cache, TOKENS[:90], 16)
    assert torch.isfinite(logits).all()
    bounds = {v for _, v in asked}
    # chunks 1, 2 and 3 (of 3 blocks): the chunk before starts at succ, the query's own at intra
    assert bounds == {(0, 3), (3, 6), (6, 9)}
