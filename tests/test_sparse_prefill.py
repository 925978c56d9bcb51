"""Sparse prefill (``prefill.mode: sparse``): a torch reference of what each chunk attends (its windows, the
blocks its spread queries score highest per KV head, the stretch before its local window) against the cache;
the index's pruned choice equals the flat scan's; a budget that covers the context is exact prefill; errors."""

from __future__ import annotations

import dataclasses
import types
from pathlib import Path

import pytest
import torch

from ktquest.config import ConfigError, load_config
from ktquest.kv.long_context import LongContextCache

CONFIGS = Path(__file__).resolve().parent.parent / "configs"
ARGS = types.SimpleNamespace(n_layers=2, n_heads=6, n_kv_heads=2, head_dim=32)
BS, INIT, LOCAL, CHUNK, EXACT, BLOCKS, R = 4, 4, 8, 16, 32, 3, 4


def sparse_config(index_group: int = 0, blocks: int = BLOCKS, mode: str = "sparse"):
    return load_config(CONFIGS / "quest.yaml", [
        ("long_context.block_size", BS), ("long_context.init_windows_len", INIT),
        ("long_context.local_windows_len", LOCAL), ("long_context.kv_type", "FP32"),
        ("long_context.index_group", index_group), ("chunk_size", CHUNK), ("max_seq_len", 256),
        ("prefill.mode", mode), ("prefill.exact_tokens", EXACT), ("prefill.blocks", blocks),
        ("prefill.select_queries", R)])


