#!/usr/bin/env python3
"""Soak: long runs whose resident memory must stay flat (what a long chat session or a server does).

Two runs on the bundled model in long_context mode (configs/quest.yaml unless --config says otherwise):

- decode: prefill --context tokens of natural text, then --decode-steps single-token steps with the chat's
  sampling. The KV store grows with the context by design (its blocks are paged in as they fill), so the
  figure that must stay flat is the resident memory less the KV bytes held (``cache.nbytes()``).
- chat: --turns turns of one ChatSession over a document, with rewinds: every 5th turn forgets the
  conversation but keeps the cache (the next turn rewinds the KV cache to the document), every 7th reply is
  stopped after a few tokens (as Ctrl-C does), every 11th turn starts a new session on the same engine.

Resident memory is read from /proc/self/statm after a warm-up; the report gives it at the start and end of
each run, its maximum, and the least-squares slope per 1,000 steps (or turns). Example:

    python tools/soak.py --decode-steps 5000 --turns 200 --json docs/results/soak.json
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import CONFIGS, context_tokens, stdlib_text, write_json  # noqa: E402

import ktquest  # noqa: E402
from ktquest.config import CHAT_GENERATION, GenerationConfig  # noqa: E402
from ktquest.formats.bundled import bundled_model_path  # noqa: E402
from ktquest.generate import decode_one_token  # noqa: E402
from ktquest.native.sample import Sampler  # noqa: E402

MB = 1 << 20
PAGE = os.sysconf("SC_PAGE_SIZE")


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


def slope_per_1000(xs: list[int], ys: list[float]) -> float:
    """Least-squares slope of ys over xs, per 1,000 of x."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    var = sum((x - mx) ** 2 for x in xs)
    return 1000 * sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var if var else 0.0


def summary(name: str, xs: list[int], ys: list[float], unit: str) -> dict:
    row = dict(run=name, unit=unit, points=len(xs), first_mb=round(ys[0], 1), last_mb=round(ys[-1], 1),
               max_mb=round(max(ys), 1), growth_mb=round(ys[-1] - ys[0], 1),
               slope_mb_per_1000=round(slope_per_1000(xs, ys), 2))
    print(f"{name:>7}: {row['first_mb']:.1f} -> {row['last_mb']:.1f} MB (max {row['max_mb']:.1f}) over "
          f"{xs[-1] - xs[0]} {unit}, slope {row['slope_mb_per_1000']:+.2f} MB per 1,000 {unit}")
    return row


def soak_decode(eng, context: int, steps: int, every: int) -> dict:
    cache = eng.cache
    tokens = context_tokens(eng.tokenizer, context)
    logits = eng.prefill(tokens, cache)
    sampler = Sampler(GenerationConfig(**CHAT_GENERATION, seed=1))
    recent: list[int] = []
    xs, total, less_kv = [], [], []
    t0 = time.perf_counter()
    for step in range(1, steps + 1):
        tok = sampler(logits, recent)
        recent.append(tok)
        logits = decode_one_token(eng.model, cache, tok)
        if step % every == 0:
            gc.collect()
            r = rss()
            xs.append(step)
            total.append(r / MB)
            less_kv.append((r - cache.nbytes()) / MB)
    dt = time.perf_counter() - t0
    print(f" decode: {steps} steps after a {context}-token context in {dt:.0f} s ({steps / dt:.1f} tok/s), "
          f"KV held {cache.nbytes() / MB:.1f} MB")
    skip = 1 if len(xs) > 2 else 0  # the first point is warm-up (allocator pools, first selections)
    rows = [summary("rss", xs[skip:], total[skip:], "steps"),
            summary("rss-kv", xs[skip:], less_kv[skip:], "steps")]
    return dict(context=context, steps=steps, tok_s=round(steps / dt, 2), kv_mb=round(cache.nbytes() / MB, 1),
                rss=rows[0], rss_less_kv=rows[1])


def soak_chat(eng, turns: int, doc_chars: int) -> dict:
    doc = stdlib_text(doc_chars)[:doc_chars]
    questions = ["What does this code do?", "Name one function defined above.", "Summarize it in one line.",
                 "Which module is imported first?", "Write a haiku about it."]
    session = eng.chat_session(document=doc)
    xs, ys, stopped = [], [], 0
    t0 = time.perf_counter()
    for turn in range(1, turns + 1):
        if turn % 11 == 0:
            session = eng.chat_session(document=doc)
        elif turn % 5 == 0:
            session.reset(keep_cache=True)  # the next turn rewinds the cache to the document
        n = [0]

        def should_stop(n=n, cut=turn % 7 == 0) -> bool:
            n[0] += 1
            return cut and n[0] > 4

        reply = session.send(questions[turn % len(questions)], should_stop=should_stop)
        stopped += reply.stats.stopped_by == "interrupted"
        gc.collect()
        xs.append(turn)
        ys.append(rss() / MB)
    dt = time.perf_counter() - t0
    print(f"   chat: {turns} turns in {dt:.0f} s ({stopped} stopped early), context now "
          f"{session.stats().context_tokens} tokens")
    skip = 10 if turns > 20 else 0  # warm-up turns
    return dict(turns=turns, doc_chars=doc_chars, stopped=stopped, seconds=round(dt, 1),
                rss=summary("chat", xs[skip:], ys[skip:], "turns"))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=str(CONFIGS / "quest.yaml"))
    ap.add_argument("--context", type=int, default=4096, help="tokens prefilled before the decode run")
    ap.add_argument("--decode-steps", type=int, default=5000)
    ap.add_argument("--every", type=int, default=250, help="decode steps between two memory readings")
    ap.add_argument("--turns", type=int, default=200)
    ap.add_argument("--doc-chars", type=int, default=6000, help="the chat's document, in characters")
    ap.add_argument("--max-new-tokens", type=int, default=24, help="per chat reply")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    model = bundled_model_path()
    out: dict = {"config": args.config, "threads": args.threads}
    if args.decode_steps > 0:
        eng = ktquest.load(str(model), config=args.config, threads=args.threads,
                           max_seq_len=args.context + args.decode_steps + 64)
        out["decode"] = soak_decode(eng, args.context, args.decode_steps, args.every)
        del eng
        gc.collect()
    if args.turns > 0:
        eng = ktquest.load(str(model), config=args.config, threads=args.threads, max_seq_len=4096,
                           max_new_tokens=args.max_new_tokens, **CHAT_GENERATION)
        out["chat"] = soak_chat(eng, args.turns, args.doc_chars)
    if args.json:
        write_json(args.json, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
