#!/usr/bin/env python3
"""ktquest and llama.cpp on one GGUF, each (engine, context) in a fresh process: the speed and the memory a
user of either sees, with nothing of the other engine in the process.

bench_decode.py runs both engines in one process, which is fine while the model is small. A model near the
machine's RAM is not: llama.cpp repacks its weights into memory of its own on AVX2 (its "extra buffer
types": a copy of every Q4_K matrix, all 128 experts' of a Qwen3-30B-A3B), and beside it the other engine's
mapped pages are evicted and read again from disk. Here each cell is a child process that loads the model,
prefills ``context`` tokens of natural text (tools/common.context_tokens: the same ids for both engines),
decodes ``--decode-tokens`` greedy tokens, and reports:

- ``load_s``, ``prefill_tok_s`` (the context's tokens over the time to feed them), ``first_token_s`` (from
  the prompt's end to the first token picked and fed: bench_decode.py's; None for a filled cache),
  ``decode_tok_s`` (the steady speed after it);
- ``peak_rss_mib``: the process's peak resident set (VmHWM: mapped file pages it touched count, as they do
  in what ``top`` shows), ``rss_anon_mib`` and ``rss_file_mib`` at the end (its own memory, and the
  file's pages it has resident).

Cells run in ``--rounds`` rounds, in turn (A B A B; every other round in reverse), so a drift of a noisy host
hits both engines alike; the table gives each cell's median over the rounds and the ratios ktquest /
llama.cpp taken within each round. The model file is read once first, so every cell starts with it in the
page cache. Engines: ``ktquest:MODE`` (dense, or a preset of configs/: quest, snapkv, ...),
``ktquest-synthetic:MODE`` (the context's K/V made up, no prefill: bench_decode.py --synthetic), ``llama.cpp``
(its defaults: F16 KV, weights repacked where it does so) and ``llama.cpp-mapped`` (``use_extra_bufts``
off: every weight read from the mapping, as ktquest reads them).

Long contexts without llama.cpp's prefill (``--llama-fill twin --twin-shape SHAPE``): a 16K prefill of a
Qwen3-30B-A3B takes llama.cpp over half an hour on two cores, most of it in the 32 query heads' attention and
the experts, neither of which its dense decode step's speed depends on: that reads every cached K/V row
whatever their values. So its cache is filled by a twin: the same shape (make_shaped_gguf.py's SHAPE) with
as many query heads as KV heads and a token of FFN, prefilled with the same ids; its state (the K/V rows, of
the same layers, KV heads, head_dim and vocabulary) is loaded into the real model's context, which then
decodes at position ``context``. ``prefill_tok_s`` of such a cell is the twin's, not a figure to compare.
Check it against a real prefill at a length both can do (the ``llama.cpp`` and ``llama.cpp-twin`` cells at
one context). ``llama.cpp-filled`` goes further, where even the twin's prefill takes hours (128K tokens): its
cache is a sequence-state file of zero K/V rows written directly and loaded (llama_state.py); its
``prefill_tok_s`` is the file's writing and loading. Example:

    python tools/bench_engines.py --model /work/shaped/qwen3-30b-a3b-q4_k_m.gguf --contexts 1024,4096 \
        --engines ktquest:dense,llama.cpp,llama.cpp-mapped --rounds 2 --json tools/out/bench_engines.json
    python tools/bench_engines.py --model /work/shaped/qwen3-30b-a3b-q4_k_m.gguf --contexts 4096 \
        --engines llama.cpp,llama.cpp-twin --twin-shape qwen3-30b-a3b
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import write_json  # noqa: E402

READ_CHUNK = 64 << 20
LLAMA_ENGINES = ("llama.cpp", "llama.cpp-mapped", "llama.cpp-twin", "llama.cpp-filled")


def _status_mib(fields: tuple[str, ...]) -> dict[str, float]:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key = line.split(":")[0]
            if key in fields:
                out[key] = int(line.split()[1]) / 1024
    return out


def twin_path(model: str, shape_name: str) -> str:
    """The KV twin of ``shape_name`` (written beside ``model`` once): as many query heads as KV heads, an FFN
    of one 32-block, 8 experts of one block where the shape has experts (llama.cpp's state checks the
    layers, KV rows and vocabulary only)."""
    import dataclasses
    from pathlib import Path

    import make_shaped_gguf as shaped

    shape = shaped.SHAPES[shape_name]
    twin = dataclasses.replace(shape, n_heads=shape.n_kv_heads, ffn=32, head_dim=shape.head_size,
                               experts=None if shape.experts is None else (8, 1, 32))
    out = Path(model).with_name(f"{shape_name}-kvtwin-{shape.n_layers}x{shape.n_kv_heads}x{shape.head_size}.gguf")
    if not out.exists():
        shaped.write_shaped_gguf(out, twin, f"{shape_name} KV twin", ftype="Q8_0")
    return str(out)


def llama_twin_fill(runner, lc, model: str, twin: str, context: int) -> float:
    """``runner``'s cell for ``context`` filled by the twin's prefill (module docstring); the twin's seconds."""
    import bench_decode as bd

    tokens = bd.context_tokens(runner.tokenizer, context)
    kw = dict(n_ctx=runner.max_len, n_threads=runner.threads, n_threads_batch=runner.threads, n_batch=512,
              verbose=False, swa_full=False)
    t0 = time.perf_counter()
    src = lc.Llama(model_path=twin, **kw)
    src.eval(tokens)
    seconds = time.perf_counter() - t0
    state = src.save_state()
    del src
    llm = lc.Llama(model_path=model, **kw)
    llm.load_state(state)
    if llm.n_tokens != context:
        raise SystemExit(f"the twin's state holds {llm.n_tokens} tokens, not {context}")
    llm.eval([tokens[-1]])  # warm-up step at position `context`, not timed (its K/V the real model's)
    runner.state[context] = [llm, bd._last_argmax(llm)]
    return seconds


