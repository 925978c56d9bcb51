"""``ktquest bench``: prompt processing, first token and steady generation speed of ktquest's presets (and of
llama.cpp beside them on the same GGUF, ``--llama-cpp``), as llama-bench measures llama.cpp's.

For each (preset, context): a fresh KV cache reads ``context`` tokens of natural text (the Python standard
library's sources, ``ktquest.eval.context_text``; the same ids for every engine); ``pp tok/s`` is those tokens
over the time to read them; ``first token s`` is from the prompt's end to the first token picked and fed (the
step SnapKV's preselection runs in); ``tg tok/s`` is the steady speed of ``-n`` greedy single-token steps after
it. With ``-r N`` each cell runs N times (each in a fresh cache) and shows the median ± the standard deviation,
as llama-bench does; the JSON keeps every run. tools/bench_decode.py measures the same in alternating rounds
(engine A, B, A, B), for noisy hosts and longer studies."""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path

TABLE_HEADER = ("| engine | preset | context | pp tok/s | first token s | tg tok/s |\n"
                "|---|---|---:|---:|---:|---:|")


def main(args: argparse.Namespace) -> int:
    """Run the benchmark a ``ktquest bench`` command line asks for; print the table, write ``--json``."""
    contexts = _int_list(args.contexts, "--contexts")
    presets = [p.strip() for p in args.presets.split(",") if p.strip()]
    if not presets:
        raise ValueError(f"--config {args.presets!r}: a comma-separated list of presets, e.g. dense,snapkv")
    if args.n_gen < 1:
        raise ValueError(f"-n {args.n_gen}: generate at least 1 token")
    if args.repetitions < 1:
        raise ValueError(f"-r {args.repetitions}: run each measurement at least once")
    if args.threads < 0:
        raise ValueError(f"-t {args.threads}: 0 (all cores) or more threads")
    lc = llama_cpp_module() if args.llama_cpp else None  # before any model loads: a missing peer fails at once
    import torch

    from ktquest.formats.bundled import DEFAULT_MODEL
    from ktquest.hub import resolve_model

    model_path = resolve_model(args.model or DEFAULT_MODEL)
    threads = args.threads or os.cpu_count() or 1
    torch.set_num_threads(threads)
    # a warm-up step after the prompt, then the generated tokens; a little room past them
    max_len = max(contexts) + args.n_gen + 16
    rows: list[dict] = []
    token_ids: dict[int, list[int]] = {}
    for preset in presets:
        runner = KtquestRunner(model_path, preset, max_len, threads, args.sets)
        if preset == presets[0]:
            from ktquest.context import context_warning

            warning = context_warning(runner.eng.args, max(contexts))
            if warning:
                print(f"ktquest: {warning}", file=sys.stderr, flush=True)
        for ctx in contexts:
            tokens = token_ids.setdefault(ctx, runner.context(ctx))
            rows.append(_measure(runner, ctx, tokens, args.n_gen, threads, args.repetitions))
        del runner
        gc.collect()
    if lc is not None:
        runner = LlamaCppRunner(lc, model_path, max_len, threads)
        for ctx in contexts:
            rows.append(_measure(runner, ctx, token_ids[ctx], args.n_gen, threads, args.repetitions))
    print(format_table(rows))
    if args.json:
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(rows, indent=2) + "\n", encoding="utf-8")
    return 0


def llama_cpp_module():
    """The ``llama_cpp`` module (llama-cpp-python); ValueError (one line from the CLI) when it cannot be imported."""
    try:
        import llama_cpp
    except ImportError as e:
        raise ValueError(f"--llama-cpp needs llama-cpp-python, which cannot be imported here ({e}); "
                         "pip install llama-cpp-python, or drop --llama-cpp") from None
    return llama_cpp


class KtquestRunner:
    """One preset loaded once; every context gets a fresh cache (the engine's own for the first)."""

    engine = "ktquest"

    def __init__(self, model_path: Path, preset: str, max_len: int, threads: int, sets: list[str]):
        import ktquest
        from ktquest.config import load_config

        base = load_config(preset, [f"threads={threads}", *sets])
        if base.mode == "long_context":  # its windows must fit in the cache, even past a short context
            max_len = max(max_len, base.long_context.init_windows_len + base.long_context.local_windows_len)
        config = load_config(preset, [f"threads={threads}", f"max_seq_len={max_len}", *sets])
        self.label, self.eng = preset, ktquest.load(model=str(model_path), config=config)
        self._fresh = True  # the engine's own cache is still empty

    def context(self, n_tokens: int) -> list[int]:
        from ktquest.eval.context_text import context_tokens

        return context_tokens(self.eng.tokenizer, n_tokens)

    def _cache(self):
        from ktquest.engine import make_cache

        eng = self.eng
        if self._fresh:
            self._fresh = False
            return eng.cache
        return make_cache(eng.config, eng.model.args, eng.max_seq_len, eng.device, eng.dtype)

    def run(self, tokens: list[int], n_gen: int) -> tuple[float, float, float]:
        """(prefill s, first token s, seconds for ``n_gen`` greedy steps after it), in a fresh cache."""
        from ktquest.generate import decode_one_token

        model, cache = self.eng.model, self._cache()
        gc.collect()
        t0 = time.perf_counter()
        logits = self.eng.prefill(tokens, cache)
        t1 = time.perf_counter()
        tok = int(decode_one_token(model, cache, int(logits.argmax())).argmax())
        t2 = time.perf_counter()
        for _ in range(n_gen):
            tok = int(decode_one_token(model, cache, tok).argmax())
        t3 = time.perf_counter()
        return t1 - t0, t2 - t1, t3 - t2

    def row(self) -> dict:
        c = self.eng.config
        return {"engine": self.engine, "preset": self.label, "mode": c.mode, "chunk_size": c.chunk_size,
                "weights": c.weights, "max_seq_len": self.eng.max_seq_len}


