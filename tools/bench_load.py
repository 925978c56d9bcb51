#!/usr/bin/env python3
"""Load time and peak resident memory of a short chat, ktquest beside llama.cpp, on the same GGUF.

Each engine runs in a fresh child process (its peak is its own, Linux VmHWM): it loads the model, answers one
chat message with --new-tokens greedy tokens and reports

  load_s          seconds from the call to a model ready to chat (ktquest: Engine.load_s, what /stats shows)
  peak_rss_mib    the process's peak resident set (the mapped file's pages it touched included)
  kv_mib          its KV cache when the reply is done (ktquest: the dense cache as grown; llama.cpp: n_ctx
                  tokens of F16 K/V, what it allocates up front)
  budget_mib      file + kv + 600 MiB: the ceiling issue 26 sets for ktquest

llama.cpp runs only where `llama_cpp` imports (--peer none skips it); its context is --llama-ctx tokens
(llama-cli's default, 4096). Example:

    python tools/bench_load.py --model qwen2.5-7b-q4_k_m.gguf --json docs/results/bench_load_7b.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import write_json

MESSAGE = "Write one sentence about the sea."

KTQUEST_CHILD = r"""
import json, sys
import ktquest
model, threads, new = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
eng = ktquest.load(model, threads=threads, max_new_tokens=new, temperature=0)
reply = eng.chat_session().send(sys.argv[4])
hwm = [int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM:")][0] * 1024
print(json.dumps({"load_s": eng.load_s, "peak_rss": hwm, "kv": eng.cache.nbytes(),
                  "new_tokens": reply.stats.new_tokens, "weights": eng.weights, "activations": eng.activations}))
"""

LLAMA_CHILD = r"""
import json, sys, time
from llama_cpp import Llama
model, threads, new, ctx = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[5])
t0 = time.perf_counter()
llm = Llama(model_path=model, n_ctx=ctx, n_threads=threads, n_threads_batch=threads, n_gpu_layers=0, verbose=False)
load_s = time.perf_counter() - t0
r = llm.create_chat_completion(messages=[{"role": "user", "content": sys.argv[4]}], temperature=0, max_tokens=new)
hwm = [int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM:")][0] * 1024
md = llm.metadata
arch = md["general.architecture"]
kv = 2 * int(md[f"{arch}.block_count"]) * ctx * 2 * int(md[f"{arch}.attention.head_count_kv"]) * (
    int(md[f"{arch}.embedding_length"]) // int(md[f"{arch}.attention.head_count"]))
print(json.dumps({"load_s": load_s, "peak_rss": hwm, "kv": kv, "new_tokens": r["usage"]["completion_tokens"]}))
"""


def run_child(code: str, args: list[str]) -> dict:
    r = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=1800)
    if r.returncode != 0:
        raise SystemExit(f"child failed ({r.returncode}): {r.stderr.strip()[-2000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="GGUF path")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--peer", default="llama.cpp", choices=["llama.cpp", "none"])
    ap.add_argument("--llama-ctx", type=int, default=4096)
    ap.add_argument("--json", help="write the rows here")
    a = ap.parse_args(argv)
    if not os.path.isfile(a.model):
        ap.error(f"--model: no such file: {a.model}")
    size = os.path.getsize(a.model)
    common = [a.model, str(a.threads), str(a.new_tokens), MESSAGE]
    rows = [dict(engine="ktquest", **run_child(KTQUEST_CHILD, common))]
    if a.peer == "llama.cpp":
        rows.append(dict(engine="llama.cpp", n_ctx=a.llama_ctx,
                         **run_child(LLAMA_CHILD, common + [str(a.llama_ctx)])))
    mib = 2**20
    print(f"{Path(a.model).name}: {size / mib:.0f} MiB")
    print("| engine | load s | peak RSS MiB | KV MiB | file + KV + 600 MiB |")
    print("|---|---:|---:|---:|---:|")
    for r in rows:
        r.update(model=Path(a.model).name, file_bytes=size, threads=a.threads,
                 peak_rss_mib=r["peak_rss"] / mib, kv_mib=r["kv"] / mib,
                 budget_mib=(size + r["kv"]) / mib + 600)
        print(f"| {r['engine']} | {r['load_s']:.2f} | {r['peak_rss_mib']:.0f} | {r['kv_mib']:.0f} | "
              f"{r['budget_mib']:.0f} |")
    if len(rows) == 2:
        print(f"ktquest / llama.cpp peak RSS: {rows[0]['peak_rss'] / rows[1]['peak_rss']:.2f}x")
    if a.json:
        write_json(a.json, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