def reference_chunk(q, k, v, s: int, T: int) -> torch.Tensor:
    """Layer output of the chunk [s, s + T) under sparse prefill, from first principles. q [N, H, D], k/v
    [N, KVH, D] -> [T, H, D]."""
    H, KVH, D = q.shape[1], k.shape[1], q.shape[2]
    G = H // KVH
    ib = -(-INIT // BS)
    init_end = ib * BS
    local_start = max(init_end, (s + T - LOCAL) // BS * BS)
    loc0 = max(init_end, min(local_start, s // BS * BS))
    lb = loc0 // BS
    visible = torch.zeros(KVH, s + T, dtype=torch.bool)  # context positions each KV head's queries see
    if s < EXACT or lb - ib <= BLOCKS:
        visible[:, init_end: lb * BS] = True
    else:
        pick = torch.linspace(0, T - 1, min(R, T)).round().long()
        qs = q[s + pick]  # [R, H, D]
        for h in range(KVH):
            kb = k[: lb * BS, h].reshape(lb, BS, D)
            mn, mx = kb.amin(1), kb.amax(1)  # [lb, D] Quest anchors
            qh = qs[:, h * G: (h + 1) * G].reshape(-1, D)  # the KV head's query heads at the R positions
            score = torch.maximum(qh[:, None] * mn[None], qh[:, None] * mx[None]).sum((0, 2))  # [lb]
            score[:ib] = float("-inf")
            top = sorted(range(lb), key=lambda b: (-score[b].item(), b))[:BLOCKS]
            recent = range(max(ib, lb - -(-T // BS)), lb)
            for b in set(top) | set(recent):
                visible[h, b * BS: (b + 1) * BS] = True
    out = torch.empty(T, H, D)
    for t in range(T):
        p = s + t
        for head in range(H):
            h = head // G
            see = visible[h, : p + 1].clone()
            see[:init_end] = True
            see[loc0: p + 1] = True
            w = (k[: p + 1, h][see] @ q[p, head]) / D ** 0.5
            out[t, head] = w.softmax(0) @ v[: p + 1, h][see]
    return out


def run_prefill(cfg, q, k, v, prompt_end: int | None = None) -> torch.Tensor:
    """The chunks' layer-0 outputs; prompt_end: announced as generate.prefill does (``begin_prompt``)."""
    cache = LongContextCache(ARGS, cfg, cfg.max_seq_len)
    if prompt_end is not None:
        cache.begin_prompt(prompt_end)
    outs = []
    for s in range(0, q.shape[0], CHUNK):
        for layer in range(ARGS.n_layers):
            o = cache.attend(layer, q[s: s + CHUNK], k[s: s + CHUNK], v[s: s + CHUNK], s)
            if layer == 0:
                outs.append(o)
    return torch.cat(outs)


def qkv(n: int = 112, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, 6, 32, generator=g), torch.randn(n, 2, 32, generator=g),
            torch.randn(n, 2, 32, generator=g))


@pytest.mark.parametrize("index_group", [0, 2, 5])
def test_sparse_prefill_matches_the_reference(index_group):
    q, k, v = qkv()
    got = run_prefill(sparse_config(index_group), q, k, v)
    for s in range(0, q.shape[0], CHUNK):
        want = reference_chunk(q, k, v, s, CHUNK)
        torch.testing.assert_close(got[s: s + CHUNK], want, atol=2e-5, rtol=2e-5, msg=f"chunk at {s}")


def test_sparse_prefill_reads_less_than_exact_and_a_full_budget_is_exact():
    q, k, v = qkv()
    exact = run_prefill(sparse_config(mode="exact"), q, k, v)
    sparse = run_prefill(sparse_config(), q, k, v)
    assert torch.equal(exact[:EXACT], sparse[:EXACT])  # the first exact_tokens are read exactly
    assert not torch.allclose(exact[EXACT:], sparse[EXACT:], atol=1e-3)  # later chunks skip blocks
    torch.testing.assert_close(run_prefill(sparse_config(blocks=1000), q, k, v), exact, atol=0, rtol=0)


@pytest.mark.parametrize("tail", [0, 1, 5, CHUNK, CHUNK + 3])
def test_the_prompts_tail_is_read_exactly(tail):
    """prefill.exact_tail: the announced prompt's last ``tail`` tokens attend every block (the question after
    a document), every token before them reads as sparse prefill does, in the same chunk too (the chunk's
    choice of blocks is made by its spread queries as before)."""
    q, k, v = qkv()
    n = q.shape[0]
    exact = run_prefill(sparse_config(mode="exact"), q, k, v)
    sparse = run_prefill(sparse_config(), q, k, v)
    cfg = sparse_config()
    cfg.prefill.exact_tail = tail
    got = run_prefill(cfg, q, k, v, prompt_end=n)
    cut = n - tail
    assert torch.equal(got[:cut], sparse[:cut])
    assert torch.equal(got[cut:], exact[cut:])
    assert tail == 0 or not torch.allclose(sparse[cut:], exact[cut:], atol=1e-3)


def test_sparse_prefill_config_errors():
    with pytest.raises(ConfigError, match="prefill.mode='sparse' is not allowed: 'sparse' only with mode: long_context"):
        load_config(None, [("prefill.mode", "sparse")])
    with pytest.raises(ConfigError, match="prefill.blocks=0"):
        load_config(None, [("prefill.blocks", 0)])
    with pytest.raises(ConfigError, match="prefill.mode='approximate'"):
        load_config(None, [("prefill.mode", "approximate")])
    cfg = sparse_config()
    assert dataclasses.asdict(cfg.prefill) == {"mode": "sparse", "exact_tokens": EXACT, "blocks": BLOCKS,
                                               "select_queries": R, "exact_tail": 512, "order": "chunk", "slab_tokens": 0}
    with pytest.raises(ConfigError, match="prefill.exact_tail=-1"):
        load_config(None, [("prefill.exact_tail", -1)])


def test_sparse_prefill_in_a_chat(tiny_llama):
    import ktquest

    sets = {"long_context.block_size": 4, "long_context.init_windows_len": 4, "long_context.local_windows_len": 8,
            "long_context.kv_type": "FP32", "chunk_size": 16, "threads": 1, "max_new_tokens": 6,
            "prefill.exact_tokens": 32, "prefill.blocks": 3, "prefill.exact_tail": 8}
    doc = "the cat sat on the mat and the dog sat on the log " * 10
    flat, pruned = (ktquest.load(tiny_llama.path, CONFIGS / "quest.yaml", **sets, **{"prefill.mode": "sparse",
                    "long_context.index_group": g}) for g in (0, 3))
    a, b = flat.chat_session(document=doc), pruned.chat_session(document=doc)
    for text in ("hello there", "and again"):
        ra, rb = a.send(text), b.send(text)
        assert ra.text == rb.text and ra.stats.context_tokens == rb.stats.context_tokens


def test_million_preset_is_sized_for_a_24_gib_machine(tiny_llama):
    import ktquest
    from ktquest.kv.memory import candidate_copy_bytes, store_bytes

    cfg = load_config(CONFIGS / "million.yaml")
    lc = cfg.long_context
    assert cfg.max_seq_len == 1 << 20 and cfg.prefill.mode == "sparse" and lc.dense_layer_num == 0
    dims = (30, 3, 64, cfg.max_seq_len)  # the bundled SmolLM2's layers, KV heads, head_dim
    assert store_bytes(lc, *dims) + candidate_copy_bytes(lc, *dims) < 16 * 2**30
    eng = ktquest.load(tiny_llama.path, CONFIGS / "million.yaml", threads=1, max_seq_len=4096, max_new_tokens=4,
                       **{"prefill.exact_tokens": 600, "long_context.kv_type": "FP16"})  # (head_dim 16: no Q8_0)
    r = eng.chat_session(document="the cat sat on the mat " * 200).send("hello")
    assert r.stats.new_tokens == 4 and r.stats.context_tokens > 1000


def test_the_ram_check_counts_huge_pages_and_the_prefill_workspace(monkeypatch):
    from ktquest.kv import memory

    cfg = load_config(CONFIGS / "million.yaml")
    lc, n = cfg.long_context, cfg.max_seq_len
    args = types.SimpleNamespace(n_layers=30, n_heads=9, n_kv_heads=3, head_dim=64, dim=576, ffn_dim=1536)
    store = memory.store_bytes(lc, 30, 3, 64, n) + memory.candidate_copy_bytes(lc, 30, 3, 64, n)
    extra = memory.HUGE_PAGE * memory.store_regions(lc, 30) + memory.prefill_workspace_bytes(lc, args, n, 512)
    assert 30 * 4 * memory.HUGE_PAGE <= extra < 2**30  # 4 regions a layer
    # SnapKV's scores read a layer's keys in place: their workspace is the window rows' partials (9 heads x 32
    # queries, a running max and sum per run of 256 keys), not a copy of the keys (0.75 GiB at 1M)
    without = memory.prefill_workspace_bytes(dataclasses.replace(lc, preselect_block=False, int8_candidates=False),
                                             args, n, 512)
    assert memory.prefill_workspace_bytes(lc, args, n, 512) - without == n // 256 * 2 * 9 * 32 * 4
    monkeypatch.setattr(memory, "available_ram", lambda: store + extra // 2)  # the store alone would fit
    with pytest.raises(ConfigError, match=r"would need 15\.\d\d GiB \(and 0\.\d\d GiB more for huge-page rounding"):
        memory.check_store_fits(lc, args, n, 512)
    monkeypatch.setattr(memory, "available_ram", lambda: store + extra)
    memory.check_store_fits(lc, args, n, 512)
