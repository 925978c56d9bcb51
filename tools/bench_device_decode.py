#!/usr/bin/env python3
"""Decode on a GPU: the device step (models/device_step.py) beside the forward pass it replaces, from one state.

Loads the model once (weights dequantized to the compute dtype on the device), then for each context builds a
fresh cache, prefills that many tokens of natural text layer by layer (timed: ``prefill_tok_s``) and decodes
``--decode-tokens`` greedy tokens with each step of ``--steps``. Before each step the cache is cut back to the
prompt less its last token, which is read again (as a chat's next turn reads at least one token), so every step
starts from the same state, SnapKV's candidates chosen again as they were, and feeds the same first token (a
cache cut back to the prompt's end itself would decode without candidates: ``truncate`` drops them):

- ``torch``: the forward pass a layer at a time (``TorchDecoder``: what a GPU ran before);
- ``eager``: the device step without CUDA graphs (``CudaLane(graphs=False)``);
- ``device``: the device step (CUDA graphs, pinned buffers, the store part overlapped with the window's).

Each step's row: ``first_ms`` (its first token, which captures nothing yet), ``tok_s`` over the tokens after
the first two (the second captures), its tokens, and against the first step: how many greedy tokens agree
before the first difference and the first token's largest logit difference relative to the logits' range.
``--timeline`` tokens more with the device step traced: per token the time the GPU works (CUDA events around
each graph), the CPU operator works (the store parts), both, and neither (launches, copies, waits).

    python tools/bench_device_decode.py --model /tmp/q15.gguf --contexts 8192,32768,131072 --configs quest,million \
        --json tools/out/bench_device_decode.json
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import CONFIGS, context_tokens, write_json  # noqa: E402


def split(trace: list, e0, h0: float, end_ms: float, elapsed) -> dict:
    """A traced token's time split on a 1-us grid over [0, end_ms]: GPU busy (device spans), CPU operator busy
    (host spans), both, neither (ms)."""
    n = max(1, int(end_ms * 1000) + 1)
    gpu, cpu = np.zeros(n, bool), np.zeros(n, bool)
    for kind, _, a, b in trace:
        if kind == "device":
            lo, hi = elapsed(e0, a), elapsed(e0, b)
        else:
            lo, hi = (a - h0) * 1e3, (b - h0) * 1e3
        gpu_or_cpu = gpu if kind == "device" else cpu
        gpu_or_cpu[max(0, int(lo * 1000)): max(0, min(n, int(hi * 1000) + 1))] = True
    us = 1e-3
    return dict(total_ms=end_ms, gpu_ms=gpu.sum() * us, cpu_ms=cpu.sum() * us, both_ms=(gpu & cpu).sum() * us,
                gpu_only_ms=(gpu & ~cpu).sum() * us, cpu_only_ms=(cpu & ~gpu).sum() * us,
                neither_ms=(~gpu & ~cpu).sum() * us)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="GGUF path or bundled model name")
    ap.add_argument("--configs", default="quest", help="presets (configs/NAME.yaml) or YAML paths, comma-separated: "
                    "the model is loaded once, each runs every context")
    ap.add_argument("--contexts", default="8192,32768")
    ap.add_argument("--steps", default="torch,eager,device")
    ap.add_argument("--set", action="append", default=[], help="config KEY=VALUE (repeatable)")
    ap.add_argument("--decode-tokens", type=int, default=32)
    ap.add_argument("--timeline", type=int, default=8, help="traced device-step tokens a context (0: none)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)

    import torch

    import ktquest
    from ktquest.config import load_config
    from ktquest.engine import make_cache
    from ktquest.models.device_lane import CudaLane, FakeLane
    from ktquest.models.device_step import DeviceDecoder
    from ktquest.models.llama import TorchDecoder

    contexts = [int(c) for c in a.contexts.split(",") if c]
    max_len = max(contexts) + a.decode_tokens + a.timeline + 64
    paths = [c if c.endswith(".yaml") else os.fspath(CONFIGS / f"{c}.yaml") for c in a.configs.split(",") if c]
    # every prompt read exactly, layer by layer (a sparse prefill's chunk order sends each chunk to the CPU)
    cfgs = [load_config(c, [f"max_seq_len={max_len}", "prefill.mode=exact", "prefill.order=layer", *a.set])
            for c in paths]
    t0 = time.perf_counter()
    eng = ktquest.load(a.model, cfgs[0])
    load_s = time.perf_counter() - t0
    weights_bytes = torch.cuda.memory_allocated() if eng.device.type == "cuda" else 0
    cuda = eng.device.type == "cuda"
    model, args = eng.model, eng.model.args
    tokens = context_tokens(eng.tokenizer, max(contexts))

    def lane(graphs=True, timing=False):
        return CudaLane(eng.device, graphs, timing) if cuda else FakeLane()

    def sync():
        if cuda:
            torch.cuda.synchronize()

    makers = {"torch": lambda: TorchDecoder(model), "eager": lambda: DeviceDecoder(model, lane(graphs=False)),
              "device": lambda: DeviceDecoder(model, lane())}
    steps = [s for s in a.steps.split(",") if s]

    def again(cache, ctx: int) -> int:
        """The prompt's last token read again after the cache is cut back before it: the first greedy token."""
        cache.truncate(ctx - 1)
        return int(eng.prefill(tokens[ctx - 1: ctx], cache).argmax())

    gpu = torch.cuda.get_device_name() if cuda else "cpu"
    print(f"{a.model}: {eng.weights_note}")
    print(f"{a.model}: loaded in {load_s:.1f} s on {eng.device} ({eng.dtype}), {gpu}; {a.set}; weights {weights_bytes / 2**30:.2f} GiB on the device")
    rows = []
    with torch.inference_mode():
        eng.prefill(tokens[:1024], make_cache(eng.config, args, max_len, eng.device, eng.dtype))  # warm kernels
        for path, cfg, ctx in ((p, c, n) for p, c in zip(paths, cfgs) for n in contexts):
            eng.config = cfg
            name_cfg = os.path.basename(path).removesuffix(".yaml")
            cache = make_cache(eng.config, args, max_len, eng.device, eng.dtype)
            sync()
            t0 = time.perf_counter()
            eng.prefill(tokens[:ctx], cache)
            sync()
            prefill_s = time.perf_counter() - t0
            row = dict(config=name_cfg, context=ctx, prefill_s=prefill_s, prefill_tok_s=ctx / prefill_s, steps={})
            ref = None
            for name in steps:
                first_tok = again(cache, ctx)
                dec = makers[name]()
                tok, out, times, first_logits = first_tok, [], [], None
                for _ in range(a.decode_tokens):
                    t0 = time.perf_counter()
                    lg = dec.decode(tok, cache)
                    tok = int(lg.argmax())
                    times.append(time.perf_counter() - t0)
                    out.append(tok)
                    first_logits = lg.float().cpu() if first_logits is None else first_logits
                steady = times[2:] or times
                r = dict(first_ms=times[0] * 1e3, tok_s=len(steady) / sum(steady), tokens=out)
                if ref is None:
                    ref = (out, first_logits)
                else:
                    agree = next((i for i, (x, y) in enumerate(zip(out, ref[0])) if x != y), len(out))
                    span = float(ref[1].max() - ref[1].min())
                    r |= dict(agree=agree, logit_diff=float((first_logits - ref[1]).abs().max()) / span)
                if isinstance(dec, DeviceDecoder) and cuda and dec.lane.failed:
                    r["graphs_failed"] = dec.lane.failed
                row["steps"][name] = r
                print(f"{name_cfg:>10} {ctx:>8}: {name:>6} first {r['first_ms']:7.1f} ms, {r['tok_s']:7.1f} tok/s"
                      + (f", agree {r['agree']}/{len(out)}, logit diff {r['logit_diff']:.2e}" if "agree" in r
                         else f" (prefill {prefill_s:.2f} s, {ctx / prefill_s:,.0f} tok/s)"), flush=True)
            if a.timeline and cuda:
                first_tok = again(cache, ctx)
                dec = DeviceDecoder(model, lane(timing=True))
                tok, spans = first_tok, []
                for i in range(a.timeline + 2):
                    dec.trace = [] if i >= 2 else None  # (the first two: warm-up and capture)
                    e0 = dec.lane.mark()
                    h0 = time.perf_counter()
                    tok = int(dec.decode(tok, cache).argmax())
                    end_ms = (time.perf_counter() - h0) * 1e3
                    if dec.trace is not None:
                        spans.append(split(dec.trace, e0, h0, end_ms, CudaLane.elapsed_ms))
                tl = {k: float(np.mean([s[k] for s in spans])) for k in spans[0]}
                row["timeline"] = tl
                print(f"{name_cfg:>10} {ctx:>8}: a token {tl['total_ms']:.2f} ms: GPU {tl['gpu_ms']:.2f}, CPU operator "
                      f"{tl['cpu_ms']:.2f}, both {tl['both_ms']:.2f}, GPU only {tl['gpu_only_ms']:.2f}, CPU only "
                      f"{tl['cpu_only_ms']:.2f}, neither {tl['neither_ms']:.2f}", flush=True)
            rows.append(row)
            del cache
    if a.json:
        write_json(a.json, dict(model=os.fspath(a.model), configs=paths, overrides=a.set, gpu=gpu,
                                weights=eng.weights, weights_note=eng.weights_note,
                                weights_device_bytes=weights_bytes,
                                dtype=str(eng.dtype), load_s=load_s, threads=eng.config.resolved_threads(),
                                rows=rows, long_context={os.path.basename(p): dataclasses.asdict(c.long_context)
                                                         for p, c in zip(paths, cfgs)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
