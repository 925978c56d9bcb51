#!/usr/bin/env python3
"""One layer's decode-time block selection: the flat scan against the hierarchical index (``index_group``).

For each kind of keys and context length, one layer's K goes into a flat store and into one store per
``--groups`` value (same config otherwise), and each of ``--queries`` decode queries selects ``--budget``
blocks per KV head with the init and local windows excluded, as a ``configs/quest.yaml`` decode step does.
The stores are timed in turns (every store on every query, each round), each call after a cache flush (a
decode step reaches a layer's anchors from DRAM). Printed per row: the median time per call, the index's
stages (group bounds, then the walk: its blocks' scores and the top k), the median of the per-call ratios
flat / this store (speedup), the fraction of candidate blocks whose anchors were scored, the anchor and bound
bytes read against the flat scan's, and whether every query's ids equal the flat scan's.

Keys:
- ``random``: N(0, 1) keys and queries (no structure: loose bounds, the index's worst case).
- ``real``: K and the last ``--queries`` queries of ``--layers`` captured from a dense prefill of the bundled
  model on ``--capture-tokens`` tokens of Python standard-library source, un-rotated (RoPE), tiled to the
  context length with ``--noise`` x each dimension's std of Gaussian noise added, and rotated again at their
  new positions (the queries at the context's last positions): the captured text repeated, as it would be
  at those positions.

    python tools/bench_select.py --contexts 32768,1048576 --groups 16,32,64 --json tools/out/bench_select.json
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

_TOOLS = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [_TOOLS, os.path.dirname(_TOOLS)]  # tools/ and the ktquest package
from attention_recall import RecordingCache
from bench_attention import Flusher
from common import context_tokens, write_json

import ktquest
from ktquest.config import load_config
from ktquest.generate import prefill
from ktquest.models.rope import rope_frequencies
from ktquest.native.store import KVStore

CHUNK = 1 << 16  # tokens per append (and per RoPE table chunk)


# ---- keys and queries ----


def rotate(x: torch.Tensor, p0: int, inv_freq: torch.Tensor, sign: float = 1.0) -> torch.Tensor:
    """Rotate-half RoPE of x [T, n, D] at positions p0 .. p0 + T - 1 (sign -1: undo it), angles in fp64."""
    angles = torch.outer(torch.arange(p0, p0 + x.shape[0], dtype=torch.float64), inv_freq)  # [T, D/2]
    cos = torch.cat([angles.cos()] * 2, -1).float()[:, None]  # [T, 1, D]
    sin = (sign * torch.cat([-angles.sin(), angles.sin()], -1)).float()[:, None]
    return torch.addcmul(x * cos, torch.roll(x, x.shape[-1] // 2, dims=-1), sin)


def capture(model_name: str | None, n_tokens: int, layers: list[int], n_queries: int, threads: int) -> dict:
    """Dense prefill of n_tokens of stdlib source: per layer (K, Q) before RoPE, K [n, KVH, D] and the last
    n_queries queries Q [W, H, D]; and the model's RoPE inverse frequencies."""
    eng = ktquest.load(model_name, load_config(None, ["mode=dense", f"max_seq_len={n_tokens}", f"threads={threads}"]))
    ids = context_tokens(eng.tokenizer, n_tokens, "stdlib")
    rec = RecordingCache(eng.cache, record_from=n_tokens - n_queries)
    eng.cache.reset()
    t0 = time.perf_counter()
    prefill(eng.model, rec, ids, eng.config.chunk_size)
    print(f"captured {n_tokens} tokens of stdlib source in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    inv_freq, mscale = rope_frequencies(eng.args, n_tokens)
    assert mscale == 1.0, "a model with an attention factor: un-rotating would need it"
    out = {}
    for layer in layers:
        k = eng.cache.layer_kv(layer)[0][:, :n_tokens].transpose(0, 1).float()  # [n, KVH, D] after RoPE
        q = rec.query(layer)  # [W, H, D] after RoPE
        out[layer] = (rotate(k, 0, inv_freq, -1.0), rotate(q, n_tokens - n_queries, inv_freq, -1.0))
    return {"layers": out, "inv_freq": inv_freq, "shape": (eng.args.n_heads, eng.args.n_kv_heads, eng.args.head_dim)}


def key_chunks(kind: str, N: int, KVH: int, D: int, seed: int, real=None, inv_freq=None, noise: float = 0.0):
    """Yields the context's keys [n, KVH, D] in chunks: random, or the captured K tiled (position N - 1 holds
    the captured text's last token), noised and rotated at their positions."""
    g = torch.Generator().manual_seed(seed)
    if kind == "real":
        std = real.std(0, keepdim=True)  # [1, KVH, D]
        n = real.shape[0]
    for p0 in range(0, N, CHUNK):
        T = min(CHUNK, N - p0)
        if kind == "random":
            yield torch.randn(T, KVH, D, generator=g)
            continue
        idx = (torch.arange(p0, p0 + T) + n - N % n) % n
        yield rotate(real[idx] + noise * std * torch.randn(T, KVH, D, generator=g), p0, inv_freq)


def queries(kind: str, N: int, H: int, D: int, W: int, seed: int, real=None, inv_freq=None) -> list[torch.Tensor]:
    if kind == "random":
        g = torch.Generator().manual_seed(seed + 1)
        return [torch.randn(H, D, generator=g) for _ in range(W)]
    q = rotate(real, N - real.shape[0], inv_freq)  # [W, H, D] at the context's last positions
    return [q[i].contiguous() for i in range(q.shape[0])]


# ---- timing ----


def bench(kind: str, N: int, layer, keys_of, qs, shape, args, flush: Flusher) -> list[dict]:
    """The flat store and one indexed store per group size, timed in turns: each round calls every store on
    every query (each call after a flush), so a slow spell of the host hits all of them alike."""
    H, KVH, D = shape
    bs, k = args.block_size, args.budget
    nb = -(-N // bs)
    excl = [(0, -(-args.init_tokens // bs)), (max(0, N - args.local_tokens) // bs, nb)]
    n_cand = nb - sum(b1 - b0 for b0, b1 in excl)  # per KV head
    groups = [0, *args.groups]
    stores = []
    for G in groups:
        store = KVStore(1, KVH, D, N, block_size=bs, kv_type="FP16", anchor_type="QUEST", anchor_num=2,
                        threads_num=args.threads, index_group=G)
        for chunk in keys_of():
            store.append(0, chunk, chunk)
        store.select(0, qs[0], k, "SEPARATE", exclude_ranges=excl)  # code and workers warm
        stores.append(store)
    wall = [[] for _ in groups]
    stage = [[] for _ in groups]
    ids = [[] for _ in groups]
    scored = [0] * len(groups)
    for rep in range(args.reps):
        for q in qs:
            for i, store in enumerate(stores):
                flush()
                t0 = time.perf_counter()
                got = store.select(0, q, k, "SEPARATE", exclude_ranges=excl)
                wall[i].append((time.perf_counter() - t0) * 1e3)
                t = store.last_timing()
                stage[i].append((t["score_ms"], t["topk_ms"]))
                if rep == 0:
                    ids[i].append(got)
                    scored[i] += store.last_index_stats()["blocks_scored"]
    del stores
    rows = []
    anchor_bytes = 2 * D * 2  # a (head, block)'s QUEST fp16 anchors; a (head, group)'s fp16 rows are as many
    for i, G in enumerate(groups):
        frac = scored[i] / (len(qs) * KVH * n_cand)
        ng = -(-nb // G) if G else 0
        rows.append({
            "keys": kind, "layer": layer, "context": N, "index_group": G, "ms": round(statistics.median(wall[i]), 3),
            "bounds_ms": round(statistics.median(s for s, _ in stage[i]), 3) if G else None,
            "walk_ms": round(statistics.median(w for _, w in stage[i]), 3) if G else None,
            "speedup": round(statistics.median(f / x for f, x in zip(wall[0], wall[i])), 2),
            "blocks_scored": round(frac, 4), "groups_per_set": ng,
            "bytes_vs_flat": round((ng * 2 * D * 2 + frac * n_cand * anchor_bytes) / (n_cand * anchor_bytes), 4),
            "identical": all(torch.equal(a, b) for a, b in zip(ids[i], ids[0])),
        })
        print(fmt(rows[-1]), flush=True)
    return rows


HEADER = (f"{'keys':>6} {'layer':>5} {'context':>8} {'group':>5} {'ms/call':>8} {'bounds':>7} {'walk':>7} "
          f"{'speedup':>7} {'blocks':>7} {'bytes':>7} identical")


def fmt(r: dict) -> str:
    opt = (lambda x: f"{x:7.3f}" if x is not None else f"{'-':>7}")
    return (f"{r['keys']:>6} {str(r['layer']):>5} {r['context']:>8} {r['index_group']:>5} {r['ms']:8.3f} "
            f"{opt(r['bounds_ms'])} {opt(r['walk_ms'])} {r['speedup']:7.2f} {r['blocks_scored']:7.1%} "
            f"{r['bytes_vs_flat']:7.1%} {r['identical']}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contexts", default="32768,1048576", help="context lengths, tokens")
    ap.add_argument("--groups", default="8,16,32,64", help="index_group values against the flat scan")
    ap.add_argument("--kinds", default="random,real", help="random and/or real keys")
    ap.add_argument("--layers", default="2,8,15,22,29", help="real keys: the bundled model's layers")
    ap.add_argument("--model", default=None, help="GGUF path or bundled model name (default: smollm2-135m)")
    ap.add_argument("--capture-tokens", type=int, default=4096, help="real keys: the prefill captured")
    ap.add_argument("--noise", type=float, default=0.1, help="real keys: noise added to each tiled key, x std")
    ap.add_argument("--queries", type=int, default=8, help="decode queries per row")
    ap.add_argument("--reps", type=int, default=3, help="rounds: timed calls per query and store")
    ap.add_argument("--block-size", type=int, default=8, help="as configs/quest.yaml")
    ap.add_argument("--budget", type=int, default=128, help="blocks per KV head (quest.yaml: 256; the recorded runs: 128)")
    ap.add_argument("--init-tokens", type=int, default=16, help="the init window, excluded (quest.yaml: 16)")
    ap.add_argument("--local-tokens", type=int, default=512, help="the local window, excluded (quest.yaml: 512)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--flush-mib", type=int, default=256, help="cache flush before each call (0 = warm)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    contexts = [int(x) for x in args.contexts.split(",")]
    args.groups = [int(x) for x in args.groups.split(",") if x]
    kinds = [x.strip() for x in args.kinds.split(",") if x.strip()]
    layers = [int(x) for x in args.layers.split(",") if x]
    torch.set_num_threads(args.threads)
    flush = Flusher(args.flush_mib)
    rows = []
    cap = capture(args.model, args.capture_tokens, layers, args.queries, args.threads) if "real" in kinds else None
    shape = cap["shape"] if cap else (9, 3, 64)  # SmolLM2-135M: 9 query heads, 3 KV heads, head_dim 64
    print(f"one layer's selection, {shape[0]}/{shape[1]} heads, head_dim {shape[2]}, FP16 QUEST anchors, block "
          f"{args.block_size}, {args.budget} blocks per KV head (SEPARATE), init {args.init_tokens} + local "
          f"{args.local_tokens} tokens excluded, {args.threads} threads, {args.queries} queries x {args.reps}; "
          f"blocks: candidate blocks scored; bytes: anchor and bound bytes read / the flat scan's")
    print(HEADER)
    for N in contexts:
        for kind in kinds:
            for layer in (layers if kind == "real" else [None]):
                H, KVH, D = shape
                if kind == "real":
                    kr, qr = cap["layers"][layer]
                    inv = cap["inv_freq"]
                    keys_of = lambda kr=kr, inv=inv: key_chunks("real", N, KVH, D, args.seed, kr, inv, args.noise)
                    qs = queries("real", N, H, D, args.queries, args.seed, qr, inv)
                else:
                    keys_of = lambda: key_chunks("random", N, KVH, D, args.seed)
                    qs = queries("random", N, H, D, args.queries, args.seed)
                rows += bench(kind, N, layer, keys_of, qs, shape, args, flush)
    if args.json:
        write_json(args.json, {"args": vars(args), "rows": rows})
    return 0 if all(r["identical"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
