#!/usr/bin/env python3
"""Prefill and decode speed of ktquest (per mode) and of llama.cpp on the same GGUF, side by side.

For each context length: the context is natural text (Python standard-library sources) tokenized by
the model's tokenizer; both engines get the same token ids and thread count. Prefill tok/s is the
context's tokens over the time to feed them; decode tok/s is greedy single-token steps right after
that context. Example:

    python tools/bench_decode.py --contexts 1024,4096,8192 --modes dense,long_context \
        --peer llama.cpp --json tools/out/bench_decode.json

A mode is `dense`, `long_context` (configs/quest.yaml unless --config says otherwise) or the name of a preset
in configs/ (`--modes quest,snapkv,ktransformers`); rows carry it as `label`.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import context_tokens, llama_cpp, write_json  # noqa: E402

import ktquest  # noqa: E402
from ktquest.bundled import bundled_model_path  # noqa: E402
from ktquest.config import load_config  # noqa: E402
from ktquest.generate import decode_one_token, prefill  # noqa: E402

MODE_CONFIGS = {"dense": None, "long_context": "configs/quest.yaml"}


def bench_ktquest(model_path, label: str, mode: str, config: str | None, contexts: list[int], decode_n: int, threads: int,
                  chunk_size: int, sets: list[str]) -> list[dict]:
    overrides = [f"threads={threads}", f"max_seq_len={max(contexts) + decode_n + 8}", *sets]
    if chunk_size:
        overrides.append(f"chunk_size={chunk_size}")
    if config is None and mode != "dense":
        overrides.append(f"mode={mode}")
    eng = ktquest.load(model=str(model_path), config=load_config(config, overrides))
    rows = []
    for ctx in contexts:
        tokens = context_tokens(eng.tokenizer, ctx)
        eng.cache.reset()
        gc.collect()
        t0 = time.perf_counter()
        logits = prefill(eng.model, eng.cache, tokens, eng.config.chunk_size)
        t_prefill = time.perf_counter() - t0
        tok = int(logits.argmax())
        decode_one_token(eng.model, eng.cache, tok)  # warm-up step, not timed
        t0 = time.perf_counter()
        for _ in range(decode_n):
            tok = int(decode_one_token(eng.model, eng.cache, tok).argmax())
        t_decode = time.perf_counter() - t0
        rows.append(dict(engine="ktquest", label=label, mode=eng.config.mode, config=config or "default", context=ctx,
                         prefill_tok_s=ctx / t_prefill, decode_tok_s=decode_n / t_decode, threads=threads,
                         prefill_s=t_prefill, decode_tokens=decode_n, chunk_size=eng.config.chunk_size,
                         decode_weights=eng.config.decode_weights))
        print(_fmt(rows[-1]), flush=True)
    del eng
    gc.collect()
    return rows


def bench_llama_cpp(model_path, contexts: list[int], decode_n: int, threads: int, tokenizer) -> list[dict]:
    lc = llama_cpp()
    if lc is None:
        print("llama-cpp-python is not installed: no peer rows", file=sys.stderr)
        return []
    rows = []
    for ctx in contexts:
        tokens = context_tokens(tokenizer, ctx)
        llm = lc.Llama(model_path=str(model_path), n_ctx=ctx + decode_n + 16, n_threads=threads,
                       n_threads_batch=threads, n_batch=512, verbose=False)
        t0 = time.perf_counter()
        llm.eval(tokens)
        t_prefill = time.perf_counter() - t0
        tok = _last_argmax(llm)
        llm.eval([tok])  # warm-up step, not timed
        t0 = time.perf_counter()
        for _ in range(decode_n):
            tok = _last_argmax(llm)
            llm.eval([tok])
        t_decode = time.perf_counter() - t0
        rows.append(dict(engine="llama.cpp", label="llama.cpp", mode="dense", config="llama.cpp defaults (F16 KV)", context=ctx,
                         prefill_tok_s=ctx / t_prefill, decode_tok_s=decode_n / t_decode, threads=threads,
                         prefill_s=t_prefill, decode_tokens=decode_n,
                         version=getattr(lc, "__version__", "?")))
        print(_fmt(rows[-1]), flush=True)
        del llm
        gc.collect()
    return rows


def _last_argmax(llm) -> int:
    """Greedy next token after llm.eval: the logits of the last evaluated token (the only ones kept)."""
    import numpy as np

    return int(np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(llm.n_vocab(),)).argmax())


def _fmt(r: dict) -> str:
    return (f"{r['engine']:>9} {r['label']:>13} ctx {r['context']:>7}: prefill {r['prefill_tok_s']:8.1f} tok/s  "
            f"decode {r['decode_tok_s']:7.2f} tok/s")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="GGUF path (default: the bundled SmolLM2-135M-Instruct)")
    ap.add_argument("--contexts", default="1024,4096,8192", help="comma-separated context lengths, tokens")
    ap.add_argument("--modes", default="dense",
                    help="comma-separated: dense, long_context, or preset names from configs/ (quest, snapkv, ...)")
    ap.add_argument("--config", action="append", default=[],
                    help="MODE=YAML to bench a mode with a given preset (default long_context=configs/quest.yaml)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override for ktquest")
    ap.add_argument("--peer", default="llama.cpp", help="'llama.cpp' (when installed) or 'none'")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--decode-tokens", type=int, default=32)
    ap.add_argument("--chunk-size", type=int, default=0, help="prefill chunk (default: the config's)")
    ap.add_argument("--json", default=None, help="write the rows here")
    a = ap.parse_args(argv)

    model_path = a.model or bundled_model_path()
    contexts = [int(c) for c in a.contexts.split(",") if c]
    modes = [m for m in a.modes.split(",") if m]
    configs = dict(MODE_CONFIGS)
    for item in a.config:
        mode, _, path = item.partition("=")
        configs[mode] = path
    torch.set_num_threads(a.threads)
    rows: list[dict] = []
    tokenizer = None
    presets = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")
    for mode in modes:
        if mode not in configs:
            path = os.path.join(presets, f"{mode}.yaml")
            if not os.path.isfile(path):
                known = sorted(set(configs) | {f[:-5] for f in os.listdir(presets) if f.endswith(".yaml")})
                ap.error(f"--modes: unknown mode or preset {mode!r}; known: {', '.join(known)}")
            configs[mode] = path
        rows += bench_ktquest(model_path, mode, "long_context" if mode not in MODE_CONFIGS else mode, configs[mode],
                              contexts, a.decode_tokens, a.threads, a.chunk_size, a.set)
    if a.peer == "llama.cpp":
        from ktquest.gguf_loader import read_gguf
        from ktquest.tokenizer import Tokenizer

        tokenizer = Tokenizer.from_gguf_metadata(read_gguf(model_path).metadata)
        rows += bench_llama_cpp(model_path, contexts, a.decode_tokens, a.threads, tokenizer)

    print()
    print("| engine | mode / preset | context | prefill tok/s | decode tok/s |")
    print("|---|---|---:|---:|---:|")
    for r in rows:
        print(f"| {r['engine']} | {r['label']} | {r['context']} | {r['prefill_tok_s']:.1f} | {r['decode_tok_s']:.2f} |")
    peer = {r["context"]: r for r in rows if r["engine"] == "llama.cpp"}
    if peer:
        print()
        for r in rows:
            if r["engine"] == "ktquest" and r["context"] in peer:
                p = peer[r["context"]]
                print(f"ktquest {r['label']} / llama.cpp at {r['context']}: prefill "
                      f"{r['prefill_tok_s'] / p['prefill_tok_s']:.2f}x, decode {r['decode_tok_s'] / p['decode_tok_s']:.2f}x")
    if len(contexts) > 1:
        lo, hi = min(contexts), max(contexts)
        for label in dict.fromkeys(r["label"] for r in rows):
            by_ctx = {r["context"]: r["decode_tok_s"] for r in rows if r["label"] == label}
            if lo in by_ctx and hi in by_ctx:
                print(f"{label}: decode at {hi} is {by_ctx[hi] / by_ctx[lo]:.0%} of its speed at {lo}")
    if a.json:
        write_json(a.json, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
