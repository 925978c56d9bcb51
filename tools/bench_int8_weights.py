#!/usr/bin/env python3
"""Weight-only int8 matmuls on a GPU against fp16, for a decode token (one row) on a model's matrix shapes:
what ``weights: int8`` would cost where fp16 weights do not fit (layers/linear.py).

For each shape [out, in] (Qwen2.5-7B's by default) and each kernel: microseconds a call (CUDA events, the median
of ``--reps`` after a warm-up) and the weight bytes it streams per microsecond.

- ``fp16``: ``F.linear`` on fp16 weights (what the device step runs);
- ``int8pack``: ``torch._weight_int8pack_mm`` (int8 weights, a scale a row), in each activation dtype it takes;
- ``dequant``: the int8 weights cast to fp16 then ``F.linear`` (the portable fallback).
"""

from __future__ import annotations

import argparse
import json


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="4608x3584,3584x3584,37888x3584,3584x18944,152064x3584")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)

    import torch
    import torch.nn.functional as F

    dev = torch.device("cuda")

    def timed(fn) -> float:
        for _ in range(3):
            fn()
        evs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(a.reps)]
        for s, e in evs:
            s.record()
            fn()
            e.record()
        torch.cuda.synchronize()
        return sorted(s.elapsed_time(e) for s, e in evs)[a.reps // 2] * 1e3  # us

    rows = []
    for shape in a.shapes.split(","):
        n, k = map(int, shape.split("x"))
        w16 = torch.randn(n, k, device=dev, dtype=torch.float16) * 0.02
        scale = w16.abs().amax(1).float() / 127
        w8 = (w16.float() / scale[:, None]).round().clamp(-127, 127).to(torch.int8)
        x = torch.randn(1, k, device=dev, dtype=torch.float16)
        ref = F.linear(x, w16).float()
        row = dict(shape=[n, k], fp16_us=timed(lambda: F.linear(x, w16)))
        row["dequant_us"] = timed(lambda: F.linear(x, w8.to(torch.float16)) * scale.half())
        for dt in (torch.float16, torch.bfloat16, torch.float32):
            name = f"int8pack_{str(dt).removeprefix('torch.')}"
            try:
                xd, sd = x.to(dt), scale.to(dt)
                y = torch._weight_int8pack_mm(xd, w8, sd)
                row[name + "_err"] = float((y.float() - ref).abs().max() / ref.abs().max())
                row[name + "_us"] = timed(lambda: torch._weight_int8pack_mm(xd, w8, sd))
            except Exception as e:  # noqa: BLE001 -- not in this build, or not for this dtype
                row[name] = f"{type(e).__name__}: {str(e)[:120]}"
        row["fp16_gb_s"] = n * k * 2 / row["fp16_us"] / 1e3
        rows.append(row)
        print(json.dumps(row), flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
