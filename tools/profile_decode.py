#!/usr/bin/env python3
"""Where a long_context decode token goes: each layer's attention (windows + store) per layer group, and the
store's own stage timings (score / top-k / attend) summed over the sparse layers, per token.

    python tools/profile_decode.py --config configs/quest.yaml --context 8192 --tokens 64 --threads 2

The sparse layers are those at or above the preset's dense_layer_num; their store stages come from
``KVStore.last_timing()`` read after every layer's attention. A profile, not a benchmark: the token runs
block by block (``NativeDecoder.decode_blocks``: qkv stage, the cache's attention, out stage) so that each
attention can be timed, instead of every block in one native call (compare tok/s with tools/bench_decode.py).
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import context_tokens  # noqa: E402

import ktquest  # noqa: E402
from ktquest.config import load_config  # noqa: E402
from ktquest.native.decode import NativeDecoder  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="GGUF path (default: the config's, else the bundled model)")
    ap.add_argument("--config", default="configs/quest.yaml", help="a long_context preset")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override")
    ap.add_argument("--context", type=int, default=8192, help="prompt tokens before decoding")
    ap.add_argument("--tokens", type=int, default=64, help="decode tokens measured")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    a = ap.parse_args(argv)

    sets = [f"threads={a.threads}", f"max_seq_len={a.context + a.tokens + 16}", *a.set]
    if a.model:
        sets.append(f"model={a.model}")
    eng = ktquest.load(config=load_config(a.config, sets))
    if eng.config.mode != "long_context":
        ap.error(f"--config {a.config}: mode is {eng.config.mode!r}, not long_context")
    if not isinstance(eng.model.decoder, NativeDecoder):
        ap.error("the native decode step is off (weights: dequantize, or not on the CPU): nothing to profile")
    torch.set_num_threads(a.threads)
    cache, store = eng.cache, eng.cache.store
    n_dense = eng.config.long_context.dense_layer_num
    tok = int(eng.prefill(context_tokens(eng.tokenizer, a.context), cache).argmax())

    attn_s: dict[str, float] = collections.defaultdict(float)
    stage_ms: dict[str, float] = collections.defaultdict(float)

    class TimedCache:
        """The cache as the block-by-block decode step sees it (its position and attention), each layer's
        attention timed."""

        @property
        def pos(self):
            return cache.pos

        def attend(self, layer, q, k, v, start_pos):
            t0 = time.perf_counter()
            out = cache.attend(layer, q, k, v, start_pos)
            attn_s["dense layers" if layer < n_dense else "sparse layers"] += time.perf_counter() - t0
            if layer >= n_dense:
                for key, ms in store.last_timing().items():
                    stage_ms[key] += ms
            return out

    timed = TimedCache()
    for _ in range(3):  # warm-up
        tok = int(eng.model.decoder.decode(tok, timed, planned=False).argmax())
    attn_s.clear()
    stage_ms.clear()
    t0 = time.perf_counter()
    for _ in range(a.tokens):
        tok = int(eng.model.decoder.decode(tok, timed, planned=False).argmax())
    total = time.perf_counter() - t0
    n = a.tokens
    print(f"{a.config}, context {a.context}, {a.threads} threads: {n / total:.1f} tok/s, {total / n * 1e3:.2f} ms/token")
    for k, v in attn_s.items():
        print(f"  attention, {k}: {v / n * 1e3:.3f} ms/token")
    print(f"  rest of the step (block stages, embedding, lm_head, Python): "
          f"{(total - sum(attn_s.values())) / n * 1e3:.3f} ms/token")
    for k, v in stage_ms.items():
        print(f"  store {k[:-3]} in the sparse layers: {v / n:.3f} ms/token")
    return 0


if __name__ == "__main__":
    sys.exit(main())
