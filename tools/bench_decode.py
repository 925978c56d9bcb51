#!/usr/bin/env python3
"""Prefill and decode speed of ktquest (per mode) and of llama.cpp on the same GGUF, side by side.

For each context length: the context is natural text (Python standard-library sources) tokenized by
the model's tokenizer; both engines get the same token ids and thread count. Prefill tok/s is the
context's tokens over the time to feed them; first token (``first_token_s``) is from the end of the prompt to
the first generated token picked and fed (the step SnapKV's preselection runs in; for llama.cpp the same: its
argmax and one ``eval``); decode tok/s is the steady speed of greedy single-token steps after that. Every
(engine, context) keeps its own KV cache, so with --rounds R the decode is measured in R rounds that visit
every cell in turn: the medians, and the ratios taken within each round, hold up on a
noisy host where one pass of minutes per cell does not. Example:

    python tools/bench_decode.py --contexts 1024,4096,8192 --modes dense,long_context \
        --peer llama.cpp --rounds 3 --json tools/out/bench_decode.json

A mode is `dense`, `long_context` (configs/snapkv.yaml unless --config says otherwise: the preset whose cost
per token is flat in the context, a fixed set of preselected candidates) or the name of a preset in configs/
(`--modes quest,snapkv,ktransformers`); rows carry it as `label`.

--synthetic: no prefill; each context's cache is filled with made-up K/V (tools/synthetic_context.py: norms,
outlier channels, locality and needle blocks as a real model's, RoPE'd at their positions) and decode starts at
position N, so decode speed and memory are measured at 128K-1M tokens without the hours of prefill (its
"prefill" column is the fill's speed). It cannot show accuracy (the context means nothing). Rows also carry
the memory per context: the process's RSS after the fill (every cache so far held) and the cache's KV bytes.
"""

from __future__ import annotations

import argparse
import gc
import os
import resource
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import context_tokens, llama_cpp, mode_config, write_json  # noqa: E402

import ktquest  # noqa: E402  (torch-free)

# ktquest measured as its CLI runs it: torch's idle OpenMP workers spin only briefly (ktquest.set_openmp_spin),
# when no llama.cpp shares this process; beside llama.cpp both engines keep libgomp's default (one runtime for
# both, whose setting would change the peer's speed too). Before torch loads, so from the command line itself.
_peer = argparse.ArgumentParser(add_help=False)
_peer.add_argument("--peer", default="llama.cpp")
if _peer.parse_known_args()[0].peer == "none":
    ktquest.set_openmp_spin()
import torch  # noqa: E402
from synthetic_context import fill as synthetic_fill  # noqa: E402  (it imports torch: after the spin is set)
from synthetic_context import touch_experts  # noqa: E402

from ktquest.config import (  # noqa: E402
    CHAT_GENERATION,
    GenerationConfig,
    load_config,  # noqa: E402
)
from ktquest.engine import make_cache  # noqa: E402
from ktquest.formats.bundled import bundled_model_path  # noqa: E402
from ktquest.generate import decode_one_token  # noqa: E402
from ktquest.hub import resolve_model  # noqa: E402
from ktquest.native.sample import Sampler  # noqa: E402

MODE_CONFIGS = {"dense": None, "long_context": "configs/snapkv.yaml"}


PROGRESS_FROM = 65536  # contexts from this long print their prefill's progress every tenth (stderr)