def llama_state_fill(runner, lc, model: str, context: int) -> float:
    """``runner``'s cell for ``context`` filled by a sequence-state file of zero K/V rows (llama_state.py); the
    seconds to write and load it."""
    import bench_decode as bd
    import llama_state

    tokens = bd.context_tokens(runner.tokenizer, context)
    llm = lc.Llama(model_path=model, n_ctx=runner.max_len, n_threads=runner.threads,
                   n_threads_batch=runner.threads, n_batch=512, verbose=False, swa_full=False)
    layout = llama_state.probe(lc, llm, tokens)
    path = f"{model}.{os.getpid()}.seqstate"
    t0 = time.perf_counter()
    try:
        llama_state.write_file(path, layout, tokens)
        llama_state.load_file(lc, llm, path, tokens)
    finally:
        if os.path.exists(path):
            os.unlink(path)
    seconds = time.perf_counter() - t0
    llm.eval([tokens[-1]])  # warm-up step at position `context`, not timed
    runner.state[context] = [llm, bd._last_argmax(llm)]
    return seconds


def child(engine: str, model: str, context: int, decode_n: int, threads: int, max_len: int,
          twin_shape: str | None = None, llama_kv: str = "f16", sets: tuple[str, ...] = ()) -> dict:
    """One cell, in this process: load, prefill, decode; the figures."""
    import ktquest

    if engine.startswith("ktquest"):
        ktquest.set_openmp_spin()  # as the CLI runs (no llama.cpp in this process); before torch loads
    import bench_decode as bd  # (imports torch)

    t0 = time.perf_counter()
    if engine.startswith("ktquest"):
        mode = engine.split(":", 1)[1]
        config = bd.mode_config(mode, dict(bd.MODE_CONFIGS))
        synthetic = engine.startswith("ktquest-synthetic:")
        sets = [*sets, *(["prefill.mode=exact"] if synthetic and mode != "dense" else [])]  # (as --synthetic does)
        runner = bd.KtquestRunner(model, mode, mode, config, max_len, threads, 0, sets, synthetic=synthetic)
    else:
        lc = bd.llama_cpp()
        if lc is None:
            raise SystemExit("llama-cpp-python is not installed")
        if engine == "llama.cpp-mapped":  # every weight read in place from the mapping, none repacked
            api = lc.llama_cpp  # (where llama_cpp.Llama takes its default model parameters from)
            default = api.llama_model_default_params

            def mapped_params():
                p = default()
                p.use_extra_bufts = False
                return p
            api.llama_model_default_params = mapped_params
        if llama_kv == "q8_0":  # a quantized V cache needs llama.cpp's flash attention
            import functools
            import types
            lc = types.SimpleNamespace(**{k: getattr(lc, k) for k in dir(lc) if not k.startswith("__")})
            lc.Llama = functools.partial(lc.Llama, type_k=lc.GGML_TYPE_Q8_0, type_v=lc.GGML_TYPE_Q8_0,
                                         flash_attn=True)
        from ktquest.formats.tokenizer import Tokenizer
        from ktquest.models.loader import read_gguf
        tokenizer = Tokenizer.from_gguf_metadata(read_gguf(model).metadata)
        runner = bd.LlamaCppRunner(lc, model, max_len, threads, tokenizer)
    load_s = time.perf_counter() - t0  # (llama.cpp's model load is added below: prefill() makes it)
    if engine == "llama.cpp-twin":
        prefill_s = llama_twin_fill(runner, lc, model, twin_path(model, twin_shape), context)
    elif engine == "llama.cpp-filled":
        prefill_s = llama_state_fill(runner, lc, model, context)
    else:
        prefill_s = runner.prefill(context)
    load_s += getattr(runner, "model_load_s", 0.0)  # llama.cpp: its model is made in prefill(), before the timer
    decode_s = runner.decode(context, decode_n)
    mem = _status_mib(("VmHWM", "RssAnon", "RssFile"))
    kv = runner.memory(context) if hasattr(runner, "memory") else {}  # ktquest: its KV's and store's MiB
    return dict(engine=engine, context=context, threads=threads, decode_tokens=decode_n, load_s=load_s,
                prefill_s=prefill_s, prefill_tok_s=context / prefill_s,
                first_token_s=runner.first_token_s.get(context), decode_tok_s=decode_n / decode_s,
                peak_rss_mib=mem["VmHWM"], rss_anon_mib=mem["RssAnon"], rss_file_mib=mem["RssFile"], **kv)


