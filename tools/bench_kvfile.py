#!/usr/bin/env python3
"""KV files against the prefill they replace: a document of about N tokens is read (prefilled) by a chat
session, saved to a KV file, and loaded by a second engine; the table gives the prefill time, the file's size,
the save and load times (the load from the page cache, as right after a save; checksums and every copy
included), load / prefill, and whether both sessions then answer a question with the same greedy tokens.

    python tools/bench_kvfile.py --model smollm2-135m --lengths 8192 --configs dense,snapkv
    python tools/bench_kvfile.py --model gemma3-270m --lengths 32768 --configs dense,snapkv --json out/kv.json
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import context_tokens, mode_config, write_json  # noqa: E402

import ktquest  # noqa: E402


def one(model: str, mode: str, n: int, threads: int, directory: str) -> dict:
    config = mode_config(mode, {"dense": None})
    sets = {"threads": threads, "temperature": 0.0, "max_new_tokens": 8}
    a = ktquest.load(model, config, **sets)
    doc = a.tokenizer.decode(context_tokens(a.tokenizer, n - 64, "prose"))
    s = a.chat_session(document=doc)
    read = s.read_document()
    path = os.path.join(directory, f"{mode}.kvq")
    t0 = time.perf_counter()
    size = s.save(path)
    save_s = time.perf_counter() - t0
    b = ktquest.load(model, config, **sets)
    t0 = time.perf_counter()
    t = b.load_session(path)
    load_s = time.perf_counter() - t0
    question = "What is the document about?"
    same = s.send(question).text == t.send(question).text
    row = {"model": model, "config": mode, "tokens": read.context_tokens, "prefill_s": read.prefill_s,
           "file_mib": size / 2**20, "save_s": save_s, "load_s": load_s, "load_over_prefill": load_s / read.prefill_s,
           "continues_equal": same, "threads": threads}
    print(f"{model} {mode:>8} {row['tokens']:>6} tokens: prefill {read.prefill_s:7.1f} s, file {row['file_mib']:7.1f} MiB, "
          f"save {save_s:5.2f} s, load {load_s:5.2f} s = {100 * row['load_over_prefill']:.2f}% of the prefill, "
          f"same answer after load: {same}", flush=True)
    os.unlink(path)
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--lengths", default="8192")
    p.add_argument("--configs", default="dense,snapkv", help="dense or presets (configs/<name>.yaml), comma-separated")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--dir", help="where the files go (default: a temporary directory)")
    p.add_argument("--json")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(dir=args.dir) as d:
        rows = [one(args.model, mode, int(n), args.threads, d) for n in args.lengths.split(",")
                for mode in args.configs.split(",")]
    if args.json:
        write_json(args.json, rows)


if __name__ == "__main__":
    main()