class KtquestRunner:
    """One ktquest mode/preset: one model, one KV cache per context (so decode rounds can alternate)."""

    engine = "ktquest"

    def __init__(self, model_path, label: str, mode: str, config: str | None, max_len: int, threads: int,
                 chunk_size: int, sets: list[str], sampling: str = "greedy", synthetic: bool = False):
        overrides = [f"threads={threads}", f"max_seq_len={max_len}", *sets]
        if chunk_size:
            overrides.append(f"chunk_size={chunk_size}")
        if config is None and mode != "dense":
            overrides.append(f"mode={mode}")
        self.label, self.config_path, self.threads = label, config, threads
        self.eng = ktquest.load(model=str(model_path), config=load_config(config, overrides))
        self.tokenizer = self.eng.tokenizer
        self.state: dict[int, list] = {}  # context -> [cache, next token, its sampler, the tokens so far]
        self.first_token_s: dict[int, float] = {}  # ctx -> seconds from its prompt's end to its first token
        # greedy (the tools' and tests' default) or the chat's sampling (CHAT_GENERATION: penalties, min-p...)
        self.gen = GenerationConfig(**CHAT_GENERATION) if sampling == "chat" else GenerationConfig()
        self.sampling, self.synthetic = sampling, synthetic

    def prefill(self, ctx: int) -> float:
        eng = self.eng
        cache = eng.cache if not self.state else make_cache(eng.config, eng.model.args, eng.max_seq_len, eng.device,
                                                            eng.dtype)
        gc.collect()
        if self.synthetic:  # made-up K/V at positions [0, ctx); the text's last token is read at position ctx
            tokens = context_tokens(eng.tokenizer, 64)
            touch_experts(eng.model)  # resident, as after a real prompt (not the fill's work: untimed)
            t0 = time.perf_counter()
            synthetic_fill(cache, eng.model.args, ctx)
            t = time.perf_counter() - t0
            return self._first_step(ctx, cache, tokens, tokens[-1], time.perf_counter(), t)
        tokens = context_tokens(eng.tokenizer, ctx)
        t0 = time.perf_counter()
        marks = [ctx * (i + 1) // 10 for i in range(10)] if ctx >= PROGRESS_FROM else []

        def progress(done: int, total: int) -> None:  # a long prefill says how far it got (stderr)
            while marks and done >= marks[0]:
                dt = time.perf_counter() - t0
                print(f"  prefill {marks.pop(0):>9} / {total} tokens in {dt:7.0f} s ({done / dt:.1f} tok/s)",
                      file=sys.stderr, flush=True)

        logits = eng.prefill(tokens, cache, progress)
        t1 = time.perf_counter()
        return self._first_step(ctx, cache, tokens, int(logits.argmax()), t1, t1 - t0)

    def _first_step(self, ctx: int, cache, tokens: list[int], tok: int, t1: float, t: float) -> float:
        """The first token's step (not in the decode rounds), timed from ``t1``, the prompt's end."""
        tok = int(decode_one_token(self.eng.model, cache, tok).argmax())
        self.first_token_s[ctx] = time.perf_counter() - t1
        self.state[ctx] = [cache, tok, Sampler(self.gen), [int(t) for t in tokens[-64:]] + [tok]]
        return t

    def memory(self, ctx: int) -> dict:
        """The context's cache: its KV bytes (a long-context store's blocks, candidates and device windows) and,
        where it has one, the DRAM store's alone."""
        cache = self.state[ctx][0]
        store = getattr(cache, "store", None)
        return dict(kv_mib=cache.nbytes() / 2**20, store_mib=None if store is None else store.nbytes() / 2**20)

    def decode(self, ctx: int, n: int) -> float:
        st = self.state[ctx]
        cache, tok, sampler, recent = st
        t0 = time.perf_counter()
        for _ in range(n):
            tok = sampler(decode_one_token(self.eng.model, cache, tok), recent)
            recent.append(tok)
        st[1] = tok
        return time.perf_counter() - t0

    def row(self) -> dict:
        c = self.eng.config
        return dict(engine="ktquest", label=self.label, mode=c.mode, config=self.config_path or "default",
                    chunk_size=c.chunk_size, weights=c.weights, sampling=self.sampling, synthetic=self.synthetic)


class SelectionView:
    """``--selection-views``: decodes on a KtquestRunner's caches with every context block competing (SnapKV's
    candidate lists, if any, set aside; as configs/quest.yaml selects) and the store's hierarchical index
    walked (``walk=True``) or every block's anchors scanned (False): the same picks, timed one against the
    other on one prefilled store, beside the runner's own selection. Its tokens extend the runner's
    conversation (a few dozen a round); the runner's own decodes get their candidate lists back."""

    engine = "ktquest"

    def __init__(self, parent: KtquestRunner, walk: bool):
        self.parent, self.walk = parent, walk
        self.label = f"{parent.label}/all-blocks-{'index' if walk else 'flat'}"

    def decode(self, ctx: int, n: int) -> float:
        cache = self.parent.state[ctx][0]
        p = cache.planner
        kept = p.allowed, p.allowed_np, p.allowed_lb
        p.allowed, p.allowed_np = [None] * p.n_layers, [None] * p.n_layers
        p._token_steps = None  # the native token plan kept from the last token holds the lists: planned anew
        cache.store.set_walk_index(self.walk)
        try:
            return self.parent.decode(ctx, n)
        finally:
            cache.store.set_walk_index(True)
            p.allowed, p.allowed_np, p.allowed_lb = kept
            p._token_steps = None

    def row(self) -> dict:
        return dict(self.parent.row(), label=self.label)

    def same_picks(self, ctx: int, n_queries: int = 8) -> tuple[int, int, int]:
        """(selections compared, selections that differ, selections whose walk scored group bounds): every
        layer's top ``second_select_num`` of every block for each of the last ``n_queries`` prefill queries the
        planner recorded, through the index and by the flat scan."""
        cache = self.parent.state[ctx][0]
        store, planner = cache.store, cache.planner
        a, b = planner.q_win_span
        n_q = min(n_queries, b - a)  # recorded slots only (the others are zeros, which tie every block)
        k = self.parent.eng.config.long_context.second_select_num
        n = differ = walked = 0
        try:
            for layer in range(planner.q_win.shape[0]):
                for q in planner.q_win[layer, planner.q_win.shape[1] - n_q:]:
                    q, var = q.float().cpu().contiguous(), None
                    if planner.dual_chunk is not None:  # the three rotations, and the blocks each reads
                        q, bs = q.view(3, -1, q.shape[-1]), store.block_size
                        var = planner.dual_chunk.block_bounds((b - 1) // planner.dual_chunk.length, bs)
                    picks = []
                    for walk in (True, False):
                        store.set_walk_index(walk)
                        picks.append(store.select(layer, q, k, variants=var))
                        if walk:
                            walked += store.last_index_stats()["groups"] > 0
                    n += 1
                    differ += not torch.equal(picks[0], picks[1])
        finally:
            store.set_walk_index(True)
        return n, differ, walked


class LlamaCppRunner:
    """llama.cpp through llama-cpp-python: one Llama context per prompt length."""

    engine = "llama.cpp"
    label = "llama.cpp"

    def __init__(self, lc, model_path, max_len: int, threads: int, tokenizer):
        self.lc, self.model_path, self.max_len, self.threads, self.tokenizer = lc, model_path, max_len, threads, tokenizer
        self.state: dict[int, list] = {}
        self.first_token_s: dict[int, float] = {}  # as KtquestRunner's: argmax and one eval after the prompt

    def prefill(self, ctx: int) -> float:
        tokens = context_tokens(self.tokenizer, ctx)
        # swa_full=False: a sliding-window model's SWA layers keep their window only, as llama.cpp's own CLI
        # does by default (llama-cpp-python 0.3.36 defaults to the full-size cache, which those layers then
        # read whole and mask: at 30K tokens Gemma 3's decode ran at a third of the speed)
        t_load = time.perf_counter()
        llm = self.lc.Llama(model_path=str(self.model_path), n_ctx=self.max_len, n_threads=self.threads,
                            n_threads_batch=self.threads, n_batch=512, verbose=False, swa_full=False)
        t0 = time.perf_counter()
        self.model_load_s = t0 - t_load  # (its file mapped and populated: bench_engines adds it to load_s)
        llm.eval(tokens)
        t1 = time.perf_counter()
        llm.eval([_last_argmax(llm)])  # the first token's step: not in the decode rounds, timed on its own
        self.state[ctx] = [llm, _last_argmax(llm)]
        self.first_token_s[ctx] = time.perf_counter() - t1
        return t1 - t0

    def decode(self, ctx: int, n: int) -> float:
        st = self.state[ctx]
        llm, tok = st
        t0 = time.perf_counter()
        for _ in range(n):
            llm.eval([tok])
            tok = _last_argmax(llm)
        st[1] = tok
        return time.perf_counter() - t0

    def row(self) -> dict:
        return dict(engine="llama.cpp", label="llama.cpp", mode="dense", config="llama.cpp defaults (F16 KV, swa_full off)",
                    version=getattr(self.lc, "__version__", "?"))


def run(runners: list, contexts: list[int], decode_n: int, rounds: int, threads: int) -> list[dict]:
    """Prefill every (runner, context), then `rounds` rounds that each decode `decode_n` tokens in every
    (runner, context) in turn: slow drifts of a noisy host hit every cell of a round alike, so per-round
    ratios (and the medians over rounds) compare like with like."""
    cells = {}
    for r in runners:
        for ctx in contexts:
            if isinstance(r, SelectionView):  # decodes on its runner's prefill
                cells[(r.label, ctx)] = dict(cells[(r.parent.label, ctx)], **r.row(), decode_rounds_tok_s=[])
                continue
            t = r.prefill(ctx)
            first = r.first_token_s.get(ctx)  # the first token after the prompt (a filled cell's: untimed)
            cells[(r.label, ctx)] = dict(r.row(), context=ctx, prefill_tok_s=ctx / t, prefill_s=t, threads=threads,
                                         decode_tokens=decode_n, rounds=rounds, decode_rounds_tok_s=[],
                                         first_token_s=first, rss_mib=_rss_mib(),
                                         peak_rss_mib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                                         **(r.memory(ctx) if isinstance(r, KtquestRunner) else {}))
            print(f"{r.engine:>9} {r.label:>13} ctx {ctx:>7}: prefill {ctx / t:8.1f} tok/s"
                  + (f", first token {first:.2f} s" if first is not None else ""), flush=True)
    for i in range(rounds):
        for r in runners:
            for ctx in contexts:
                cells[(r.label, ctx)]["decode_rounds_tok_s"].append(decode_n / r.decode(ctx, decode_n))
        print(f"round {i + 1}/{rounds}: " + ", ".join(
            f"{lab} {ctx}: {c['decode_rounds_tok_s'][-1]:.1f}" for (lab, ctx), c in cells.items()), flush=True)
    for c in cells.values():
        c["decode_tok_s"] = statistics.median(c["decode_rounds_tok_s"])
    return list(cells.values())


def paired_ratio(cell: dict[tuple[str, int], dict], a: tuple[str, int], b: tuple[str, int]) -> float | None:
    """Median over rounds of decode speed a / b (label, context), each round's cells against each other.
    cell: the rows by (label, context)."""
    if a not in cell or b not in cell:
        return None
    return statistics.median(x / y for x, y in zip(cell[a]["decode_rounds_tok_s"], cell[b]["decode_rounds_tok_s"]))


def _rss_mib() -> float:
    """The process's resident memory now, MiB (Linux)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _last_argmax(llm) -> int:
    """Greedy next token after llm.eval: the logits of the last evaluated token (the only ones kept)."""
    import numpy as np

    return int(np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(llm.n_vocab(),)).argmax())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="GGUF path or bundled model name (default: smollm2-135m)")
    ap.add_argument("--contexts", default="1024,4096,8192", help="comma-separated context lengths, tokens")
    ap.add_argument("--modes", default="dense",
                    help="comma-separated: dense, long_context, or preset names from configs/ (quest, snapkv, ...)")
    ap.add_argument("--config", action="append", default=[],
                    help="MODE=YAML to bench a mode with a given preset (default long_context=configs/snapkv.yaml)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override for ktquest")
    ap.add_argument("--peer", default="llama.cpp", help="'llama.cpp' (when installed) or 'none'")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--decode-tokens", type=int, default=32, help="decode tokens per round")
    ap.add_argument("--rounds", type=int, default=1,
                    help="decode rounds; each decodes in every (engine, context) in turn, medians reported")
    ap.add_argument("--chunk-size", type=int, default=0, help="prefill chunk (default: the config's)")
    ap.add_argument("--sampling", default="greedy",
                    help="comma-separated: greedy, chat (the chat's default sampling, ktquest.config.CHAT_GENERATION);"
                         " each mode runs once per sampling")
    ap.add_argument("--orders", default="",
                    help="comma-separated prefill orders (chunk, layer): each mode runs once per order (default: the "
                         "config's)")
    ap.add_argument("--dual-chunk", default="",
                    help="comma-separated dual_chunk.mode values (auto, on, off): each mode runs once per value "
                         "(default: the config's)")
    ap.add_argument("--selection-views", action="store_true",
                    help="for each long_context mode whose store has an index (index_group > 0): also decode on its "
                         "prefilled caches with every block competing, through the index and by the flat scan, and "
                         "compare the two's picks")
    ap.add_argument("--synthetic", action="store_true",
                    help="no prefill: fill each context with made-up K/V (tools/synthetic_context.py) and decode "
                         "after it; needs --peer none")
    ap.add_argument("--json", default=None, help="write the rows here")
    a = ap.parse_args(argv)

    if a.synthetic and a.peer != "none":
        ap.error("--synthetic: llama.cpp cannot be handed a made-up context; add --peer none")
    model_path = resolve_model(a.model) if a.model else bundled_model_path()
    contexts = [int(c) for c in a.contexts.split(",") if c]
    modes = [m for m in a.modes.split(",") if m]
    configs = dict(MODE_CONFIGS)
    for item in a.config:
        mode, _, path = item.partition("=")
        configs[mode] = path
    torch.set_num_threads(a.threads)
    # each context's cache takes a warm-up token, then every round's tokens of the runner and of its selection
    # views (which extend the runner's conversation)
    room = 1 + a.decode_tokens * a.rounds * (3 if a.selection_views else 1)
    max_len = max(contexts) + room + 16
    samplings = [s for s in a.sampling.split(",") if s]
    if not samplings or any(s not in ("greedy", "chat") for s in samplings):
        ap.error(f"--sampling {a.sampling}: a comma-separated list of greedy, chat")
    orders = [o for o in a.orders.split(",") if o] or [""]
    if any(o not in ("", "chunk", "layer") for o in orders):
        ap.error(f"--orders {a.orders}: a comma-separated list of chunk, layer")
    dcas = [d for d in a.dual_chunk.split(",") if d] or [""]
    if any(d not in ("", "auto", "on", "off") for d in dcas):
        ap.error(f"--dual-chunk {a.dual_chunk}: a comma-separated list of auto, on, off")
    runners: list = []
    for mode in modes:
        try:
            configs[mode] = mode_config(mode, configs)
        except ValueError as e:
            ap.error(str(e))
        for sampling, order, dca in ((s, o, d) for s in samplings for o in orders for d in dcas):
            label = mode if len(samplings) == 1 else f"{mode}/{sampling}"
            label = label if not order else f"{label}/{order}"
            label = label if not dca else f"{label}/dca-{dca}"
            sets = a.set + ([f"prefill.order={order}"] if order else [])
            sets += [f"dual_chunk.mode={dca}"] if dca else []
            # (the fill takes the cache's layer-major prompt protocol, which reads exactly; decode is alike)
            sets += ["prefill.mode=exact"] if a.synthetic and mode != "dense" else []
            r = KtquestRunner(model_path, label, "long_context" if mode not in MODE_CONFIGS else mode,
                              configs[mode], max_len, a.threads, a.chunk_size, sets, sampling, a.synthetic)
            runners.append(r)
            c = r.eng.config
            if a.selection_views and c.mode == "long_context" and c.long_context.index_group > 0:
                runners += [SelectionView(r, walk=True), SelectionView(r, walk=False)]
    for r in runners:  # a --set max_seq_len (or a preset's) that the decode rounds would overrun: refused now,
        if isinstance(r, KtquestRunner) and r.eng.max_seq_len < max(contexts) + room:  # not after hours of prefill
            ap.error(f"{r.label}: max_seq_len={r.eng.max_seq_len} leaves {r.eng.max_seq_len - max(contexts)} "
                     f"positions after the {max(contexts)}-token context; the run decodes {room} there (a warm-up, "
                     f"{a.rounds} round(s) of {a.decode_tokens}{' for it and each selection view' if a.selection_views else ''}"
                     f"): raise max_seq_len to at least {max(contexts) + room}")
    if a.peer == "llama.cpp":
        lc = llama_cpp()
        if lc is None:
            print("llama-cpp-python is not installed: no peer rows", file=sys.stderr)
        else:
            from ktquest.formats.tokenizer import Tokenizer
            from ktquest.models.loader import read_gguf

            tokenizer = Tokenizer.from_gguf_metadata(read_gguf(model_path).metadata)
            runners.append(LlamaCppRunner(lc, model_path, max_len, a.threads, tokenizer))
    rows = run(runners, contexts, a.decode_tokens, a.rounds, a.threads)

    print()
    print(f"first token: seconds after the prompt; decode tok/s: steady, median of {a.rounds} round(s) of "
          f"{a.decode_tokens} tokens"
          + ("; synthetic contexts (made-up K/V, no prefill)" if a.synthetic else ""))
    print(f"| engine | mode / preset | context | {'fill' if a.synthetic else 'prefill'} tok/s "
          "| first token s | decode tok/s | KV MiB | RSS MiB |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        kv = f"{r['kv_mib']:.0f}" if r.get("kv_mib") is not None else "-"
        first = f"{r['first_token_s']:.3f}" if r.get("first_token_s") is not None else "-"
        print(f"| {r['engine']} | {r['label']} | {r['context']} | {r['prefill_tok_s']:.1f} | {first} "
              f"| {r['decode_tok_s']:.2f} | {kv} | {r['rss_mib']:.0f} |")
    labels = list(dict.fromkeys(r["label"] for r in rows))
    cell = {(r["label"], r["context"]): r for r in rows}
    if "llama.cpp" in labels:
        print()
        for lab in labels:
            if lab == "llama.cpp":
                continue
            for ctx in contexts:
                pre = cell[(lab, ctx)]["prefill_tok_s"] / cell[("llama.cpp", ctx)]["prefill_tok_s"]
                print(f"ktquest {lab} / llama.cpp at {ctx}: prefill {pre:.2f}x, decode "
                      f"{paired_ratio(cell, (lab, ctx), ('llama.cpp', ctx)):.2f}x (median of per-round ratios)")
    if len(contexts) > 1:
        lo = min(contexts)
        for lab in labels:
            for ctx in contexts:
                if ctx != lo:
                    print(f"{lab}: decode at {ctx} is {paired_ratio(cell, (lab, ctx), (lab, lo)):.0%} of its speed "
                          f"at {lo} (median of per-round ratios)")
    if sorted(orders) == ["chunk", "layer"] and len(samplings) == 1:  # layer-major against chunk-major prefill
        for mode in modes:
            for ctx in contexts:
                c, lay = cell[(f"{mode}/chunk", ctx)], cell[(f"{mode}/layer", ctx)]
                print(f"{mode}: layer-major prefill at {ctx} is {lay['prefill_tok_s'] / c['prefill_tok_s']:.2f}x "
                      f"chunk-major's, decode after it {paired_ratio(cell, (f'{mode}/layer', ctx), (f'{mode}/chunk', ctx)):.2f}x")
    if len(samplings) > 1:  # the sampler's cost: the chat's sampling against greedy, round by round
        for mode in modes:
            for ctx in contexts:
                r = paired_ratio(cell, (f"{mode}/chat", ctx), (f"{mode}/greedy", ctx))
                print(f"{mode}: decode with the chat's sampling at {ctx} is {r:.1%} of greedy's speed "
                      f"(median of per-round ratios)")
    for r in runners:  # the index against the flat scan, on the same store, round by round
        if isinstance(r, SelectionView) and r.walk:
            flat = r.label.removesuffix("index") + "flat"
            for ctx in contexts:
                n, differ, walked = r.same_picks(ctx)
                cell[(r.label, ctx)].update(picks_compared=n, picks_differing=differ, picks_index_walked=walked)
                print(f"{r.parent.label}: with every block competing at {ctx}, decode through the index is "
                      f"{paired_ratio(cell, (r.label, ctx), (flat, ctx)):.2f}x the flat scan's (median of "
                      f"per-round ratios); picks of {n} selections (the last prefill queries, every layer; {walked} "
                      f"of them walked the index): {n - differ} identical, {differ} differ")
    spin, policy = os.environ.get("GOMP_SPINCOUNT"), os.environ.get("OMP_WAIT_POLICY")
    print(f"torch's idle OpenMP workers: GOMP_SPINCOUNT={spin or 'unset (libgomp default)'}, "
          f"OMP_WAIT_POLICY={policy or 'unset'}")
    for r in rows:
        r["gomp_spincount"], r["omp_wait_policy"] = spin, policy
    if a.json:
        write_json(a.json, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
