#!/usr/bin/env python3
"""Several questions about one document in one conversation (``ktquest.eval.ruler.make_multiturn_sample``): per
config and length, each trial opens a chat over a document with N key-value needles and asks one key a turn,
greedily, the earlier questions and answers staying in the cache (a long chat over a document, where a
first-turn benchmark stops). Accuracy per turn and in all, dense and the presets, side by side. Example:

    python tools/eval_multiturn.py --lengths 4096 --turns 4 --trials 20 \
        --configs dense,configs/quest.yaml,configs/snapkv.yaml --json tools/out/multiturn.json
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time

_TOOLS = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [_TOOLS, os.path.dirname(_TOOLS)]
from common import write_json  # noqa: E402

import ktquest  # noqa: E402

ktquest.set_openmp_spin()

from ktquest.config import load_config  # noqa: E402
from ktquest.eval.ruler import make_multiturn_sample  # noqa: E402


def run_config(model: str | None, config: str, lengths: list[int], turns: int, trials: int, seed: int,
               threads: int) -> list[dict]:
    """Every trial of every length on one engine: a record per turn."""
    path = None if config in ("dense", "default") else config
    eng = ktquest.load(model=model, config=load_config(path, [f"threads={threads}",
                                                             f"max_seq_len={max(lengths) + 64 * turns + 64}"]))
    rows = []
    for length in lengths:
        for trial in range(trials):
            s = make_multiturn_sample(eng.tokenizer, length, turns, seed, trial)
            session = eng.chat_session(document=s.document)
            for i, (question, value) in enumerate(s.turns):
                text: list[str] = []

                def done(value=value, text=text) -> bool:  # the value, another 7-digit number, or a ramble
                    t = "".join(text)
                    return value in t or re.search(r"\d{7}\D", t) is not None or len(t) > 200

                reply = session.send(question, on_text=text.append, should_stop=done)
                rows.append(dict(config=os.path.splitext(os.path.basename(config))[0], length=length, trial=trial,
                                 turn=i, correct=value in reply.text, reply=reply.text[:80]))
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--lengths", default="4096")
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--trials", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--configs", default="dense")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    lengths = [int(x) for x in a.lengths.split(",") if x]
    rows: list[dict] = []
    t0 = time.perf_counter()
    for config in [c for c in a.configs.split(",") if c]:
        rows += run_config(a.model, config, lengths, a.turns, a.trials, a.seed, a.threads)
    names = list(dict.fromkeys(r["config"] for r in rows))
    print(f"\n{a.turns} questions a conversation, {a.trials} conversations a length; accuracy per turn\n")
    print("| config | length | " + " | ".join(f"turn {i + 1}" for i in range(a.turns)) + " | all |")
    print("|---|---:|" + "---:|" * (a.turns + 1))
    for name in names:
        for length in lengths:
            mine = [r for r in rows if r["config"] == name and r["length"] == length]
            per = [sum(r["correct"] for r in mine if r["turn"] == i) / a.trials for i in range(a.turns)]
            print(f"| {name} | {length} | " + " | ".join(f"{x:.2f}" for x in per)
                  + f" | {sum(r['correct'] for r in mine) / len(mine):.3f} |")
    print(f"\n{time.perf_counter() - t0:.0f} s in all")
    if a.json:
        write_json(a.json, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