class LlamaCppRunner:
    """llama.cpp through llama-cpp-python: a fresh ``Llama`` (so a fresh KV cache) per context."""

    engine = "llama.cpp"
    label = "llama.cpp"

    def __init__(self, lc, model_path: Path, max_len: int, threads: int):
        self.lc, self.model_path, self.max_len, self.threads = lc, model_path, max_len, threads

    def run(self, tokens: list[int], n_gen: int) -> tuple[float, float, float]:
        # swa_full=False: a sliding-window model's SWA layers keep only their window, as llama.cpp's CLI does
        llm = self.lc.Llama(model_path=str(self.model_path), n_ctx=self.max_len, n_threads=self.threads,
                            n_threads_batch=self.threads, n_batch=512, verbose=False, swa_full=False)
        t0 = time.perf_counter()
        llm.eval(tokens)
        t1 = time.perf_counter()
        llm.eval([_last_argmax(llm)])  # the first token's step, as ktquest's
        t2 = time.perf_counter()
        for _ in range(n_gen):
            llm.eval([_last_argmax(llm)])
        t3 = time.perf_counter()
        return t1 - t0, t2 - t1, t3 - t2

    def row(self) -> dict:
        return {"engine": self.engine, "preset": self.label, "mode": "dense",
                "version": getattr(self.lc, "__version__", "?"), "max_seq_len": self.max_len}


def _last_argmax(llm) -> int:
    """The greedy token after ``llm.eval``: the logits of the last evaluated token (the only ones kept)."""
    import numpy as np

    return int(np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(llm.n_vocab(),)).argmax())


def _measure(runner, ctx: int, tokens: list[int], n_gen: int, threads: int, reps: int = 1) -> dict:
    """One table row: ``reps`` runs of ``runner`` on ``tokens``, each in a fresh cache; medians, standard
    deviations (0 for one run) and every run's figures."""
    runs = []
    for _ in range(reps):
        pp_s, first_s, tg_s = runner.run(tokens, n_gen)
        runs.append({"prefill_s": pp_s, "prefill_tok_s": ctx / pp_s, "first_token_s": first_s,
                     "decode_tok_s": n_gen / tg_s})
    row = dict(runner.row(), context=ctx, threads=threads, decode_tokens=n_gen, repetitions=reps)
    for key in ("prefill_s", "prefill_tok_s", "first_token_s", "decode_tok_s"):
        values = [r[key] for r in runs]
        row[key] = statistics.median(values)
        row[key + "_sd"] = statistics.stdev(values) if reps > 1 else 0.0
    row["runs"] = runs
    print(f"{row['engine']:>9} {row['preset']:>12} ctx {ctx:>7}: pp {row['prefill_tok_s']:8.1f} tok/s, "
          f"first token {row['first_token_s']:.3f} s, tg {row['decode_tok_s']:.2f} tok/s"
          f"{f' (median of {reps})' if reps > 1 else ''}", file=sys.stderr, flush=True)
    return row


def format_table(rows: list[dict]) -> str:
    """The rows as a markdown table (engine, preset, context, pp tok/s, first token s, tg tok/s); a row of
    several runs shows its medians ± their standard deviations."""
    lines = [TABLE_HEADER]
    for r in rows:
        lines.append(f"| {r['engine']} | {r['preset']} | {r['context']} | {_cell(r, 'prefill_tok_s', '.1f')} "
                     f"| {_cell(r, 'first_token_s', '.3f')} | {_cell(r, 'decode_tok_s', '.2f')} |")
    return "\n".join(lines)


def _cell(row: dict, key: str, fmt: str) -> str:
    if row.get("repetitions", 1) > 1:
        return f"{row[key]:{fmt}} ± {row[key + '_sd']:{fmt}}"
    return f"{row[key]:{fmt}}"


def _int_list(text: str, flag: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise ValueError(f"{flag} {text!r}: a comma-separated list of positive token counts, e.g. 1024,8192")
    return values
