"""Parallel slots' aggregate decode speed: N replies at once (``ktquest serve --parallel N``'s scheduler,
server/parallel.py, driven as the server drives it: one thread a request) against one reply at a time, same
prompts, greedy, in one run.

    python tools/bench_parallel.py --model /work/shaped/qwen2.5-1.5b-q4_k_m.gguf --parallel 1,2,4 --tokens 128

For each N: N requests start together (a different question each), each generates ``--tokens`` tokens (or
stops at its end of turn); aggregate tok/s = all their completion tokens / the wall time from the first request
taken to the last reply. Rounds alternate the N values (A B A B) so a slow moment of the machine hits each.
Also a micro-benchmark of the step alone: ``decode_batch`` of N tokens against N single decodes.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import ktquest  # noqa: E402  (before torch: the OpenMP settings)

QUESTIONS = ["Tell me a long story about a lighthouse keeper.", "Explain how a steam engine works, step by step.",
             "Describe the history of the printing press.", "Write a detailed recipe for bread.",
             "List the planets and describe each one.", "Explain photosynthesis in detail.",
             "Describe a walk through an old city.", "Explain how computers store numbers."]


def run_round(worker, engine, n: int, tokens: int) -> dict:
    from ktquest.chat import encode_chat

    gen = engine.config.generation.__class__(max_new_tokens=tokens, temperature=0.0)
    prompts = [encode_chat(engine, [{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}]) for i in range(n)]
    results = [None] * n
    barrier = threading.Barrier(n + 1)

    def one(i: int) -> None:
        barrier.wait()
        results[i] = worker.complete(prompts[i], gen)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    barrier.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    done = sum(r.completion_tokens for r in results)
    return {"n": n, "tokens": done, "wall_s": wall, "tok_s": done / wall}


def step_bench(engine, n: int, reps: int) -> dict:
    """decode_batch of n tokens against n single decodes, each at a 64-token prompt of its own."""
    from ktquest.engine import make_cache

    dec = engine.model.decoder
    caches = [make_cache(engine.config, engine.args, engine.max_seq_len, engine.device, engine.dtype)
              for _ in range(n)]
    for i, c in enumerate(caches):
        engine.prefill([(7 * i + j) % 1000 + 10 for j in range(64)], cache=c)
    toks = [11 + i for i in range(n)]
    t_one = t_batch = 0.0
    for _ in range(reps):
        t0 = time.perf_counter()
        for t, c in zip(toks, caches):
            dec.decode(t, c)
        t_one += time.perf_counter() - t0
        t0 = time.perf_counter()
        dec.decode_batch(toks, caches)
        t_batch += time.perf_counter() - t0
    return {"n": n, "one_at_a_time_ms": 1e3 * t_one / reps, "batched_ms": 1e3 * t_batch / reps,
            "speedup": t_one / t_batch}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--parallel", default="1,4", help="comma-separated N values")
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--ctx", type=int, default=2048)
    p.add_argument("--json", help="write the rows here")
    a = p.parse_args()
    ktquest.set_openmp_spin()
    from ktquest.server.worker import Worker

    engine = ktquest.load(a.model, max_seq_len=a.ctx, threads=a.threads)
    ns = [int(x) for x in a.parallel.split(",")]
    workers = {n: Worker(engine, slots=n, parallel=n) for n in ns}
    run_round(workers[ns[0]], engine, ns[0], 8)  # (warm-up)
    rows = []
    for r in range(a.rounds):
        for n in ns:
            row = run_round(workers[n], engine, n, a.tokens) | {"round": r}
            rows.append(row)
            print(f"round {r} N={n}: {row['tokens']} tokens in {row['wall_s']:.2f} s = {row['tok_s']:.1f} tok/s",
                  flush=True)
    steps = [step_bench(engine, n, 20) for n in ns if n > 1]
    for s in steps:
        print(f"step of {s['n']}: {s['one_at_a_time_ms']:.1f} ms one at a time, {s['batched_ms']:.1f} ms batched "
              f"({s['speedup']:.2f}x)")
    best = {n: max(x["tok_s"] for x in rows if x["n"] == n) for n in ns}
    for n in ns:
        print(f"N={n}: best {best[n]:.1f} tok/s, {best[n] / best[ns[0]]:.2f}x N={ns[0]}")
    for w in workers.values():
        if w.parallel is not None:
            w.parallel.close()
    if a.json:
        Path(a.json).write_text(json.dumps({"model": a.model, "threads": a.threads, "tokens": a.tokens,
                                            "rows": rows, "steps": steps}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