def warm_page_cache(path: str) -> float:
    """Read ``path`` once (into the page cache); the seconds it took."""
    t0 = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        while f.read(READ_CHUNK):
            pass
    return time.perf_counter() - t0


def run_cell(args, engine: str, context: int) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--one", f"{engine},{context}", "--model", args.model,
           "--threads", str(args.threads), "--decode-tokens", str(args.decode_tokens),
           "--max-seq-len", str(args.max_seq_len), "--llama-kv", args.llama_kv, *[f"--set={kv}" for kv in args.set],
           *(["--twin-shape", args.twin_shape] if args.twin_shape else [])]
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:  # (a cell the machine cannot hold: the RAM check's refusal says what it needs)
        error = (p.stderr.strip().splitlines() or [f"exit status {p.returncode}"])[-1]
        print(f"  {engine:>18} ctx {context:>6}: failed: {error}", flush=True)
        return dict(engine=engine, context=context, error=error)
    row = json.loads(p.stdout.strip().splitlines()[-1])
    first = row.get("first_token_s")
    print(f"  {engine:>18} ctx {context:>6}: prefill {row['prefill_tok_s']:7.1f} tok/s, first token "
          f"{'-' if first is None else f'{first:.2f} s'}, decode "
          f"{row['decode_tok_s']:6.2f} tok/s, peak RSS {row['peak_rss_mib']:8.0f} MiB (anon "
          f"{row['rss_anon_mib']:.0f}, file {row['rss_file_mib']:.0f})", flush=True)
    return row


