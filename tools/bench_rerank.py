"""What the store's second stage of selection (``long_context.rerank``, cpp/kvstore/rerank.h) costs a decode step.

One layer's store at a context length, a budget (a share of the context per KV head), and ``select_attend``
timed with rerank 1 (the anchors' top k alone) and each R given, side by side in one run, the calls
interleaved (A B A B) so a busy host's phases fall on every variant alike. Reported per call: the median
milliseconds of the whole call and of its stages (score, top-k, the second stage, attend), and the ratio to
rerank 1. Random keys: the picks differ from a model's, the work does not (it depends on k, R and the shape).

    python tools/bench_rerank.py --shapes gemma3-270m,qwen2.5-7b --contexts 32768,131072 --share 0.02 \\
        --reranks 2,4,8
    python tools/bench_rerank.py --shapes smollm2-135m --contexts 131072,1048576 --kv-type Q8_0 --candidates 192 \\
        --k 64 --reranks 3      # million.yaml's step: 64 of 192 SnapKV candidates
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from ktquest.native.store import KVStore  # noqa: E402

# query heads / KV heads / head_dim / block size (quest.yaml's blocks of 8)
SHAPES = {"gemma3-270m": (4, 1, 256, 8), "qwen2.5-1.5b": (12, 2, 128, 8), "qwen2.5-7b": (28, 4, 128, 8),
          "smollm2-135m": (9, 3, 64, 16)}  # (million.yaml's blocks of 16)


def bench(shape: str, n: int, share: float, reranks: list[int], threads: int, calls: int, kv_type: str,
          candidates: int = 0, k_blocks: int = 0) -> list[dict]:
    H, KVH, D, bs = SHAPES[shape]
    g = torch.Generator().manual_seed(0)
    st = KVStore(1, KVH, D, n, block_size=bs, kv_type=kv_type, threads_num=threads)
    for t0 in range(0, n, 1 << 15):
        T = min(1 << 15, n - t0)
        st.append(0, torch.randn(T, KVH, D, generator=g), torch.randn(T, KVH, D, generator=g))
    nb = st.n_blocks(0)
    k = k_blocks or max(1, round(share * n / bs))
    excl = [(0, 2), (nb - 512 // bs, nb)]  # the windows (init 16 tokens, local 512)
    allowed = None
    if candidates:  # SnapKV's list (million.yaml: 192 of 16 tokens), through the store's candidate copy
        allowed = torch.stack([torch.randperm(nb - 2 - 512 // bs, generator=g)[:candidates].add(2).sort().values
                               for _ in range(KVH)]).int()
    out, lse = torch.empty(H, D), torch.empty(H)
    qs = [torch.randn(H, D, generator=g) * 2 for _ in range(8)]
    variants = [1, *reranks]
    times = {r: [] for r in variants}
    stages = {r: [] for r in variants}
    for i in range(calls + 2):  # interleaved; the first two rounds warm up
        for r in variants:
            t0 = time.perf_counter()
            st.select_attend(0, qs[i % len(qs)], k, "SEPARATE", excl, allowed, out=out, lse=lse, rerank=r)
            dt = (time.perf_counter() - t0) * 1e3
            if i >= 2:
                times[r].append(dt)
                stages[r].append(st.last_timing())
    base = statistics.median(times[1])
    rows = []
    for r in variants:
        med = statistics.median(times[r])
        st_med = {key: statistics.median(x[key] for x in stages[r]) for key in stages[r][0]}
        rows.append({"shape": shape, "n": n, "k": k, "rerank": r, "ms": med, "ratio": med / base, **st_med})
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="gemma3-270m,qwen2.5-7b", help=f"subset of {', '.join(SHAPES)}")
    ap.add_argument("--contexts", default="32768,131072")
    ap.add_argument("--share", type=float, default=0.02, help="selected tokens per KV head over the context")
    ap.add_argument("--reranks", default="2,4,8")
    ap.add_argument("--kv-type", default="FP16")
    ap.add_argument("--candidates", type=int, default=0, help="a SnapKV candidate list of this many blocks a KV head")
    ap.add_argument("--k", type=int, default=0, help="blocks a step keeps (default: --share of the context)")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--calls", type=int, default=40)
    a = ap.parse_args(argv)
    reranks = [int(x) for x in a.reranks.split(",")]
    print("| shape | context | k blocks | rerank | call ms | vs rerank 1 | score | top-k | second stage | attend |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for shape in a.shapes.split(","):
        for n in (int(x) for x in a.contexts.split(",")):
            for r in bench(shape, n, a.share, reranks, a.threads, a.calls, a.kv_type, a.candidates, a.k):
                print(f"| {r['shape']} | {r['n']} | {r['k']} | {r['rerank']} | {r['ms']:.3f} | {r['ratio']:.2f}x | "
                      f"{r['score_ms']:.3f} | {r['topk_ms']:.3f} | {r['rerank_ms']:.3f} | {r['attend_ms']:.3f} |",
                      flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
