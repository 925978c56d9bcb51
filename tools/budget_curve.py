"""The budget curve of block selection: at several budgets (a share of the context: 25%, 6%, 2%, 0.5%), how much of
dense attention the selected blocks and the windows hold, for each anchor type, selection mode and first stage.

One dense prefill of a RULER sample (``ktquest.eval.ruler``; the question at the end) records the queries of its
last ``--queries`` tokens in every global layer (the stand-in for the decode steps of the answer). Then, per layer
and query head, against the dense softmax of those queries (torch, fp32):

- ``mass``: the attention mass in the init window + local window + selected blocks (1: sparse equals dense);
- ``top``: the share of the true top ``--top-tokens`` tokens (by attention weight) that lie there;
- ``oracle``: ``mass`` of the best blocks by true mass at the same budget (per KV head).

A budget is the selected tokens per KV head over the context (``--shares``), the windows (the config's
init_windows_len and local_windows_len) on top, as the presets count it. Selections measured:

- each anchor type (``--anchors``) in each mode (``--modes``: SEPARATE per KV head, SHARED one for all);
- ``+rerank R`` (``--rerank``): a second stage: the anchors' top R x k blocks, re-scored by the true maximum of
  q . k over each block's keys (the largest over the KV head's query heads), the best k kept (what an int8 copy
  of the keys would approximate); ``--rerank-by mass``: by each block's true attention mass; ``--rerank-by
  store``: the store's own second stage (``long_context.rerank``, cpp/kvstore/rerank.h), masses as shares over
  the R k picks, what a decode step runs.

    python tools/budget_curve.py --model gemma3-270m --task niah_multikey_2 --length 32768 \\
        --shares 0.25,0.06,0.02,0.005 --json docs/results/issue63/budget_curve_gemma3_32k.json

Layers below the config's ``dense_layer_num`` are left out of the means (they attend every block).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

_TOOLS = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [_TOOLS, os.path.dirname(_TOOLS)]
from attention_recall import RecordingCache, candidate_range, global_layers  # noqa: E402
from common import write_json  # noqa: E402

import ktquest  # noqa: E402
from ktquest.config import load_config  # noqa: E402
from ktquest.eval.ruler import RULER_TASKS, make_ruler_sample  # noqa: E402
from ktquest.generate import prefill  # noqa: E402
from ktquest.native.enums import MAX_RERANK  # noqa: E402
from ktquest.native.store import KVStore  # noqa: E402


def layer_rows(q, k, n: int, lc, shares: list[float], anchors: list[str], modes: list[str], reranks: list[int],
               top_tokens: int, threads: int, layer: int, rerank_by: str = "max") -> list[dict]:
    """The curve's rows of one layer: q [W, H, D] (after RoPE), k [KVH, n, D]."""
    import torch

    W, H, D = q.shape
    KVH = k.shape[0]
    G = H // KVH
    bs = lc.block_size
    nb = -(-n // bs)
    b0, b1 = candidate_range(n, bs, lc.init_windows_len, lc.local_windows_len)
    kh = k.repeat_interleave(G, 0)  # [H, n, D]
    qpos = torch.arange(n - W, n)
    logits = torch.einsum("whd,hnd->hwn", q, kh) / math.sqrt(D)  # [H, W, n]
    logits = logits.masked_fill(torch.arange(n)[None, None, :] > qpos[None, :, None], float("-inf"))
    p = torch.softmax(logits, -1)
    window = (torch.arange(n) < b0 * bs) | (torch.arange(n) >= b1 * bs)
    window_mass = p[:, :, window].sum(-1)  # [H, W]
    pad = nb * bs - n
    block_mass = torch.nn.functional.pad(p * ~window, (0, pad)).view(H, W, nb, bs).sum(-1)  # [H, W, nb]
    top = p.topk(min(top_tokens, n), -1).indices  # [H, W, T]
    top_block = top // bs  # the blocks of the true top tokens
    top_in_window = window[top]  # [H, W, T]
    # the true max of q . k in each block, per query head, then per KV head (max over its query heads)
    block_max = torch.nn.functional.pad(logits, (0, pad), value=float("-inf")).view(H, W, nb, bs).amax(-1)
    kv_max = block_max.view(KVH, G, W, nb).amax(1)  # [KVH, W, nb]
    if rerank_by == "mass":  # a block's attention mass, summed over the KV head's query heads (its tiles' LSE)
        kv_max = block_mass.view(KVH, G, W, nb).sum(1)
    cand = torch.zeros(nb, dtype=torch.bool)
    cand[b0:b1] = True
    rows = []

    def score(sel):  # sel [H, W, nb] bool: the selected blocks of each query head
        mass = window_mass + (block_mass * sel).sum(-1)
        hit = top_in_window | torch.gather(sel, -1, top_block)
        return mass.mean().item(), hit.float().mean().item()

    stores = {}
    for a_type in anchors:
        st = KVStore(1, KVH, D, n, block_size=bs, kv_type="FP32", anchor_type=a_type,
                     anchor_num=2 if a_type == "QUEST" else 1, threads_num=threads)
        st.append(0, k.transpose(0, 1).contiguous(), k.transpose(0, 1).contiguous(), None)
        stores[a_type] = st
    exclude = [(0, b0), (b1, nb)]
    for share in shares:
        kb = max(1, min(b1 - b0, round(share * n / bs)))  # blocks per KV head
        group_mass = block_mass.view(KVH, G, W, nb).mean(1).masked_fill(~cand, -1.0)
        o = torch.zeros(KVH, W, nb, dtype=torch.bool).scatter_(-1, group_mass.topk(kb, -1).indices, True)
        oracle_mass, oracle_top = score(o.repeat_interleave(G, 0))
        for a_type in anchors:
            for mode in modes:
                for r in reranks:
                    sel = torch.zeros(KVH, W, nb, dtype=torch.bool)
                    native = rerank_by == "store"  # the store's own second stage (long_context.rerank r)
                    first = kb if native else min(b1 - b0, kb * r)
                    for w in range(W):
                        ids = stores[a_type].select(0, q[w].contiguous(), first, mode=mode, exclude_ranges=exclude,
                                                    rerank=r if native else 1)
                        ids = ids[None].expand(KVH, -1) if mode == "SHARED" else ids  # [KVH, cols]
                        for g in range(KVH):
                            chosen = ids[g][ids[g] >= 0].long()
                            if r > 1 and len(chosen) > kb:  # second stage: the true block maxima (or masses)
                                chosen = chosen[kv_max[g, w, chosen].topk(kb).indices]
                            sel[g, w, chosen] = True
                    mass, hit = score(sel.repeat_interleave(G, 0))
                    rows.append({"layer": layer, "share": share, "blocks": kb, "anchor": a_type, "mode": mode,
                                 "rerank": r, "rerank_by": rerank_by, "mass": mass, "top": hit, "oracle_mass": oracle_mass,
                                 "oracle_top": oracle_top, "window_mass": window_mass.mean().item()})
    return rows


def curves(rows: list[dict]) -> dict[str, dict[float, tuple[float, float]]]:
    """Each selection's (mass, top) means by share, the oracle's last: {name: {share: (mass, top)}}."""
    out: dict[str, dict[float, tuple[float, float]]] = {}
    shares = sorted({r["share"] for r in rows})
    for a, m, r in sorted({(x["anchor"], x["mode"], x["rerank"]) for x in rows}):
        name = f"{a} {m}" + (f" +rerank {r}" if r > 1 else "")
        sel = {s: [x for x in rows if (x["anchor"], x["mode"], x["rerank"], x["share"]) == (a, m, r, s)] for s in shares}
        out[name] = {s: (sum(x["mass"] for x in v) / len(v), sum(x["top"] for x in v) / len(v)) for s, v in sel.items()}
    sel = {s: [x for x in rows if x["share"] == s] for s in shares}
    out["oracle"] = {s: (sum(x["oracle_mass"] for x in v) / len(v), sum(x["oracle_top"] for x in v) / len(v))
                     for s, v in sel.items()}
    return out


def plot(runs: list[dict], path: str) -> None:
    """One column a run (its JSON: task, n, rows): attention mass held and top-token recall against the budget,
    a line a selection."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, axes = plt.subplots(2, len(runs), figsize=(5.5 * len(runs), 8), squeeze=False)
    for j, run in enumerate(runs):
        for name, by_share in curves(run["rows"]).items():
            xs = sorted(by_share)
            for i in range(2):
                axes[i][j].plot([100 * x for x in xs], [by_share[x][i] for x in xs], "k--" if name == "oracle" else "-o",
                                label=name)
        for i, what in enumerate(("attention mass held", "share of the true top tokens held")):
            ax = axes[i][j]
            ax.set_xscale("log")
            ax.set_xticks([100 * x for x in sorted({r["share"] for r in run["rows"]})])
            ax.xaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
            ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
            ax.set_xlabel("budget, % of the context")
            ax.set_ylabel(what)
            ax.set_title(f"{run['task']} at {run['n']} tokens")
            ax.grid(True, alpha=0.3)
        axes[0][j].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def table(rows: list[dict], shares: list[float]) -> str:
    keys = sorted({(r["anchor"], r["mode"], r["rerank"]) for r in rows})
    head = "| selection | " + " | ".join(f"{s:.1%}: mass / top" for s in shares) + " |"
    out = [head, "|---" * (len(shares) + 1) + "|"]

    def mean(sel, key):
        return sum(r[key] for r in sel) / len(sel)

    for a, m, r in keys:
        cells = []
        for s in shares:
            sel = [x for x in rows if (x["anchor"], x["mode"], x["rerank"], x["share"]) == (a, m, r, s)]
            cells.append(f"{mean(sel, 'mass'):.3f} / {mean(sel, 'top'):.3f}")
        name = f"{a} {m}" + (f" +rerank {r} by {rows[0]['rerank_by']}" if r > 1 else "")
        out.append(f"| {name} | " + " | ".join(cells) + " |")
    cells = []
    for s in shares:
        sel = [x for x in rows if x["share"] == s]
        cells.append(f"{mean(sel, 'oracle_mass'):.3f} / {mean(sel, 'oracle_top'):.3f}")
    out.append("| oracle (true block mass) | " + " | ".join(cells) + " |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="gemma3-270m")
    ap.add_argument("--config", default="configs/quest.yaml", help="the windows, block size and dense layers")
    ap.add_argument("--task", default="niah_multikey_2", choices=RULER_TASKS)
    ap.add_argument("--length", type=int, default=32768)
    ap.add_argument("--trial", type=int, default=0)
    ap.add_argument("--shares", default="0.25,0.06,0.02,0.005")
    ap.add_argument("--anchors", default="QUEST,BLOCK_MAX,BLOCK_MEAN")
    ap.add_argument("--modes", default="SEPARATE,SHARED")
    ap.add_argument("--rerank", default="1,4", help="first-stage widths (1: the anchors alone)")
    ap.add_argument("--rerank-by", choices=("max", "mass", "store"), default="max",
                    help="the second stage's score: a block's true max q.k, or its attention mass (tile LSE), "
                         "both from the dense softmax; or the store's own second stage (long_context.rerank)")
    ap.add_argument("--cache", default=None, help="keep the recorded queries and keys in this .pt file (a second "
                                                  "run with the same arguments skips the prefill)")
    ap.add_argument("--queries", type=int, default=16)
    ap.add_argument("--top-tokens", type=int, default=100)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--json", default=None)
    ap.add_argument("--png", default=None, help="plot the curves here (with --replot: of those JSON files)")
    ap.add_argument("--replot", default=None, metavar="JSON[,JSON]", help="only plot these runs' JSON (no model)")
    a = ap.parse_args(argv)
    if a.rerank_by == "store" and max(int(x) for x in a.rerank.split(",")) > MAX_RERANK:
        ap.error(f"--rerank {a.rerank}: the store's second stage is at most {MAX_RERANK} wide")
    if a.replot:
        plot([json.loads(Path(f).read_text()) for f in a.replot.split(",")], a.png or "budget_curve.png")
        return 0
    import torch

    ktquest.set_openmp_spin()
    shares = [float(x) for x in a.shares.split(",")]
    sets = [*a.set, f"threads={a.threads}"]
    cfg = load_config(a.config, sets)
    lc = cfg.long_context
    extra = [f"sliding_window_keep={a.length}"] if "gemma" in a.model else []
    eng = ktquest.load(a.model, load_config(a.config, [*sets, *extra, "mode=dense", f"max_seq_len={a.length + 64}"]))
    sample = make_ruler_sample(eng.tokenizer, a.task, a.length, seed=0, trial=a.trial)
    ids = sample.tokens
    n = len(ids)
    W = min(a.queries, n)
    if a.cache and os.path.exists(a.cache):
        qk = torch.load(a.cache)
    else:
        rec = RecordingCache(eng.cache, record_from=n - W)
        eng.cache.reset()
        t0 = time.perf_counter()
        with torch.inference_mode():
            prefill(eng.model, rec, ids, cfg.chunk_size)
        print(f"prefill {n} tokens: {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
        dense, layers = global_layers(rec.inner)
        qk = [(layer, rec.query(layer), dense.layer_kv(j)[0][:, :n].float().clone()) for j, layer in enumerate(layers)]
        if a.cache:
            torch.save(qk, a.cache)
    rows = []
    t0 = time.perf_counter()
    for j, (layer, q, k) in enumerate(qk):
        if j < lc.dense_layer_num:
            continue
        rows += layer_rows(q, k, n, lc, shares, [x.strip() for x in a.anchors.split(",")],
                           [x.strip() for x in a.modes.split(",")], [int(x) for x in a.rerank.split(",")],
                           a.top_tokens, a.threads, layer, a.rerank_by)
        print(f"layer {layer}: {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    print(f"## budget curve: {a.model}, {a.task} at {n} tokens (trial {a.trial}), last {W} queries, block "
          f"{lc.block_size}, windows {lc.init_windows_len} + {lc.local_windows_len}, layers from "
          f"{lc.dense_layer_num} (mass: attention mass held; top: share of the true top {a.top_tokens} tokens)\n")
    print(table(rows, shares))
    run = {"model": a.model, "task": a.task, "n": n, "queries": W, "config": a.config, "block_size": lc.block_size,
           "rows": rows}
    if a.json:
        write_json(a.json, run)
    if a.png:
        plot([run], a.png)
    return 0


if __name__ == "__main__":
    sys.exit(main())
