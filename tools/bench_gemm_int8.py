#!/usr/bin/env python3
"""The int8 prefill GEMM (_C.gemm_int8: K-quant and 4/5-bit 32-value rows) beside torch's fp32 GEMM on the same
rows dequantized.

For each shape (out x in) and type, one matrix of random blocks with sane scales multiplies a chunk of T tokens
(the prefill's chunk_size): GMAC/s = out * in * T over the median call time, x's quantization and the rows'
unpacking included (both run once per call, as in prefill). torch's F.linear runs on the rows dequantized
once, before timing (the old prefill path's panel work left out: an upper bound for it). The two alternate
inside every round. With --experts E, E matrices of each shape take T tokens each through one
_C.gemm_int8_grouped call (a mixture of experts' prefill: a 512-token chunk gives each of 256 experts 16 tokens
on average at 8 routed a token), and torch runs one F.linear per expert.

    python tools/bench_gemm_int8.py --threads 2 --json tools/out/bench_gemm_int8.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing
from ktquest import _C

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_gemv_quant import random_rows  # noqa: E402
from common import write_json  # noqa: E402

# Qwen2.5-1.5B: ffn_up/gate, ffn_down (Q6_K in Q4_K_M), attn q|k|v; Qwen2.5-7B: ffn_up/gate; SmolLM2-135M (Q4_1):
# q|k|v, gate|up, down; Gemma 3 270M: gate|up (Q5_0); a Q4_0 ffn_down. out x in.
SHAPES = ("8960x1536:Q4_K,1536x8960:Q6_K,1536x8960:Q4_K,2048x1536:Q4_K,3584x3584:Q5_K,18944x3584:Q4_K,"
          "960x576:Q4_1,3072x576:Q4_1,576x1536:Q4_1,4096x640:Q5_0,1536x8960:Q4_0")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default=SHAPES, help="comma list of OUTxIN:TYPE")
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--experts", type=int, default=1, help="matrices of each shape, T tokens each, in one grouped call")
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rng = np.random.default_rng(0)
    rows = []
    print(f"{'shape':>12} {'type':>5} {'T':>4} {'int8 GMAC/s':>14} {'torch fp32':>11} {'ratio':>6}")
    for spec in args.shapes.split(","):
        shape, qtype = spec.split(":")
        out, inp = (int(v) for v in shape.split("x"))
        E, T = args.experts, args.tokens
        mats = [_C.QuantMatrix([(qtype, random_rows(qtype, out, inp, rng))]) for _ in range(E)]
        ws = [torch.empty(out, inp) for _ in range(E)]
        for m, w in zip(mats, ws):
            _C.dequantize_matrix(m, 0, out, w.numpy(), args.threads, None)
        x = torch.from_numpy(rng.standard_normal((E * T, inp), dtype=np.float32))
        y = np.empty((E * T, out), np.float32)
        offsets = np.arange(E + 1, dtype=np.int64) * T
        times = {"int8": [], "torch": []}
        for r in range(args.rounds + 1):  # round 0 warms up
            t0 = time.perf_counter()
            if E == 1:
                _C.gemm_int8(mats[0], x.numpy(), y, args.threads)
            else:
                _C.gemm_int8_grouped(mats, offsets, x.numpy(), y, args.threads)
            t1 = time.perf_counter()
            for e, w in enumerate(ws):
                F.linear(x[e * T:(e + 1) * T], w)
            t2 = time.perf_counter()
            if r:
                times["int8"].append(t1 - t0)
                times["torch"].append(t2 - t1)
        macs = E * out * inp * T / 1e9
        kq, tf = macs / statistics.median(times["int8"]), macs / statistics.median(times["torch"])
        print(f"{shape:>12} {qtype:>5} {args.tokens:>4} {kq:>14.1f} {tf:>11.1f} {kq / tf:>6.2f}")
        rows.append({"shape": shape, "type": qtype, "tokens": T, "experts": E, "threads": args.threads,
                     "int8_gmacs": kq, "torch_fp32_gmacs": tf})
    if args.json:
        write_json(args.json, {"rows": rows})


if __name__ == "__main__":
    main()
