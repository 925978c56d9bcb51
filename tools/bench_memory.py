#!/usr/bin/env python3
"""Peak memory of a prefill, per mode and prompt length: is the device side bounded by the windows?

Each (mode, context) runs in a fresh child process, so its peaks are its own. The child loads the model,
warms it up on a short prompt (weights faulted in, thread pool started), builds a fresh KV cache, then
prefills ``context`` tokens of natural text and reports:

- ``kv_device_bytes``: K/V the device holds (dense: its cache of max_seq_len tokens; long_context: the windows,
  fixed at construction). max_seq_len is the context + 64 unless --max-seq-len says otherwise.
- ``store_bytes``: the DRAM block store's blocks in use (long_context only).
- ``peak_growth_bytes``: how far the process's resident set rose above where it stood before the cache was
  made (Linux VmHWM, reset through /proc/self/clear_refs): on the CPU everything torch allocates, the KV and
  the working set of activations and temporaries, is in it.
- ``device_peak_bytes``: the peak of the device side alone. On a GPU: ``torch.cuda.max_memory_allocated()``
  over the prefill, less what was allocated before it. On the CPU, where the device and the DRAM store
  share one memory: ``peak_growth_bytes`` less the store's growth (the store's pages are committed as its
  blocks are written, never freed during a prefill).

A bounded device side shows as a ``device_peak_bytes`` that stays flat for long_context while it grows
with the prompt for dense. Example:

    python tools/bench_memory.py --contexts 1024,4096,8192,16384 --modes dense,long_context \
        --json tools/out/bench_memory.json
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import CONFIGS, context_tokens, mode_config, write_json  # noqa: E402

MODE_CONFIGS = {"dense": None, "long_context": os.fspath(CONFIGS / "snapkv.yaml")}


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def measure(model: str | None, mode: str, config: str | None, context: int, max_len: int, threads: int) -> dict:
    """One prefill of ``context`` tokens in this process; the figures listed in the module docstring."""
    import torch

    import ktquest
    from ktquest.config import load_config
    from ktquest.engine import make_cache

    torch.set_num_threads(threads)
    eng = ktquest.load(model=model, config=load_config(config, [f"threads={threads}", f"max_seq_len={max_len}"]))
    cfg, args = eng.config, eng.model.args
    tokens = context_tokens(eng.tokenizer, context)
    warm = make_cache(cfg, args, max_len, eng.device, eng.dtype)
    eng.prefill(tokens[:128], warm)  # weights faulted in, threads started
    del warm
    gc.collect()

    long_context = cfg.mode == "long_context"
    cuda = eng.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        cuda0 = torch.cuda.memory_allocated()
    with open("/proc/self/clear_refs", "w") as f:  # VmHWM := VmRSS
        f.write("5")
    rss0 = _status_kib("VmRSS") * 1024
    cache = make_cache(cfg, args, max_len, eng.device, eng.dtype)  # the cache's own allocation counts too
    store0 = cache.store.nbytes() if long_context else 0
    t0 = time.perf_counter()
    eng.prefill(tokens, cache)
    if cuda:
        torch.cuda.synchronize()
    prefill_s = time.perf_counter() - t0
    growth = _status_kib("VmHWM") * 1024 - rss0
    store = cache.store.nbytes() if long_context else 0
    if long_context:
        kv_device = cache.device_kv_bytes()
    else:  # the dense cache, grown to the context (in steps of half again)
        kv_device = cache.nbytes()
    row = dict(mode=cfg.mode, config=os.path.basename(config) if config else "default", context=context,
               max_seq_len=max_len, chunk_size=cfg.chunk_size, device=str(eng.device), kv_device_bytes=kv_device,
               store_bytes=store, peak_growth_bytes=growth, prefill_s=prefill_s)
    if cuda:
        row["device_peak_bytes"] = torch.cuda.max_memory_allocated() - cuda0
        row["device_peak_source"] = "torch.cuda.max_memory_allocated"
    else:
        row["device_peak_bytes"] = growth - (store - store0)
        row["device_peak_source"] = "VmHWM growth less the store's growth"
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="GGUF path or bundled model name (default: smollm2-135m)")
    ap.add_argument("--contexts", default="1024,4096,8192", help="comma-separated prompt lengths, tokens")
    ap.add_argument("--modes", default="dense,long_context",
                    help="dense, long_context (configs/snapkv.yaml) or preset names in configs/")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--max-seq-len", type=int, default=0,
                    help="cache capacity (default: each context + 64, what that prompt needs)")
    ap.add_argument("--json", default=None, help="write the rows here")
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)  # child: MODE,CONTEXT
    a = ap.parse_args(argv)
    modes = [m for m in a.modes.split(",") if m]
    try:
        configs = {m: mode_config(m, MODE_CONFIGS) for m in modes}
    except ValueError as e:
        ap.error(str(e))
    if a.one:
        mode, ctx = a.one.split(",")
        row = measure(a.model, mode, configs[mode], int(ctx), a.max_seq_len or int(ctx) + 64, a.threads)
        print(json.dumps(row))
        return 0
    rows = []
    mib = 1 << 20
    print(f"{'mode':>13} {'context':>8} {'device KV':>10} {'store':>10} {'RSS peak+':>10} {'device peak':>12} "
          f"{'prefill s':>10}  (MiB)")
    for mode in modes:
        for ctx in (int(c) for c in a.contexts.split(",") if c):
            cmd = [sys.executable, os.path.abspath(__file__), "--one", f"{mode},{ctx}", "--modes", mode,
                   "--threads", str(a.threads), "--max-seq-len", str(a.max_seq_len)]
            if a.model:
                cmd += ["--model", a.model]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode != 0:
                sys.stderr.write(proc.stderr)
                raise SystemExit(f"bench_memory: the run of {mode} at {ctx} tokens failed (exit {proc.returncode})")
            row = dict(json.loads(proc.stdout.strip().splitlines()[-1]), label=mode)
            rows.append(row)
            print(f"{mode:>13} {ctx:>8} {row['kv_device_bytes'] / mib:>10.1f} {row['store_bytes'] / mib:>10.1f} "
                  f"{row['peak_growth_bytes'] / mib:>10.1f} {row['device_peak_bytes'] / mib:>12.1f} "
                  f"{row['prefill_s']:>10.1f}", flush=True)
    if a.json:
        write_json(a.json, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