def summarize(rows: list[dict], engines: list[str], contexts: list[int], rounds: int) -> None:
    keys = ("prefill_tok_s", "decode_tok_s", "peak_rss_mib")
    print("\n| engine | context | prefill tok/s | first token s | decode tok/s | peak RSS MiB | anon MiB "
          "| file MiB |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    cell = {}
    for e in engines:
        for c in contexts:
            rs = [r for r in rows if r["engine"] == e and r["context"] == c and "error" not in r]
            cell[e, c] = rs
            if not rs:
                print(f"| {e} | {c:,} | failed | | | | | |")
                continue
            med = {k: statistics.median(r[k] for r in rs) for k in (*keys, "rss_anon_mib", "rss_file_mib")}
            firsts = [r["first_token_s"] for r in rs if r.get("first_token_s") is not None]
            first = f"{statistics.median(firsts):.3f}" if firsts else "-"
            print(f"| {e} | {c:,} | {med['prefill_tok_s']:.1f} | {first} | {med['decode_tok_s']:.2f} | "
                  f"{med['peak_rss_mib']:,.0f} | {med['rss_anon_mib']:,.0f} | {med['rss_file_mib']:,.0f} |")
    peers = [e for e in engines if e.startswith("llama.cpp")]
    for e in (e for e in engines if e.startswith("ktquest")):
        for p in peers:
            for c in (c for c in contexts if cell[e, c] and cell[p, c]):
                ratios = {k: [a[k] / b[k] for a, b in zip(cell[e, c], cell[p, c], strict=True)] for k in keys}
                print(f"{e} / {p} at {c:,}: " + ", ".join(
                    f"{k.removesuffix('_tok_s').removesuffix('_mib')} " + " / ".join(f"{x:.2f}" for x in v)
                    for k, v in ratios.items()) + f" (per round, {rounds} round(s))")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="GGUF path")
    ap.add_argument("--contexts", default="1024", help="comma-separated prompt lengths, tokens")
    ap.add_argument("--engines", default="ktquest:dense,llama.cpp",
                    help="comma-separated: ktquest:MODE, ktquest-synthetic:MODE, llama.cpp, llama.cpp-mapped, "
                         "llama.cpp-twin, llama.cpp-filled")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--decode-tokens", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--max-seq-len", type=int, default=0, help="default: the longest context + decode + 64")
    ap.add_argument("--twin-shape", default=None, help="llama.cpp-twin: the model's make_shaped_gguf shape")
    ap.add_argument("--llama-kv", default="f16", choices=("f16", "q8_0"),
                    help="llama.cpp's KV cache type (q8_0 turns its flash attention on, which that needs)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override for ktquest")
    ap.add_argument("--json", default=None, help="write the rows here")
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)  # child: ENGINE,CONTEXT
    args = ap.parse_args(argv)
    contexts = [int(c) for c in args.contexts.split(",")]
    if not args.max_seq_len:
        args.max_seq_len = max(contexts) + args.decode_tokens + 64
    if args.one:
        engine, context = args.one.rsplit(",", 1)
        print(json.dumps(child(engine, args.model, int(context), args.decode_tokens, args.threads,
                               args.max_seq_len, args.twin_shape, args.llama_kv, tuple(args.set))))
        return 0
    engines = args.engines.split(",")
    for e in engines:
        if not (e in LLAMA_ENGINES or e.startswith(("ktquest:", "ktquest-synthetic:"))):
            ap.error(f"--engines: unknown engine {e!r} (ktquest:MODE, llama.cpp, llama.cpp-mapped, llama.cpp-twin)")
        if e == "llama.cpp-twin" and not args.twin_shape:
            ap.error("--engines llama.cpp-twin needs --twin-shape (the model's make_shaped_gguf shape)")
    print(f"{args.model}: read into the page cache in {warm_page_cache(args.model):.1f} s", flush=True)
    rows = []
    for i in range(args.rounds):
        order = engines if i % 2 == 0 else engines[::-1]
        print(f"round {i + 1}/{args.rounds}", flush=True)
        for c in contexts:
            for e in order:
                rows.append(dict(run_cell(args, e, c), round=i + 1))
    summarize(rows, engines, contexts, args.rounds)
    if args.json:
        write_json(args.json, {"model": args.model, "threads": args.threads, "sets": args.set,
                               "llama_kv": args.llama_kv, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
