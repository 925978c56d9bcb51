#!/usr/bin/env python3
"""Decode fidelity of sparse presets against dense attention: top-1 agreement and KL per decode step.

The model reads the first ``length - positions`` tokens of a natural text (``--text``: the Python
standard-library sources the presets were tuned on, or a held-out kind: the library's sub-packages, prose,
narrative, JSON lines) as a prompt, then decodes the last ``positions`` tokens teacher-forced (each step is fed the
text's next token, so every config sees the same tokens). At every decode step the next-token
distribution of each config is compared with dense attention's: top-1 agreement (same argmax), mean
KL(dense || config) in nats, and each one's top-1 accuracy on the text itself. The weights, threads
and decode path are the same for every config: attention is the only difference.

``--budget`` sets the tokens each decode step selects from the context blocks (per KV head in
SEPARATE mode): ``second_select_num = budget / block_size``, and SnapKV's ``preselect_block_count`` in the
preset's ratio to it (the presets ship 2,048 tokens; docs/accuracy.md compares them at 1,024). The init
and local windows come on top. Example:

    python tools/fidelity.py --length 8192 --positions 256 --budget 1024 \
        --configs configs/quest.yaml,configs/snapkv.yaml --json tools/out/fidelity.json

``--generate``: the last ``positions`` tokens are dense attention's own greedy continuation of the prompt instead
of the text's (so over a long reply every config is fed what dense generated: the drift of a generation), and
agreement is also reported per ``--window`` steps (the drift: does agreement fall as the reply grows?). Example,
1,000 generated tokens after a 4K prompt:

    python tools/fidelity.py --length 5096 --positions 1000 --generate --window 100 --json tools/out/drift.json

``--variant NAME:KEY=VALUE[,KEY=VALUE]`` (repeatable; decode-time long_context knobs, as in
tools/eval_longctx.py) decodes the steps of each config again under those knobs on the same prompt, read
once (the cache rewound to the prompt's last token, which is read again): rows ``config+NAME``.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
from pathlib import Path

import torch

_TOOLS = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [_TOOLS, os.path.dirname(_TOOLS)]  # tools/common.py and the ktquest package
from common import HELD_OUT_TEXTS, TEXT_KINDS, context_tokens, variant_knobs, write_json

import ktquest
from ktquest.config import ConfigError, load_config
from ktquest.generate import decode_one_token, prefill

ALL_PRESETS = "configs/quest.yaml,configs/ktransformers.yaml,configs/snapkv.yaml,configs/ada_snapkv.yaml," \
              "configs/ada_quest.yaml"


def budget_sets(config: str, budget: int) -> list[str]:
    """--set overrides that give a preset a decode budget of ``budget`` tokens of context blocks; SnapKV's
    candidates keep the preset's ratio to the picks (snapkv's 768 for 256 picks: 384 at 128 picks, a budget
    of 1,024 tokens of 8-token blocks)."""
    lc = load_config(config).long_context
    k = max(1, budget // lc.block_size)
    sets = [f"second_select_num={k}"]
    if lc.preselect_block:
        keep = max(k, k * lc.preselect_block_count // max(1, lc.second_select_num))
        sets.append(f"preselect_block_count={keep}")
    return sets


@torch.inference_mode()
def teacher_forced(model_path, config: str | None, sets: list[str], tokens: list[int], positions: int,
                   threads: int, variants: list[str] = ()) -> list[tuple[str, torch.Tensor, dict]]:
    """(variant, log-probabilities [positions, V] of the last ``positions`` tokens' decode steps, timings):
    the config's own ("") and then each of ``variants``' on the same prompt."""
    overrides = [f"threads={threads}", f"max_seq_len={len(tokens) + 1}", *sets]
    eng = ktquest.load(model=model_path, config=load_config(config, overrides))
    n_prompt = len(tokens) - positions
    cache = eng.cache  # (a Gemma 3 hybrid cache retunes its global layers)
    if variants and eng.config.mode != "long_context":
        raise SystemExit(f"--variant {variants[0]!r}: long_context keys of a long_context config only")
    knobs = []
    for v in variants:
        try:
            knobs.append(variant_knobs(v, config, overrides, cache))
        except ConfigError as e:  # this config cannot take it (the others may): its other rows still come
            print(f"skipping --variant {v} for {config}: {e}", file=sys.stderr, flush=True)
        except ValueError as e:
            raise SystemExit(f"--variant {e}") from None
    t0 = time.perf_counter()
    logits = eng.prefill(tokens[:n_prompt])
    t_prefill = time.perf_counter() - t0
    runs = []
    for name, lc in [("", None), *knobs]:
        if lc is not None:  # the prompt's last token read again under the variant's knobs
            base = cache.retune(lc)
            eng.cache.truncate(n_prompt - 1)
            logits = prefill(eng.model, eng.cache, tokens[n_prompt - 1: n_prompt], eng.config.chunk_size)
        out = torch.empty(positions, logits.shape[-1])
        out[0] = torch.log_softmax(logits.float(), -1)  # the prompt's last logits predict tokens[n_prompt]
        t0 = time.perf_counter()
        for i in range(1, positions):
            out[i] = torch.log_softmax(decode_one_token(eng.model, eng.cache, tokens[n_prompt + i - 1]).float(), -1)
        t_decode = time.perf_counter() - t0
        lc_now = cache.lc if eng.config.mode == "long_context" else eng.config.long_context
        runs.append((name, out, dict(mode=eng.config.mode, prefill_s=t_prefill, decode_tok_s=(positions - 1) / t_decode,
                                     block_size=lc_now.block_size, second_select_num=lc_now.second_select_num)))
        if lc is not None:
            cache.retune(base)
    del eng
    gc.collect()
    return runs


@torch.inference_mode()
def dense_continuation(model_path, tokens: list[int], n: int, threads: int) -> list[int]:
    """The prompt ``tokens`` and dense attention's greedy continuation of n tokens after it (--generate)."""
    eng = ktquest.load(model=model_path, config=load_config(None, [f"threads={threads}",
                                                                  f"max_seq_len={len(tokens) + n + 1}"]))
    out, tok = list(tokens), int(eng.prefill(tokens).argmax())
    for _ in range(n):
        out.append(tok)
        tok = int(decode_one_token(eng.model, eng.cache, tok).argmax())
    del eng
    gc.collect()
    return out


def compare(ref: torch.Tensor, test: torch.Tensor, targets: torch.Tensor, window: int = 0) -> dict:
    """ref/test: log-probs [P, V]; targets [P]: the text's tokens. Agreement (and per ``window`` steps),
    KL(ref || test), accuracy."""
    kl = (ref.exp() * (ref - test)).sum(-1).clamp_min(0)  # [P], nats
    same = (ref.argmax(-1) == test.argmax(-1)).float()
    by_window = [same[i: i + window].mean().item() for i in range(0, len(same), window)] if window else []
    return dict(top1_agreement=same.mean().item(), agreement_by_window=by_window,
                kl_mean=kl.mean().item(), kl_max=kl.max().item(),
                top1_accuracy=(test.argmax(-1) == targets).float().mean().item(),
                nll=-test.gather(1, targets[:, None]).mean().item())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="GGUF path or bundled model name (default: smollm2-135m)")
    ap.add_argument("--length", type=int, default=8192, help="text length, tokens (prompt + decode steps)")
    ap.add_argument("--positions", type=int, default=256, help="teacher-forced decode steps compared")
    ap.add_argument("--budget", type=int, default=1024,
                    help="context-block tokens selected per step (1,024: the issue's yardstick; the presets ship 2,048)")
    ap.add_argument("--text", default="stdlib", choices=TEXT_KINDS,
                    help="the text: stdlib (the presets' tuning text) or a held-out kind")
    ap.add_argument("--configs", default=ALL_PRESETS, help="comma-separated YAML presets compared with dense")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override for every config")
    ap.add_argument("--variant", action="append", default=[], metavar="NAME:KEY=VALUE[,KEY=VALUE]",
                    help="each config's steps again under these decode-time long_context knobs")
    ap.add_argument("--generate", action="store_true",
                    help="the compared steps are dense's own greedy continuation of the prompt, not the text's")
    ap.add_argument("--window", type=int, default=0, help="also report agreement per this many steps (the drift)")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--json", default=None, help="write the rows here")
    a = ap.parse_args(argv)
    if not 1 <= a.positions < a.length:
        ap.error(f"--positions={a.positions} must be between 1 and --length - 1 ({a.length - 1})")
    if a.budget < 1:
        ap.error(f"--budget={a.budget} must be >= 1")

    from ktquest.formats.bundled import bundled_model_path
    from ktquest.formats.tokenizer import Tokenizer
    from ktquest.hub import resolve_model
    from ktquest.models.loader import read_gguf

    model_path = str(resolve_model(a.model) if a.model else bundled_model_path())
    torch.set_num_threads(a.threads)
    tokens = context_tokens(Tokenizer.from_gguf_metadata(read_gguf(model_path).metadata), a.length, a.text)
    if a.generate:
        tokens = dense_continuation(model_path, tokens[: a.length - a.positions], a.positions, a.threads)
    targets = torch.tensor(tokens[a.length - a.positions:])
    t_start = time.perf_counter()
    ((_, ref, ref_info),) = teacher_forced(model_path, None, a.set, tokens, a.positions, a.threads)
    rows = [dict(config="dense", budget=None, **compare(ref, ref, targets, a.window), **ref_info)]
    print(f"dense: prefill {ref_info['prefill_s']:.1f} s, decode {ref_info['decode_tok_s']:.1f} tok/s", flush=True)
    for config in [c for c in a.configs.split(",") if c]:
        sets = [*budget_sets(config, a.budget), *a.set]
        for variant, logp, info in teacher_forced(model_path, config, sets, tokens, a.positions, a.threads,
                                                  a.variant):
            name = Path(config).stem + (f"+{variant}" if variant else "")
            rows.append(dict(config=name, budget=a.budget, **compare(ref, logp, targets, a.window), **info))
            r = rows[-1]
            print(f"{r['config']}: top-1 agreement {r['top1_agreement']:.3f}, mean KL {r['kl_mean']:.4f} "
                  f"(prefill {info['prefill_s']:.1f} s, decode {info['decode_tok_s']:.1f} tok/s)", flush=True)
    for r in rows:
        r.update(length=a.length, positions=a.positions, threads=a.threads, text=a.text,
                 held_out=a.text in HELD_OUT_TEXTS, generated=a.generate)

    print(f"\n{a.positions} teacher-forced decode steps after {a.length - a.positions} prompt tokens of "
          f"{a.text} text ({'held out' if a.text in HELD_OUT_TEXTS else 'the tuning text'}); budget {a.budget} "
          "tokens of context blocks per step\n")
    print("| config | blocks x size | top-1 agreement | mean KL (nats) | max KL | top-1 acc. | NLL | decode tok/s |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        shape = "all" if r["budget"] is None else f"{r['second_select_num']} x {r['block_size']}"
        print(f"| {r['config']} | {shape} | {r['top1_agreement']:.3f} | {r['kl_mean']:.4f} | {r['kl_max']:.3f} "
              f"| {r['top1_accuracy']:.3f} | {r['nll']:.3f} | {r['decode_tok_s']:.1f} |")
    if a.window:
        print(f"\ntop-1 agreement per {a.window} steps (the drift over the {'reply' if a.generate else 'text'})\n")
        for r in rows[1:]:
            print(f"| {r['config']} | " + " | ".join(f"{x:.2f}" for x in r["agreement_by_window"]) + " |")
    print(f"\n{time.perf_counter() - t_start:.0f} s in all")
    if a.json:
        write_json(a.json, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
