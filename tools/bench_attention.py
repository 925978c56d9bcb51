#!/usr/bin/env python3
"""Sparse decode attention of one layer vs torch dense SDPA, and how close each stage gets to memory bandwidth.

For each model shape and context length, a KV store is filled with random keys/values (big chunks, no
per-token Python), then one decode step of one layer is timed:

  torch_dense_ms  F.scaled_dot_product_attention on the same data, in the dtype torch runs fastest here
                  (bf16 and fp32 are tried; fp32 is skipped when its K/V would not fit --dense-fp32-max-gib)
  full_budget_ms  ktquest select_attend with a budget covering every block (checked against torch dense)
  sparse_ms       ktquest select_attend with --budget tokens per KV head, split into score / topk / attend
  *_gbps          bytes each stage reads (anchors; selected K/V tiles) over its time; read_bw_gbps is a large
                  array sum, sampled before each of --rounds rounds of sparse calls; *_bw_ratio: per round, the
                  stage's GB/s over that round's bandwidth sample, median over the rounds

Each sparse call uses another query (different blocks), and by default the caches are flushed before every
timed call (--warm keeps them), then the same operation runs once on a tiny second layer: as in a decode
loop, where the previous layer just ran the same code on the same threads, code and workers are warm while
this layer's KV and anchors are in DRAM only.

    python tools/bench_attention.py --contexts 4096,32768,131072,1048576 --budget 2048 --block-size 64 \
        --json tools/out/bench_attention.json
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing
from ktquest import _C
from ktquest.native.store import KV_TYPES, KVStore

SHAPES = {"9/3/64": (9, 3, 64), "32/8/128": (32, 8, 128)}  # query heads / KV heads / head_dim
BYTES_PER_VALUE = {"FP32": 4.0, "FP16": 2.0, "BF16": 2.0, "Q8_0": 1 + 4 / 32, "Q4_0": 0.5 + 4 / 32}
CHUNK = 1 << 16  # tokens per append
WARMUP_TOKENS = 4096  # the second layer's context, for the code warm-up calls


# ---- measurements ----


class ReadBandwidth:
    """GB/s of torch.sum over a large fp32 array: the machine's read bandwidth at the moment of the call.

    A shared host's bandwidth moves in phases of seconds (here: 30-35 GB/s, spells of ~50, dips to ~12),
    so the benchmark samples it between the rounds of the timed calls and compares each round with its
    own sample instead of comparing with one best-of figure taken at another moment."""

    def __init__(self, gib: float):
        self.x = torch.ones(int(gib * (1 << 28)))

    def __call__(self, reps: int = 3) -> float:
        t = statistics.median(_timed(lambda: self.x.sum()) for _ in range(reps))
        time.sleep(0.02)  # torch's OpenMP workers spin a while after a parallel op: let them go to sleep
        return self.x.numel() * 4 / t / 1e9


class Flusher:
    """Evicts the caches between timed calls by reading a buffer larger than L3. Reading, not writing: dirty
    lines would make the timed call pay for their write-back. numpy, not torch: torch's OpenMP workers keep
    spinning for a while after a parallel op and would compete with the operator's threads."""

    def __init__(self, mib: int):
        self.buf = np.ones(mib << 18, np.float32) if mib > 0 else None

    def __call__(self) -> None:
        if self.buf is not None:
            self.buf.sum()


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def timeit(fn, flush: Flusher, min_iters: int, min_s: float, warmup=None, max_iters: int = 1000) -> float:
    """Median seconds of fn() over enough calls, each after a flush and then warmup() (code, not data)."""
    flush()
    fn()
    times, total = [], 0.0
    while len(times) < min_iters or (total < min_s and len(times) < max_iters):
        flush()
        if warmup is not None and flush.buf is not None:
            warmup()
        t = _timed(fn)
        times.append(t)
        total += t
    return statistics.median(times)


# ---- data ----


