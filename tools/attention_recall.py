#!/usr/bin/env python3
"""Attention recall of block selection: how much of the dense attention mass the selected blocks hold.

A dense prefill of the prompt records the queries of its last ``--queries`` tokens in every layer (the
stand-in for decode steps right after the prompt). Then, per layer, the dense K (after RoPE) goes into a
``ktquest.native.store.KVStore`` once per anchor type, each query selects ``--budget`` blocks the way the config's
long_context does (block_size, head_select_mode, the init and local windows excluded), and the dense
softmax of that query (torch, fp32) says what fraction of its mass lies in what sparse attention would see:

- ``recall``: mass in the init window + local window + selected blocks (1 = sparse equals dense);
- ``ctx_recall``: mass in the selected blocks / mass in all candidate blocks (the selection alone);
- ``oracle``: ``recall`` of the best possible choice of ``--budget`` blocks (true block mass, per KV head).

The windows are laid out as ``LongContextCache`` does (init rounded up to whole blocks, the local window
starting at the block boundary at or before n - local_windows_len). DYNAMIC anchors need a per-token
importance: here a token's SnapKV score from the recorded queries (the runtime uses the attention a token
gets from its own prefill chunk), so DYNAMIC's numbers are indicative.

Layers below dense_layer_num attend densely in long_context mode; they are still measured (marked ``*``) so
the table shows which layers need it. QUEST tightness: for each query head and candidate block, the QUEST
upper bound sum_d max(q_d min_d, q_d max_d) minus the true maximum q.k over the block's keys (both scaled by
1/sqrt(D): logit units, 0 = tight), and the overlap of the top-``budget`` blocks by bound and by true max.

    python tools/attention_recall.py --prompt-file README.md --config configs/quest.yaml --budget 16 \
        --json tools/out/recall.json --png tools/out/recall.png
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from pathlib import Path

import torch

_TOOLS = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [_TOOLS, os.path.dirname(_TOOLS)]  # tools/common.py and the ktquest package
from common import write_json

import ktquest
from ktquest.config import load_config
from ktquest.generate import prefill
from ktquest.kv.dense import DenseKVCache
from ktquest.kv.selection import snapkv_token_scores
from ktquest.native.store import ANCHOR_TYPES, KVStore


class RecordingCache:
    """The cache interface around a ``DenseKVCache``: attention unchanged, the queries of positions
    ``>= record_from`` kept per layer (q: [W, H, D], after RoPE)."""

    def __init__(self, inner: DenseKVCache, record_from: int):
        self.inner = inner
        self.record_from = record_from
        self.queries: dict[int, list[torch.Tensor]] = {}

    def attend(
        self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start_pos: int
    ) -> torch.Tensor:
        first = max(self.record_from - start_pos, 0)
        if first < q.shape[0]:
            self.queries.setdefault(layer_idx, []).append(q[first:].float().clone())
        return self.inner.attend(layer_idx, q, k, v, start_pos)

    def query(self, layer: int) -> torch.Tensor:
        return torch.cat(self.queries[layer])  # [W, H, D]

    def __getattr__(self, name):  # pos, max_seq_len, reset, ... of the dense cache
        return getattr(self.inner, name)


def prompt_tokens(eng, path: str, raw: bool, max_tokens: int) -> list[int]:
    text = Path(path).read_text(encoding="utf-8", errors="replace")
    tok = eng.tokenizer
    if raw:
        ids = tok.encode(text)
    else:
        ids = tok.encode_chat(tok.apply_chat_template([{"role": "user", "content": text}]))
    if max_tokens and len(ids) > max_tokens:
        ids = ids[len(ids) - max_tokens :]  # keep the end: the question and the chat turn
    return ids


def global_layers(cache) -> tuple[DenseKVCache, list[int]]:
    """The dense cache of the model's global layers and, for each of its layers, the model's layer index: the
    cache itself and every layer, or a ``HybridCache``'s (gemma3) main cache and its global layers."""
    route = getattr(cache, "route", None)  # HybridCache: model layer -> (sliding, index in its part)
    if route is None:
        return cache, list(range(cache.n_layers))
    return cache.main, sorted((i for i, (sliding, _) in route.items() if not sliding), key=lambda i: route[i][1])


