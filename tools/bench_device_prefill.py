#!/usr/bin/env python3
"""Prefill on the device: time, device memory at its peak against the bound the engine reports, decode after it.

Loads the model once (on a GPU its weights are dequantized to the compute dtype: one load for every row),
then for each (order, slab, context) builds a fresh cache, prefills ``context`` tokens of natural text and
decodes a few tokens. Each row:

- ``prefill_s``, ``prefill_tok_s``; ``decode_tok_s`` over ``--decode-tokens`` greedy tokens after it;
- ``device_peak_bytes``: on a GPU ``torch.cuda.max_memory_allocated()`` over the prefill less what was
  allocated before it (the weights and the cache's windows);
- ``device_bound_bytes``: ``Engine.prefill_device_bytes()`` for that order and slab, for the longest prompt
  the cache takes (0 in chunk order, whose device side is the windows and one chunk); ``workspace_bytes``: the
  cache's part of it for this prompt or slab (``prefill_device_bytes(n)``: one layer's K/V and the rest);
- ``store_bytes``: the DRAM store's blocks in use after the prefill.

Example (a lent GPU, a model of Qwen2.5-1.5B's shapes written by make_shaped_gguf.py):

    python tools/bench_device_prefill.py --model /tmp/q15.gguf --contexts 8192,32768,131072 \
        --rows chunk:0:8192,layer:0,layer:32768:131072 --json tools/out/bench_device_prefill.json
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import CONFIGS, context_tokens, write_json  # noqa: E402


def parse_rows(spec: str, contexts: list[int]) -> list[tuple[str, int, int]]:
    """Comma-separated 'order:slab[:context]' items -> (order, slab, context) rows; no context: each of contexts."""
    rows = []
    for item in spec.split(","):
        parts = item.split(":")
        if parts[0] not in ("chunk", "layer") or len(parts) not in (2, 3):
            raise SystemExit(f"bench_device_prefill: --rows item {item!r}: expected order:slab[:context]")
        ctxs = [int(parts[2])] if len(parts) == 3 else contexts
        rows += [(parts[0], int(parts[1]), c) for c in ctxs]
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="GGUF path or bundled model name")
    ap.add_argument("--config", default=os.fspath(CONFIGS / "quest.yaml"))
    ap.add_argument("--contexts", default="8192,32768")
    ap.add_argument("--rows", default="chunk:0,layer:0",
                    help="order:slab[:context] items; an item without a context runs every --contexts")
    ap.add_argument("--set", action="append", default=[], help="config KEY=VALUE (repeatable)")
    ap.add_argument("--decode-tokens", type=int, default=16)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)

    import torch

    import ktquest
    from ktquest.config import load_config
    from ktquest.engine import make_cache
    from ktquest.generate import decode_one_token

    contexts = [int(c) for c in a.contexts.split(",") if c]
    rows = parse_rows(a.rows, contexts)
    max_len = max(c for _, _, c in rows) + a.decode_tokens + 64
    cfg = load_config(a.config, [f"max_seq_len={max_len}", *a.set])
    t0 = time.perf_counter()
    eng = ktquest.load(a.model, cfg)
    load_s = time.perf_counter() - t0
    cuda = eng.device.type == "cuda"
    tokens = context_tokens(eng.tokenizer, max(c for _, _, c in rows))
    args, mib = eng.model.args, 1 << 20
    print(f"{a.model}: loaded in {load_s:.1f} s on {eng.device} ({eng.dtype}), "
          f"{torch.cuda.get_device_name() if cuda else 'cpu'}; config {os.path.basename(a.config)} {a.set}")
    print(f"{'order':>5} {'slab':>6} {'context':>8} {'prefill s':>9} {'tok/s':>8} {'peak MiB':>9} "
          f"{'bound MiB':>9} {'workspace':>9} {'store MiB':>9} {'decode tok/s':>12}")
    out = []
    warm = True
    for order, slab, ctx in rows:
        eng.config = dataclasses.replace(cfg, prefill=dataclasses.replace(cfg.prefill, order=order,
                                                                          slab_tokens=slab))
        if warm:  # kernels loaded, the allocator's pools made
            eng.prefill(tokens[:2048], make_cache(eng.config, args, max_len, eng.device, eng.dtype))
            warm = False
        cache = make_cache(eng.config, args, max_len, eng.device, eng.dtype)
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        t0 = time.perf_counter()
        logits = eng.prefill(tokens[:ctx], cache)
        if cuda:
            torch.cuda.synchronize()
        prefill_s = time.perf_counter() - t0
        peak = torch.cuda.max_memory_allocated() - base if cuda else 0
        tok = int(logits.argmax())
        t0 = time.perf_counter()
        for _ in range(a.decode_tokens):
            tok = int(decode_one_token(eng.model, cache, tok).argmax())
        decode_s = time.perf_counter() - t0
        n_work = min(slab, ctx) if order == "layer" and slab else ctx
        workspace = cache.prefill_device_bytes(n_work) if order == "layer" else 0
        row = dict(order=order, slab_tokens=slab, context=ctx, prefill_s=prefill_s, prefill_tok_s=ctx / prefill_s,
                   device_peak_bytes=peak, device_bound_bytes=eng.prefill_device_bytes(),
                   workspace_bytes=workspace,
                   store_bytes=cache.store.nbytes() if hasattr(cache, "store") else 0,
                   decode_tok_s=a.decode_tokens / decode_s, device=str(eng.device), dtype=str(eng.dtype),
                   chunk_size=eng.config.chunk_size, load_s=load_s)
        out.append(row)
        print(f"{order:>5} {slab:>6} {ctx:>8} {prefill_s:>9.2f} {row['prefill_tok_s']:>8.0f} {peak / mib:>9.1f} "
              f"{row['device_bound_bytes'] / mib:>9.1f} {workspace / mib:>9.1f} {row['store_bytes'] / mib:>9.1f} "
              f"{row['decode_tok_s']:>12.1f}", flush=True)
        del cache
    if a.json:
        write_json(a.json, dict(model=os.fspath(a.model), config=a.config, overrides=a.set,
                                gpu=torch.cuda.get_device_name() if cuda else None, rows=out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
