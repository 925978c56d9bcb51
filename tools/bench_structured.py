#!/usr/bin/env python3
"""Structured output's cost per token (ktquest/structured.py): the same chat prompts answered freely and held to a
JSON schema (and JSON mode), alternating, on one engine; decode tok/s of each and the time a step waited for its
mask (what computing it beside the decode step did not hide). At temperature 1 the sampler's own work over the
vocabulary is part of a step, and a mask that leaves few tokens makes it cheaper; --temperature 0 leaves it out.
Example:

    python tools/bench_structured.py --model smollm2-135m --threads 2 --replies 12 --json tools/out/structured.json
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import write_json  # noqa: E402

import ktquest  # noqa: E402

ktquest.set_openmp_spin()  # (as the server runs: before torch loads)

from ktquest.config import GenerationConfig  # noqa: E402
from ktquest.generate import generate  # noqa: E402
from ktquest.structured import ResponseFormat  # noqa: E402

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "city", "hobbies"],
          "properties": {"name": {"type": "string", "maxLength": 32}, "age": {"type": "integer"},
                         "city": {"type": "string", "maxLength": 32},
                         "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 24}, "maxItems": 4}}}
FORMATS = {"free": None, "json_object": {"type": "json_object"},
           "json_schema": {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--replies", type=int, default=12, help="replies per format (seeds 0..N-1)")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--temperature", type=float, default=1.0,
                    help="0: greedy (the sampler's own cost, which a mask can lower, left out)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    eng = ktquest.load(model=a.model, threads=a.threads, max_seq_len=1024)
    tok = eng.tokenizer
    prompt = tok.encode_messages([{"role": "user", "content": "Describe a person as JSON: name, age, city, hobbies."}])
    rows = {name: {"tok_s": [], "mask_ms_per_token": [], "tokens": 0} for name in FORMATS}
    for seed in range(a.replies):
        for name, spec in FORMATS.items():  # alternating: drift on a noisy host falls on every format alike
            fmt = ResponseFormat.parse(spec)
            c = None if fmt is None else fmt.constraint(tok, eng.args.vocab_size)
            gen = GenerationConfig(temperature=a.temperature, seed=seed, max_new_tokens=a.max_tokens)
            seq = eng.sequence
            seq.claim(None)
            r = generate(eng.model, seq, prompt, gen, set(tok.stop_ids), eng.config.chunk_size, constraint=c)
            if c is not None:
                c.close()
            n = len(r.tokens)
            if n > 1:
                rows[name]["tok_s"].append((n - 1) / max(r.decode_s - r.first_token_s, 1e-9))
                rows[name]["mask_ms_per_token"].append(1e3 * (c.mask_s if c else 0.0) / n)
            rows[name]["tokens"] += n
    out = []
    print("| format | decode tok/s (median) | vs free | mask wait ms/token | tokens |")
    print("|---|---:|---:|---:|---:|")
    free = statistics.median(rows["free"]["tok_s"])
    for name, r in rows.items():
        med = statistics.median(r["tok_s"])
        wait = statistics.median(r["mask_ms_per_token"])
        out.append(dict(format=name, decode_tok_s=med, ratio=med / free, mask_wait_ms_per_token=wait,
                        tokens=r["tokens"], model=a.model, threads=a.threads, replies=a.replies,
                        temperature=a.temperature))
        print(f"| {name} | {med:.1f} | {med / free:.2f} | {wait:.3f} | {r['tokens']} |")
    if a.json:
        write_json(a.json, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
