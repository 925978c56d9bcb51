#!/usr/bin/env python3
"""Decode GEMV on GGUF-encoded weights (_C.gemv_quant) per type, beside Q8_0 rows multiplied by unrounded x
rounded to int16 (`activations: int16`, _C.gemv_matrix with x16).

For each shape (out x in) and thread count, every type multiplies one token (T = 1) by random weights of that
shape: random codes with sane fp16 scales (float types: N(0, 1) values). Each type holds enough copies of its
matrix to pass --min-mib, and each call reads the next copy, so the weights come from DRAM as in a decode step
(the L3 is 32 MiB here). The types run in turn inside every round, so each ratio is measured side by side.

  us      median (and min) microseconds of one call, argument checks and x's quantization included
  GB/s    weight bytes read over the median time
  vs x16  median time over that of Q8_0 with int16 x (1.0625 bytes a weight)

    python tools/bench_gemv_quant.py --threads 1,2 --json tools/out/bench_gemv_quant.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing
from ktquest import _C

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import write_json

# Qwen2.5-7B: ffn_down, ffn_up/gate, attn_q/o; Qwen2.5-1.5B: ffn_down. out x in.
SHAPES = "3584x18944,18944x3584,3584x3584,1536x8960"
# Where each block type keeps its fp16 scales (cpp/quant/ggml_blocks.h), given sane values here: random bytes
# there could be NaN, inf or subnormal, which some CPUs compute slowly.
FP16_FIELDS = {"Q8_0": [0], "Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2],
               "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208]}
BASELINE = "Q8_0 x16"


def random_rows(qtype: str, out: int, inp: int, rng: np.random.Generator) -> np.ndarray:
    """uint8 [out, row_bytes] of `qtype`."""
    row_bytes = _C.ggml_row_bytes(qtype, inp)
    if qtype in ("F32", "F16", "BF16"):
        w = rng.standard_normal((out, inp), dtype=np.float32)
        if qtype == "BF16":
            return (w.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8).reshape(out, row_bytes)
        return w.astype(np.float16 if qtype == "F16" else np.float32).view(np.uint8).reshape(out, row_bytes)
    w = rng.integers(0, 256, (out, row_bytes), dtype=np.uint8)
    blocks = w.reshape(-1, _C.ggml_row_bytes(qtype, 256 if qtype.endswith("_K") else 32))
    for off in FP16_FIELDS[qtype]:
        scale = rng.uniform(1e-3, 5e-2, len(blocks)).astype(np.float16)
        blocks[:, off:off + 2] = scale.view(np.uint8).reshape(-1, 2)
    return w


def bench_shape(out: int, inp: int, types: list[str], threads: int, rounds: int, min_bytes: int,
                rng: np.random.Generator) -> list[dict]:
    x = rng.standard_normal((1, inp), dtype=np.float32)
    y = np.empty((1, out), np.float32)
    calls, nbytes = {}, {}
    for t in types:
        one = random_rows(t, out, inp, rng)
        copies = [one] + [random_rows(t, out, inp, rng) for _ in range(-(-min_bytes // one.nbytes) - 1)]
        nbytes[t] = one.nbytes
        calls[t] = (lambda c, t=t: _C.gemv_quant(x, c, t, None, y, threads), copies)
    one = random_rows("Q8_0", out, inp, rng)
    mats = [_C.QuantMatrix([("Q8_0", r)], x16=True)
            for r in [one] + [random_rows("Q8_0", out, inp, rng) for _ in range(-(-min_bytes // one.nbytes) - 1)]]
    calls[BASELINE] = (lambda m: _C.gemv_matrix(m, x, y, threads), mats)
    nbytes[BASELINE] = one.nbytes

    times = {name: [] for name in calls}
    for r in range(rounds + 1):  # round 0 warms up (pages, workers)
        for name, (fn, copies) in calls.items():
            for c in copies:
                t0 = time.perf_counter()
                fn(c)
                if r:
                    times[name].append(time.perf_counter() - t0)
    base = statistics.median(times[BASELINE])
    rows = []
    for name, ts in times.items():
        med = statistics.median(ts)
        rows.append({"type": name, "out": out, "in": inp, "threads": threads, "us": med * 1e6,
                     "us_min": min(ts) * 1e6, "gbps": nbytes[name] / med / 1e9, "vs_x16": med / base,
                     "bytes": nbytes[name], "calls": len(ts)})
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--types", default=",".join(_C.GGML_TYPES), help="comma-separated, of _C.GGML_TYPES")
    ap.add_argument("--shapes", default=SHAPES, help="comma-separated out x in, e.g. 3584x18944")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--rounds", type=int, default=5, help="timed rounds (each calls every copy once)")
    ap.add_argument("--min-mib", type=float, default=128.0, help="bytes of copies per type (above the L3)")
    ap.add_argument("--scalar", action="store_true", help="the scalar kernels instead of AVX2")
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args(argv)
    types = [t for t in args.types.split(",") if t]
    for t in types:
        if t not in _C.GGML_TYPES:
            ap.error(f"--types: {t!r} is not one of {', '.join(_C.GGML_TYPES)}")
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",") if s]
    _C.set_force_scalar(args.scalar)
    rng = np.random.default_rng(0)
    rows = []
    print(f"{'type':>11} {'out x in':>12} {'thr':>3} {'us':>9} {'us min':>9} {'GB/s':>6} {'vs x16':>7}")
    for out, inp in shapes:
        for threads in [int(v) for v in args.threads.split(",")]:
            for row in bench_shape(out, inp, types, threads, args.rounds, int(args.min_mib * 2**20), rng):
                rows.append(row)
                print(f"{row['type']:>11} {f'{out}x{inp}':>12} {threads:>3} {row['us']:9.0f} {row['us_min']:9.0f} "
                      f"{row['gbps']:6.1f} {row['vs_x16']:7.2f}")
    _C.set_force_scalar(False)
    if args.json:
        write_json(args.json, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