def fill(store: KVStore, T: int, KVH: int, D: int, dense_dtypes: list[torch.dtype], seed: int):
    """Appends T random tokens in chunks; returns the same K/V as [1, KVH, T, D] tensors per dense dtype."""
    gen = torch.Generator().manual_seed(seed)
    dense = {
        dt: (torch.empty(1, KVH, T, D, dtype=dt), torch.empty(1, KVH, T, D, dtype=dt)) for dt in dense_dtypes
    }
    for t0 in range(0, T, CHUNK):
        n = min(CHUNK, T - t0)
        k = torch.randn(n, KVH, D, generator=gen)
        v = torch.randn(n, KVH, D, generator=gen)
        store.append(0, k, v)
        for kd, vd in dense.values():
            kd[0, :, t0 : t0 + n] = k.transpose(0, 1)
            vd[0, :, t0 : t0 + n] = v.transpose(0, 1)
    return dense


def bench_one(shape: str, T: int, args, flush: Flusher, bandwidth: ReadBandwidth) -> dict:
    H, KVH, D = SHAPES[shape]
    G = H // KVH
    bs = args.block_size
    dense_dtypes = [torch.bfloat16]
    if 2 * T * KVH * D * 4 <= args.dense_fp32_max_gib * (1 << 30):
        dense_dtypes.append(torch.float32)
    store = KVStore(  # layer 0: the context; layer 1: WARMUP_TOKENS for the code warm-up calls
        2,
        KVH,
        D,
        T,
        block_size=bs,
        kv_type=args.kv_type,
        anchor_type=args.anchor_type,
        anchor_num=2 if args.anchor_type == "QUEST" else args.anchor_num,
        threads_num=args.threads,
    )
    t_fill = time.perf_counter()
    dense = fill(store, T, KVH, D, dense_dtypes, seed=T)
    t_fill = time.perf_counter() - t_fill
    n_warm = min(WARMUP_TOKENS, T)
    store.append(1, torch.randn(n_warm, KVH, D), torch.randn(n_warm, KVH, D))
    nb = store.n_blocks(0)
    gen = torch.Generator().manual_seed(1)
    queries = [torch.randn(H, D, generator=gen) for _ in range(16)]
    it = iter(range(1 << 30))

    def next_q() -> torch.Tensor:
        return queries[next(it) % len(queries)]

    # torch dense: GQA as G query rows per KV head (no K/V expansion), in each candidate dtype
    dense_ms, dense_out = {}, None
    for dt, (kd, vd) in dense.items():
        q4 = queries[0].reshape(1, KVH, G, D).to(dt)

        def dense_call(q4=q4, kd=kd, vd=vd):
            return F.scaled_dot_product_attention(q4, kd, vd)

        def dense_warmup(q4=q4, kd=kd, vd=vd):
            return F.scaled_dot_product_attention(q4, kd[:, :, :n_warm], vd[:, :, :n_warm])

        dense_ms[str(dt).replace("torch.", "")] = 1e3 * timeit(
            dense_call, flush, 3, args.min_seconds, warmup=dense_warmup
        )
        if dt == torch.float32 or dense_out is None:
            dense_out = F.scaled_dot_product_attention(
                queries[0].reshape(1, KVH, G, D).to(dt), kd, vd
            ).float()
    best_dtype = min(dense_ms, key=dense_ms.get)
    del dense
    gc.collect()

    # full budget: every block (also the correctness check against torch dense)
    out_full, _, _ = store.select_attend(0, queries[0], nb, args.mode)
    max_err = (out_full - dense_out.reshape(H, D)).abs().max().item()
    nb_warm = store.n_blocks(1)
    full_ms = 1e3 * timeit(
        lambda: store.select_attend(0, next_q(), nb, args.mode),
        flush,
        3,
        args.min_seconds,
        warmup=lambda: store.select_attend(1, queries[1], nb_warm, args.mode),
    )

    # sparse: budget tokens per KV head (SEPARATE) or shared (SHARED)
    k_blocks = max(1, args.budget // bs)
    out, lse = torch.empty(H, D), torch.empty(H)
    stages = {"score_ms": [], "topk_ms": [], "attend_ms": [], "rerank_ms": []}
    selected = []

    def sparse_call():
        selected.append(store.select_attend(0, next_q(), k_blocks, args.mode, out=out, lse=lse)[2])
        for key, val in store.last_timing().items():  # a few microseconds; the bookkeeping waits until after
            stages[key].append(val)

    # Rounds of sparse calls, each after a read-bandwidth sample: every stage is compared with the
    # bandwidth of the same moment (a busy host varies), and the ratios are medians over the rounds.
    k_warm = max(1, min(k_blocks, store.n_blocks(1) // 2))
    round_bw, round_stage, sparse_times = [], [], []
    for _ in range(args.rounds):
        round_bw.append(bandwidth())
        for vals in stages.values():
            vals.clear()
        sparse_times.append(
            timeit(
                sparse_call,
                flush,
                max(1, args.min_iters // args.rounds),
                args.min_seconds / args.rounds,
                warmup=lambda: store.select_attend(1, queries[1], k_warm, args.mode, out=out, lse=lse),
                max_iters=max(1, 1000 // args.rounds),
            )
        )
        round_stage.append({key: statistics.median(vals[1:]) for key, vals in stages.items()})  # [0]: warm-up
    sparse_ms = 1e3 * statistics.median(sparse_times)
    stage = {key: statistics.median(r[key] for r in round_stage) for key in stages}
    read_bw = statistics.median(round_bw)
    last = T - (nb - 1) * bs  # tokens in the (possibly partial) last block

    def tokens(blocks: torch.Tensor) -> int:  # tokens attended, summed over KV heads
        rows = blocks.reshape(-1, blocks.shape[-1])
        n_last = int((rows == nb - 1).sum())
        return ((int((rows >= 0).sum()) - n_last) * bs + n_last * last) * (KVH // rows.shape[0])

    sel_tokens = [tokens(b) for b in selected]
    anchor_bytes = nb * KVH * store.native.anchor_slots * D * store.anchor_elem_bytes
    attend_bytes = statistics.median(sel_tokens) * 2 * D * BYTES_PER_VALUE[args.kv_type]

    def gbps(nbytes: float, ms: float) -> float:
        return nbytes / (ms * 1e-3) / 1e9

    def bw_ratio(nbytes: float, key: str) -> float:  # per round: GB/s over the bandwidth sampled before it
        return statistics.median(gbps(nbytes, r[key]) / bw for r, bw in zip(round_stage, round_bw))
    row = {
        "shape": shape,
        "context": T,
        "budget": args.budget,
        "block_size": bs,
        "kv_type": args.kv_type,
        "anchor_type": args.anchor_type,
        "mode": args.mode,
        "threads": args.threads,
        "cache": "warm" if args.warm else "cold",
        "torch_dense_ms": dense_ms[best_dtype],
        "torch_dense_dtype": best_dtype,
        "torch_dense_ms_by_dtype": dense_ms,
        "full_budget_ms": full_ms,
        "full_budget_max_abs_err": max_err,
        "sparse_ms": sparse_ms,
        **stage,
        "speedup": dense_ms[best_dtype] / sparse_ms,
        "score_gbps": gbps(anchor_bytes, stage["score_ms"]),
        "attend_gbps": gbps(attend_bytes, stage["attend_ms"]),
        "full_budget_gbps": gbps(2 * T * KVH * D * BYTES_PER_VALUE[args.kv_type], full_ms),
        "read_bw_gbps": read_bw,
        "read_bw_samples_gbps": round_bw,
        "score_bw_ratio": bw_ratio(anchor_bytes, "score_ms"),
        "attend_bw_ratio": bw_ratio(attend_bytes, "attend_ms"),
        "load_avg": os.getloadavg()[0],
        "fill_s": t_fill,
        "kv_bytes": store.nbytes(),
    }
    return row


# ---- output ----

COLUMNS = [
    ("shape", "{:>8}"),
    ("context", "{:>8}"),
    ("torch_dense_ms", "{:>9.2f}"),
    ("torch_dense_dtype", "{:>8}"),
    ("full_budget_ms", "{:>9.2f}"),
    ("sparse_ms", "{:>8.3f}"),
    ("score_ms", "{:>8.3f}"),
    ("topk_ms", "{:>7.3f}"),
    ("attend_ms", "{:>8.3f}"),
    ("speedup", "{:>7.1f}"),
    ("score_gbps", "{:>6.1f}"),
    ("attend_gbps", "{:>6.1f}"),
    ("read_bw_gbps", "{:>6.1f}"),
    ("score_bw_ratio", "{:>5.2f}"),
    ("attend_bw_ratio", "{:>5.2f}"),
]
HEADERS = [
    "shape",
    "context",
    "dense ms",
    "dtype",
    "full ms",
    "sparse",
    "score",
    "topk",
    "attend",
    "speedup",
    "sc GB/s",
    "at GB/s",
    "bw GB/s",
    "sc/bw",
    "at/bw",
]


def print_row(row: dict | None) -> None:
    if row is None:
        print(
            " ".join(
                f"{h:>{len(f.format(0) if 'f' in f else f.format(''))}}"
                for h, (_, f) in zip(HEADERS, COLUMNS)
            ),
            flush=True,
        )
        return
    print(" ".join(f.format(row[c]) for c, f in COLUMNS), flush=True)


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(SHAPES), figsize=(6 * len(SHAPES), 4.5), squeeze=False)
    for ax, shape in zip(axes[0], SHAPES):
        rs = [r for r in rows if r["shape"] == shape]
        if not rs:
            continue
        x = [r["context"] for r in rs]
        for key, label in [
            ("torch_dense_ms", "torch dense SDPA"),
            ("full_budget_ms", "ktquest, every block"),
            ("sparse_ms", f"ktquest sparse ({rs[0]['budget']} tokens)"),
            ("score_ms", "  score"),
            ("attend_ms", "  attend"),
        ]:
            style = "--" if key in ("score_ms", "attend_ms") else "-"
            ax.plot(x, [r[key] for r in rs], marker="o", label=label, linestyle=style)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("context (tokens)")
        ax.set_ylabel("ms per layer and decode step")
        ax.set_title(
            f"{shape} (H/KVH/D), {rs[0]['kv_type']} KV, {rs[0]['threads']} threads, {rs[0]['cache']} cache"
        )
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--contexts", default="4096,32768,131072,1048576", help="comma-separated context lengths")
    p.add_argument("--budget", type=int, default=2048, help="tokens attended per KV head (sparse)")
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--kv-type", default="FP16", choices=KV_TYPES)
    p.add_argument("--anchor-type", default="QUEST")
    p.add_argument("--anchor-num", type=int, default=4, help="anchors per block for FIXED/DYNAMIC")
    p.add_argument("--mode", default="SEPARATE", choices=["SHARED", "SEPARATE"])
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--shapes", default=",".join(SHAPES), help=f"subset of {', '.join(SHAPES)}")
    p.add_argument("--warm", action="store_true", help="do not flush the caches between timed calls")
    p.add_argument("--flush-mib", type=int, default=96, help="buffer that evicts the caches (> L3)")
    p.add_argument("--bw-gib", type=float, default=0.5, help="array size of the read-bandwidth measurement")
    p.add_argument("--rounds", type=int, default=5, help="rounds of sparse calls, each after a bandwidth sample")
    p.add_argument("--min-iters", type=int, default=20)
    p.add_argument("--min-seconds", type=float, default=1.0, help="time each measurement at least this long")
    p.add_argument(
        "--dense-fp32-max-gib", type=float, default=3.0, help="skip torch fp32 dense above this K+V size"
    )
    p.add_argument("--json", default="tools/out/bench_attention.json")
    p.add_argument("--png", default=None, help="plot path (default: the JSON path with .png)")
    args = p.parse_args(argv)

    torch.set_num_threads(args.threads)
    contexts = [int(c) for c in args.contexts.split(",")]
    shapes = [s.strip() for s in args.shapes.split(",")]
    flush = Flusher(0 if args.warm else args.flush_mib)
    bandwidth = ReadBandwidth(args.bw_gib)
    print(
        f"ktquest sparse attention: {args.kv_type} KV, {args.anchor_type} anchors, {args.mode}, "
        f"block {args.block_size}, budget {args.budget} tokens, {args.threads} threads, AVX2 kernels: {_C.use_avx2()}, "
        f"{'warm' if args.warm else 'cold'} caches; host load average {os.getloadavg()[0]:.1f}",
        flush=True,
    )
    print_row(None)
    rows = []
    for shape in shapes:
        for T in contexts:
            row = bench_one(shape, T, args, flush, bandwidth)
            rows.append(row)
            print_row(row)
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")
    png = Path(args.png) if args.png else Path(args.json).with_suffix(".png")
    plot(rows, png)
    print(f"wrote {args.json} and {png}")
    return rows


if __name__ == "__main__":
    main()