def candidate_range(n: int, block_size: int, init_len: int, local_len: int) -> tuple[int, int]:
    """Context blocks [b0, b1), as ``LongContextCache`` lays them out for n tokens: the init window is whole
    blocks [0, b0) (init_len rounded up), the local window starts at a block boundary at or before
    n - local_len (and not inside the init window); everything between is selectable."""
    nb = -(-n // block_size)
    b0 = min(-(-init_len // block_size), nb)
    b1 = max(n - local_len, 0) // block_size
    return b0, max(b0, b1)


def measure(
    rec: RecordingCache,
    n: int,
    lc,
    budget: int,
    anchor_num: int,
    threads: int,
    anchors: list[str],
    on_layer=None,
) -> tuple[list[dict], list[dict]]:
    """Recall rows (anchor, layer, head) and QUEST rows (layer, head), averaged over the recorded queries (each
    anchor type's selection with the config's ``rerank`` second stage, as a decode step makes it); the
    model's global layers (a sliding-window model's windows never reach the store: its ``HybridCache`` holds the
    global layers in a dense cache of their own, renumbered, and ``dense_layer_num`` counts them)."""
    dense, layers = global_layers(rec.inner)
    KVH, _, D = dense.layer_kv(0)[0].shape
    bs = lc.block_size
    nb = -(-n // bs)
    b0, b1 = candidate_range(n, bs, lc.init_windows_len, lc.local_windows_len)
    exclude = [(0, b0), (b1, nb)]
    mode = lc.head_select_mode
    rows, quest_rows = [], []
    for j, layer in enumerate(layers):  # j: the layer in the dense cache, layer: the model's
        q = rec.query(layer)  # [W, H, D]
        W, H, _ = q.shape
        G = H // KVH
        k, v = (t[:, :n].float() for t in dense.layer_kv(j))  # [KVH, n, D]
        qpos = torch.arange(n - W, n)  # [W]
        # ---- dense softmax mass per token and per block ----
        kh = k.repeat_interleave(G, 0)  # [H, n, D]: query head h reads KV head h // G
        logits = torch.einsum("whd,hnd->hwn", q, kh) / math.sqrt(D)  # [H, W, n]
        logits = logits.masked_fill(torch.arange(n)[None, None, :] > qpos[None, :, None], float("-inf"))
        p = torch.softmax(logits, -1)  # [H, W, n]
        tok_pos = torch.arange(n)
        window = (tok_pos < b0 * bs) | (tok_pos >= b1 * bs)  # [n]: init and local windows, attended densely
        window_mass = p[:, :, window].sum(-1)  # [H, W]
        cand = torch.zeros(nb, dtype=torch.bool)
        cand[b0:b1] = True
        # Windows are whole blocks, so this is the mass of each candidate block (0 for window blocks).
        outside = torch.nn.functional.pad(~window, (0, nb * bs - n)).view(nb, bs)  # [nb, bs]
        block_mass_out = (torch.nn.functional.pad(p, (0, nb * bs - n)).view(H, W, nb, bs) * outside).sum(-1)
        cand_mass = block_mass_out[:, :, cand].sum(-1)  # [H, W]
        # ---- oracle: the best budget blocks per KV head by true mass (mean over the group) ----
        group_mass = block_mass_out.view(KVH, G, W, nb).mean(1)  # [KVH, W, nb]
        group_mass = group_mass.masked_fill(~cand, -1.0)
        k_eff = min(budget, b1 - b0)
        oracle_ids = group_mass.topk(k_eff, -1).indices if k_eff else torch.zeros(KVH, W, 0, dtype=torch.long)
        oracle_sel = torch.zeros(KVH, W, nb, dtype=torch.bool).scatter_(-1, oracle_ids, True)
        oracle_sel = oracle_sel.repeat_interleave(G, 0)  # [H, W, nb]
        oracle = window_mass + (block_mass_out * oracle_sel).sum(-1)
        for a_type in anchors:
            store = KVStore(
                1,
                KVH,
                D,
                n,
                block_size=bs,
                kv_type="FP32",
                anchor_type=a_type,
                anchor_num=2 if a_type == "QUEST" else 1 if a_type.startswith("BLOCK") else anchor_num,
                threads_num=threads,
            )
            importance = None
            if a_type == "DYNAMIC":  # importance of a token: its SnapKV score from the recorded window
                importance = snapkv_token_scores(q, k.transpose(0, 1), n - W).T.contiguous()  # [n, KVH]
            store.append(0, k.transpose(0, 1).contiguous(), v.transpose(0, 1).contiguous(), importance)
            sel = torch.zeros(H, W, nb, dtype=torch.bool)
            for w in range(W):
                ids = store.select(0, q[w].contiguous(), budget, mode=mode, exclude_ranges=exclude,
                                   rerank=lc.rerank)  # (the config's second stage, if any)
                ids = ids[None].expand(KVH, -1) if mode == "SHARED" else ids  # [KVH, k]
                for g in range(KVH):
                    chosen = ids[g][ids[g] >= 0].long()
                    sel[g * G : (g + 1) * G, w, chosen] = True
            sel_mass = (block_mass_out * sel).sum(-1)  # [H, W]
            recall = window_mass + sel_mass
            ctx = torch.where(
                cand_mass > 0, sel_mass / cand_mass.clamp_min(1e-30), torch.ones_like(cand_mass)
            )
            for h in range(H):
                rows.append(
                    {
                        "anchor": a_type,
                        "layer": layer,
                        "head": h,
                        "dense_layer": j < lc.dense_layer_num,
                        "recall": recall[h].mean().item(),
                        "ctx_recall": ctx[h].mean().item(),
                        "oracle": oracle[h].mean().item(),
                        "window_mass": window_mass[h].mean().item(),
                    }
                )
            if a_type == "QUEST":
                quest_rows += quest_tightness(store, q, kh, n, bs, b0, b1, budget, layer)
        if on_layer is not None:
            on_layer(layer)
    return rows, quest_rows


def quest_tightness(
    store: KVStore,
    q: torch.Tensor,
    kh: torch.Tensor,
    n: int,
    bs: int,
    b0: int,
    b1: int,
    budget: int,
    layer: int,
) -> list[dict]:
    """Per query head: mean (bound - true max) over candidate blocks (logit units) and top-budget overlap."""
    if b1 <= b0:
        return []
    W, H, D = q.shape
    KVH = store.n_kv_heads
    G = H // KVH
    anchors, _ = store.anchors(0)  # [KVH, nb, 2, D]: element-wise min, max
    lo = anchors[:, b0:b1, 0].repeat_interleave(G, 0)  # [H, C, D]
    hi = anchors[:, b0:b1, 1].repeat_interleave(G, 0)
    qh = q.permute(1, 0, 2)  # [H, W, D]
    bound = torch.maximum(qh[:, :, None] * lo[:, None], qh[:, :, None] * hi[:, None]).sum(-1)  # [H, W, C]
    keys = kh[:, b0 * bs : min(b1 * bs, n)]  # [H, C*bs, D]
    dots = torch.einsum("hwd,hnd->hwn", qh, keys)  # [H, W, C*bs]
    dots = torch.nn.functional.pad(dots, (0, (b1 - b0) * bs - dots.shape[-1]), value=float("-inf"))
    true_max = dots.view(H, W, b1 - b0, bs).amax(-1)  # [H, W, C]
    scale = 1 / math.sqrt(D)
    gap = (bound - true_max) * scale
    k_eff = min(budget, b1 - b0)
    out = []
    for h in range(H):
        top_b = bound[h].topk(k_eff, -1).indices
        top_t = true_max[h].topk(k_eff, -1).indices
        overlap = sum(len(set(a.tolist()) & set(b.tolist())) for a, b in zip(top_b, top_t)) / (
            W * max(k_eff, 1)
        )
        out.append(
            {
                "layer": layer,
                "head": h,
                "quest_gap": gap[h].mean().item(),
                "quest_gap_max": gap[h].max().item(),
                "quest_topk_overlap": overlap,
            }
        )
    return out


def markdown(rows: list[dict], quest_rows: list[dict], anchors: list[str], n_layers: int) -> str:
    def mean(sel, key):
        return sum(r[key] for r in sel) / len(sel) if sel else float("nan")

    out = ["| anchor | recall | ctx_recall | oracle | worst layer (recall) |", "|---|---|---|---|---|"]
    for a in anchors:
        sel = [r for r in rows if r["anchor"] == a and not r["dense_layer"]]
        per_layer = {
            layer: mean([r for r in sel if r["layer"] == layer], "recall")
            for layer in {r["layer"] for r in sel}
        }
        worst = min(per_layer, key=per_layer.get) if per_layer else None
        out.append(
            f"| {a} | {mean(sel, 'recall'):.3f} | {mean(sel, 'ctx_recall'):.3f} | {mean(sel, 'oracle'):.3f} | "
            + (f"{worst} ({per_layer[worst]:.3f})" if worst is not None else "-")
            + " |"
        )
    out += [
        "",
        "| layer | window mass | " + " | ".join(anchors) + " | oracle | QUEST gap | QUEST top-k overlap |",
        "|---" * (len(anchors) + 5) + "|",
    ]
    for layer in sorted({r["layer"] for r in rows}):  # (a sliding-window model's global layers only)
        sel = [r for r in rows if r["layer"] == layer]
        qs = [r for r in quest_rows if r["layer"] == layer]
        mark = "*" if sel and sel[0]["dense_layer"] else ""
        cells = [f"{mean([r for r in sel if r['anchor'] == a], 'recall'):.3f}" for a in anchors]
        out.append(
            f"| {layer}{mark} | {mean(sel, 'window_mass'):.3f} | "
            + " | ".join(cells)
            + f" | {mean(sel, 'oracle'):.3f} | "
            + (f"{mean(qs, 'quest_gap'):.2f} | {mean(qs, 'quest_topk_overlap'):.2f} |" if qs else "- | - |")
        )
    return "\n".join(out)


def heatmap(rows: list[dict], anchors: list[str], path: str, title: str) -> None:
    """Layer x head recall, one panel per anchor type, and the oracle."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    L = max(r["layer"] for r in rows) + 1
    H = max(r["head"] for r in rows) + 1
    panels = [(a, "recall") for a in anchors] + [(anchors[0], "oracle")]
    fig, axes = plt.subplots(
        1, len(panels), figsize=(1.0 + 0.3 * H * len(panels) + len(panels), 1.5 + 0.16 * L), squeeze=False
    )
    for ax, (a, key) in zip(axes[0], panels):
        grid = np.full((L, H), np.nan)
        for r in rows:
            if r["anchor"] == a:
                grid[r["layer"], r["head"]] = r[key]
        im = ax.imshow(grid, vmin=0, vmax=1, cmap="viridis", aspect="auto")
        ax.set_title("oracle" if key == "oracle" else a, fontsize=9)
        ax.set_xlabel("head")
        ax.set_xticks(range(0, H, max(1, H // 8)))
    axes[0][0].set_ylabel("layer")
    fig.colorbar(im, ax=axes[0].tolist(), shrink=0.8, label="dense attention mass recalled")
    fig.suptitle(title, fontsize=9)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompt-file", required=True, help="text file: the user message (or raw text, --raw)")
    ap.add_argument("--config", default=None, help="YAML preset whose long_context knobs to measure")
    ap.add_argument(
        "--budget", type=int, default=0, help="blocks selected per KV head (0 = second_select_num)"
    )
    ap.add_argument(
        "--model", default=None, help="GGUF path or bundled model name (default: the config's, else smollm2-135m)"
    )
    ap.add_argument("--queries", type=int, default=16, help="last prompt tokens whose queries are measured")
    ap.add_argument("--max-tokens", type=int, default=0, help="keep the last N prompt tokens (0 = all)")
    ap.add_argument("--anchors", default=",".join(ANCHOR_TYPES), help="comma-separated anchor types")
    ap.add_argument(
        "--anchor-num", type=int, default=0, help="FIXED/DYNAMIC anchors per block (0 = config's, or 4)"
    )
    ap.add_argument("--raw", action="store_true", help="no chat template")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override")
    ap.add_argument("--json", default=None)
    ap.add_argument("--png", default=None)
    ap.add_argument("--quiet", action="store_true", help="no progress bar")
    args = ap.parse_args(argv)
    from rich.progress import Progress

    t_start = time.perf_counter()
    sets = [*args.set] + ([f"threads={args.threads}"] if args.threads else [])
    cfg = load_config(args.config, sets)
    lc = cfg.long_context
    budget = args.budget or lc.second_select_num
    anchors = [a.strip().upper() for a in args.anchors.split(",") if a.strip()]
    anchor_num = args.anchor_num or (lc.anchor_num if lc.anchor_type in ("FIXED", "DYNAMIC") else 4)
    threads = lc.threads_num or cfg.resolved_threads()
    # The measurement needs dense attention: load the model in dense mode with the config's other keys.
    eng = ktquest.load(args.model, load_config(args.config, [*sets, "mode=dense", "max_seq_len=0"]))
    ids = prompt_tokens(eng, args.prompt_file, args.raw, args.max_tokens)
    n = len(ids)
    if n >= eng.max_seq_len:
        ap.error(f"the prompt has {n} tokens; the model holds {eng.max_seq_len}: use --max-tokens")
    W = min(args.queries, n)
    rec = RecordingCache(eng.cache, record_from=n - W)
    eng.cache.reset()
    with Progress(disable=args.quiet, transient=True) as bar:
        job = bar.add_task(f"prefill {n} tokens", total=n)
        t0 = time.perf_counter()
        prefill(
            eng.model,
            rec,
            ids,
            cfg.chunk_size,
            on_progress=lambda done, total: bar.update(job, completed=done),
        )
        prefill_s = time.perf_counter() - t0
        job2 = bar.add_task("score blocks", total=eng.args.n_layers)
        t0 = time.perf_counter()
        rows, quest_rows = measure(
            rec, n, lc, budget, anchor_num, threads, anchors, on_layer=lambda layer: bar.advance(job2)
        )
        measure_s = time.perf_counter() - t0
    nb = -(-n // lc.block_size)
    b0, b1 = candidate_range(n, lc.block_size, lc.init_windows_len, lc.local_windows_len)
    print(
        f"## attention recall: {n} prompt tokens, last {W} queries, {args.config or 'defaults'}: "
        f"block_size {lc.block_size}, budget {budget} blocks ({budget * lc.block_size} tokens) of {b1 - b0} "
        f"candidates ({nb} blocks; init {lc.init_windows_len} + local {lc.local_windows_len} tokens dense), "
        f"{lc.head_select_mode}, dense_layer_num {lc.dense_layer_num} (* rows)\n"
    )
    print(markdown(rows, quest_rows, anchors, eng.args.n_layers))
    total = time.perf_counter() - t_start
    print(
        f"\nprefill {prefill_s:.1f} s ({n / prefill_s:.0f} tok/s), scoring {measure_s:.1f} s, total {total:.1f} s"
    )
    if b1 - b0 <= budget:
        print(
            f"note: the budget covers every candidate block ({b1 - b0}): recall is 1 by construction; "
            "use a longer prompt or a smaller budget / local window",
            file=sys.stderr,
        )
    meta = {
        "prompt_file": args.prompt_file,
        "config": args.config,
        "model": args.model,
        "prompt_tokens": n,
        "queries": W,
        "budget": budget,
        "block_size": lc.block_size,
        "init_windows_len": lc.init_windows_len,
        "local_windows_len": lc.local_windows_len,
        "head_select_mode": lc.head_select_mode,
        "dense_layer_num": lc.dense_layer_num,
        "candidate_blocks": [b0, b1],
        "anchors": anchors,
        "prefill_s": prefill_s,
        "prefill_tok_s": n / prefill_s,
        "measure_s": measure_s,
        "total_s": total,
    }
    if args.json:
        write_json(args.json, {"meta": meta, "rows": rows, "quest": quest_rows})
    if args.png:
        heatmap(
            rows,
            anchors,
            args.png,
            f"attention recall, {n} tokens, budget {budget}x{lc.block_size}, "
            f"{Path(args.config).stem if args.config else 'defaults'}",
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
