#!/usr/bin/env python3
"""Long-context retrieval accuracy (passkey, needle, kv-retrieval, and RULER's tasks) per config x length x filler x
depth.

Each trial is one prompt from ``ktquest.eval.tasks`` (the answer hidden at a depth of a document of
``length`` tokens of a filler kind, asked about in a chat turn), answered greedily as the first turn of a conversation on
one Engine per config, and scored by exact match. Between trials the cache is rewound to the prefix the
next prompt shares with the last one (``--fresh``: reset). Prints markdown tables (accuracy per
config x length, per filler kind with the held-out kinds apart, per depth), writes JSON rows and a depth x
length heatmap per config.

``--fillers`` names the haystacks (``classic``: each task's own, the presets' tuning text; ``code``,
``prose``, ``narrative``, ``json``) or a group: ``tuning`` (classic, code), ``held-out`` (prose, narrative,
json: report these, never choose settings on them) or ``all``. Example:

    python tools/eval_longctx.py --task passkey --lengths 2048,4096,8192 --depths 0,0.25,0.5,0.75,1 \
        --trials 5 --configs dense,configs/quest.yaml --json tools/out/passkey.json --png tools/out/passkey.png

RULER's synthetic tasks (``ktquest.eval.ruler``: ``niah_single_1`` ... ``fwe``) are asked the same way; their
haystack and needle depths are part of the task (``--fillers`` and ``--depths`` are not taken), and a reply scores
RULER's share of the expected strings it holds (``correct`` is that share, 0..1).

``dense`` (or ``default``) in --configs means the built-in defaults (mode: dense). A config the runtime
refuses to load is reported and skipped, the others still run.

``--variant NAME:KEY=VALUE[,KEY=VALUE]`` (repeatable) answers every prompt of each long-context config
again under decode-time knobs (``LongContextCache.RETUNABLE``: ``sticky_blocks``, ``second_select_num``,
...), reported as config ``NAME+variant``: the prompt is read once, and each answer is decoded on the same
cache (the question's last token read again), so a variant costs its decode steps only. Example:
``--variant sticky4:sticky_blocks=4``.

With ``--json``, each prompt's answers are also appended to ``JSON.partial`` as they come (one line a prompt), and
the file is removed once the JSON is written. ``--resume`` takes the prompts a killed run with the same arguments
answered from there and asks only the rest (an hour-long run survives the end of a session); the first prompt
after a resume is read in full, as with ``--fresh``, which changes no answer.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import defaultdict
from pathlib import Path

_TOOLS = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [_TOOLS, os.path.dirname(_TOOLS)]  # tools/common.py and the ktquest package
from common import variant_knobs, write_atomic, write_json

import ktquest
from ktquest.config import ConfigError, load_config
from ktquest.eval import ruler
from ktquest.eval.tasks import (
    FILLERS,
    HELD_OUT_FILLERS,
    MAX_NEW_TOKENS,
    TASKS,
    TUNING_FILLERS,
    answer_complete,
    make_sample,
    score,
)

BUILTIN = ("dense", "default")
TASK_CHOICES = (*TASKS, *ruler.RULER_TASKS)


class RulerPrompt:
    """A RULER sample as the tool reads a retrieval one: its answers joined as ``answer``, no key or phrasing."""

    def __init__(self, s: ruler.RulerSample):
        self.s, self.answers = s, s.answers
        self.document, self.question, self.tokens, self.user_text = s.document, s.question, s.tokens, s.user_text
        self.answer, self.key, self.phrasing = "; ".join(s.answers), "", 0


def make_prompt(tokenizer, task: str, length: int, depth: float, seed: int, trial: int, filler: str):
    """The prompt of (task, length, depth, seed, trial, filler): a retrieval task's sample or a RULER one."""
    if task in TASKS:
        return make_sample(tokenizer, task, length, depth, seed, trial, filler)
    return RulerPrompt(ruler.make_ruler_sample(tokenizer, task, length, seed, trial))


def grade(task: str, reply: str, s) -> bool | float:
    """A retrieval task's exact match, or RULER's share of the answers found."""
    return score(task, reply, s.answer, s.key) if task in TASKS else ruler.score(reply, s.answers)


def max_new_tokens(task: str) -> int:
    return MAX_NEW_TOKENS[task] if task in TASKS else ruler.MAX_NEW_TOKENS[task]


def parse_list(text: str, kind=str) -> list:
    return [kind(x) for x in text.split(",") if x.strip()]


FILLER_GROUPS = {"tuning": TUNING_FILLERS, "held-out": HELD_OUT_FILLERS, "all": FILLERS}


def parse_fillers(text: str) -> list[str]:
    """Comma-separated filler kinds and groups -> kinds, in order, each once."""
    out: list[str] = []
    for name in parse_list(text):
        kinds = FILLER_GROUPS.get(name, (name,))
        for kind in kinds:
            if kind not in FILLERS:
                raise ValueError(f"--fillers: {name!r} is not a filler kind or group: one of "
                                 f"{', '.join((*FILLERS, *FILLER_GROUPS))}")
            if kind not in out:
                out.append(kind)
    return out


def config_name(path: str) -> str:
    return path if path in BUILTIN else Path(path).stem


def load_engine(model: str | None, config: str, task: str, max_len: int, threads: int, sets: list[str]):
    """One Engine for a config: greedy, room for the longest prompt and the reply.

    max_seq_len becomes exactly that (a smaller KV allocation than the model's context for short runs);
    at the model's full context the reply runs up to MAX_NEW_TOKENS positions past it."""
    new = max_new_tokens(task)
    overrides = [f"max_new_tokens={new}", "temperature=0", *sets]
    if threads:
        overrides.append(f"threads={threads}")
    cfg = load_config(None if config in BUILTIN else config, overrides)
    if cfg.max_seq_len == 0 or cfg.max_seq_len < max_len + new + 1:
        cfg = load_config(
            None if config in BUILTIN else config, [*overrides, f"max_seq_len={max_len + new + 1}"]
        )
    return ktquest.load(model, cfg)


def ask(session, s, task: str, fresh: bool):
    """One first chat turn about ``s.document``; greedy generation stops as soon as the answer is complete
    (``answer_complete``), so a chatty reply costs no extra decode steps.

    Unless ``fresh``, the session's cache keeps the previous trial's tokens and is rewound to the prefix
    this prompt shares with them (as a chat rewinds): trials of one length share the filler up to the
    earlier needle, so about half of the prompt tokens are not read again. The attention is the same."""
    text: list[str] = []
    done = [False]

    def on_text(piece: str) -> None:
        text.append(piece)
        reply = "".join(text)  # (RULER: every expected string found; more text cannot lose one)
        done[0] = answer_complete(task, reply, s.answer, s.key) if task in TASKS else grade(task, reply, s) == 1

    session.document = s.document
    session.reset(keep_cache=not fresh)
    return session.send(s.question, on_text=on_text, should_stop=lambda: done[0])


RUN_KEYS = ("task", "lengths", "depths", "trials", "fillers", "configs", "model", "seed", "set", "variant", "fresh")
RECORD_KEYS = {"config", "config_path", "length", "filler", "depth", "trial", "correct"}


def prompt_key(record: dict) -> tuple:
    """Which prompt of which config a record answers: (config path, length, filler, depth, trial)."""
    return record["config_path"], record["length"], record["filler"], record["depth"], record["trial"]


def run_identity(args) -> dict:
    """What a resumed run must share with the one it continues: the arguments that choose the prompts and how
    they are answered, and the bytes of each config file (a preset edited between sessions is another run)."""
    import hashlib

    ident = {k: getattr(args, k) for k in RUN_KEYS}
    for c in parse_list(args.configs):
        if c not in BUILTIN and os.path.isfile(c):
            ident[f"sha256 of {c}"] = hashlib.sha256(Path(c).read_bytes()).hexdigest()
    return ident


def read_partial(path: Path, args) -> list[list[dict]]:
    """The prompts a killed run answered, from its ``.partial`` file (one list of records a prompt): the
    run it continues must be this one (``run_identity``; ValueError naming the first difference); a last
    line cut short as the run was killed is dropped; any other line that is not a prompt's records is an error."""
    lines = path.read_text().splitlines()
    try:
        head = json.loads(lines[0]) if lines else None
    except json.JSONDecodeError:
        head = None
    if not isinstance(head, dict) or not isinstance(head.get("args"), dict):
        raise ValueError(f"{path}: not a partial eval_longctx run (no arguments on its first line)")
    ident = run_identity(args)
    for k in sorted(ident.keys() | head["args"].keys(), key=lambda k: (k not in RUN_KEYS, k)):
        if head["args"].get(k) != ident.get(k):
            what = f"--{k}" if k in RUN_KEYS else k
            raise ValueError(f"{path} was written with {what} {head['args'].get(k)!r}, not {ident.get(k)!r}")
    prompts, seen = [], set()
    for i, line in enumerate(lines[1:], 2):
        try:
            rows = json.loads(line)
        except json.JSONDecodeError:
            if i == len(lines):
                break  # the line the killed run was writing
            raise ValueError(f"{path}: line {i} is not JSON") from None
        if not (isinstance(rows, list) and rows and all(isinstance(r, dict) and RECORD_KEYS <= r.keys() for r in rows)):
            raise ValueError(f"{path}: line {i} is not a prompt's answers")
        key = prompt_key(rows[0])
        if key in seen:
            raise ValueError(f"{path}: line {i} answers a prompt answered before it (two runs wrote this file?)")
        seen.add(key)
        prompts.append(rows)
    return prompts


def start_partial(path: Path, args, prompts: list[list[dict]]) -> None:
    """(Re)write ``path`` atomically: the run's identity, then the prompts already answered."""
    rows = [{"args": run_identity(args)}, *prompts]
    write_atomic(path, "".join(json.dumps(r) + "\n" for r in rows))


def run(args, prior: list[list[dict]] = (), partial: Path | None = None) -> tuple[list[dict], list[dict], list[str]]:
    """Every config's answers -> (rows, trials, unfinished); ``prior``: prompts answered before (``--resume``),
    not asked again; each new prompt's records are appended to ``partial`` as one JSON line. ``unfinished``: the
    configs that answered some prompts before and cannot be loaded now (their run is not complete)."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    lengths, depths = parse_list(args.lengths, int), parse_list(args.depths, float)
    configs, fillers = parse_list(args.configs), parse_fillers(args.fillers)
    per_config = len(lengths) * len(fillers) * len(depths) * args.trials
    total = len(configs) * per_config
    trials: list[dict] = [r for rows in prior for r in rows]
    done = {prompt_key(rows[0]) for rows in prior}
    keys = [(n, f, d, t) for n in lengths for f in fillers for d in depths for t in range(args.trials)]
    samples: dict[tuple, object] = {}  # the prompts do not depend on the config: build them once
    unfinished: list[str] = []
    show = total > 1 and not args.quiet
    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeRemainingColumn(),
        TextColumn("{task.fields[info]}"),
        disable=not show,
        transient=True,
    ) as bar:
        job = bar.add_task(args.task, total=total, info="")
        for config in configs:
            todo = [k for k in keys if (config, *k) not in done]
            bar.advance(job, per_config - len(todo))
            if not todo:
                continue
            t0 = time.perf_counter()
            try:
                eng = load_engine(args.model, config, args.task, max(lengths), args.threads, args.set)
            except (ConfigError, OSError, ValueError) as e:
                print(f"skipping {config}: {e}", file=sys.stderr)
                bar.advance(job, len(todo))
                if len(todo) < per_config:
                    unfinished.append(config)
                continue
            load_s = time.perf_counter() - t0
            session = eng.chat_session()
            name = config_name(config)
            try:
                variants = load_variants(args, config, eng)
            except (ConfigError, ValueError) as e:
                print(f"skipping {config}: --variant: {e}", file=sys.stderr)
                bar.advance(job, len(todo))
                if len(todo) < per_config:
                    unfinished.append(config)
                del eng, session  # (its store freed before the next config's)
                continue
            bar.update(job, description=f"{args.task} {name}")
            for key in todo:
                if key not in samples:
                    samples[key] = make_prompt(eng.tokenizer, args.task, key[0], key[2], args.seed, key[3], key[1])
            # In token order: a prompt follows the one it shares the longest prefix with (prompts that share a
            # haystack differ from the needle on), so each re-prefills only what is new.
            order = sorted(todo, key=lambda k: (k[0], fillers.index(k[1]), samples[k].tokens)) if not args.fresh else todo
            for length, filler, depth, trial in order:
                s = samples[(length, filler, depth, trial)]
                answers = [(name, ask(session, s, args.task, args.fresh))]
                for vname, lc in variants:  # the same prompt, answered again on the same cache
                    base = eng.cache.retune(lc)
                    try:
                        answers.append((f"{name}+{vname}", ask(session, s, args.task, False)))
                    finally:
                        eng.cache.retune(base)
                for label, reply in answers:
                    record(trials, args, label, config, eng, s, (length, filler, depth, trial), reply, load_s)
                if partial is not None:
                    with partial.open("a") as f:
                        f.write(json.dumps(trials[-len(answers):]) + "\n")
                if args.verbose:
                    for (label, reply), rec in zip(answers, trials[-len(answers):]):
                        print(f"{label} {length} {filler} {depth:g} #{trial}: "
                              f"{'OK ' if rec['correct'] else 'BAD'} answer={s.answer!r} "
                              f"reply={reply.text!r}", flush=True)
                st = answers[0][1].stats
                bar.update(
                    job,
                    advance=1,
                    info=f"{length} tok, {filler}, depth {depth:g}: "
                    f"{st.prefill_tok_s:.0f} tok/s prefill, {'ok' if trials[-len(answers)]['correct'] else 'wrong'}",
                )
            del eng
    if args.save_misses:
        save_misses(args.save_misses, args.task, trials, samples)
    return aggregate(trials), trials, unfinished


def load_variants(args, config: str, eng) -> list[tuple[str, object]]:
    """``--variant`` as (name, LongContextConfig): the config's long_context with the variant's keys (checked
    as ``--set`` values are); none for a config that is not long_context."""
    if not args.variant or eng.config.mode != "long_context":
        return []
    return [variant_knobs(spec, None if config in BUILTIN else config, args.set, eng.cache) for spec in args.variant]


def record(trials: list[dict], args, label: str, config: str, eng, s, key: tuple, reply, load_s: float) -> None:
    length, filler, depth, trial = key
    st = reply.stats
    trials.append(
        {
            "task": args.task,
            "config": label,
            "config_path": config,
            "mode": eng.config.mode,
            "length": length,
            "filler": filler,
            "phrasing": s.phrasing,
            "depth": depth,
            "trial": trial,
            "prompt_tokens": len(s.tokens),
            "prefilled_tokens": st.prompt_tokens,
            "answer": s.answer,
            "reply": reply.text,
            "correct": grade(args.task, reply.text, s),
            "prefill_s": st.prefill_s,
            "decode_s": st.decode_s,
            "prefill_tok_s": st.prefill_tok_s,
            "decode_tok_s": st.decode_tok_s,
            "load_s": load_s,
        }
    )


def save_misses(folder: str, task: str, trials: list[dict], samples: dict) -> None:
    """The user message of every prompt some config answered wrong, as ``folder/<name>.txt`` (what
    ``tools/attention_recall.py --prompt-file`` reads), and ``folder/misses.json``: which configs missed it."""
    missed: dict[tuple, list[str]] = defaultdict(list)
    for t in trials:
        if not t["correct"]:
            missed[(t["length"], t["filler"], t["depth"], t["trial"])].append(t["config"])
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    index = []
    for key, configs in missed.items():
        name = f"{task}_{key[0]}_{key[1]}_d{key[2]:g}_t{key[3]}"
        (out / f"{name}.txt").write_text(samples[key].user_text, encoding="utf-8")
        index.append({"file": f"{name}.txt", "answer": samples[key].answer, "missed_by": configs})
    write_json(str(out / "misses.json"), index)


def aggregate(trials: list[dict]) -> list[dict]:
    """One row per (config, length, filler, depth): trials, correct, accuracy and mean times."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for t in trials:
        groups[(t["config"], t["length"], t["filler"], t["depth"])].append(t)
    rows = []
    for (config, length, filler, depth), ts in groups.items():
        n, c = len(ts), sum(t["correct"] for t in ts)
        rows.append(
            {
                "task": ts[0]["task"],
                "config": config,
                "mode": ts[0]["mode"],
                "length": length,
                "filler": filler,
                "held_out": filler in HELD_OUT_FILLERS,
                "depth": depth,
                "trials": n,
                "correct": c,
                "accuracy": c / n,
                "prompt_tokens": sum(t["prompt_tokens"] for t in ts) / n,
                "prefill_s": sum(t["prefill_s"] for t in ts) / n,
                "decode_s": sum(t["decode_s"] for t in ts) / n,
                "prefill_tok_s": sum(t["prefill_tok_s"] for t in ts) / n,
            }
        )
    return rows


def markdown(rows: list[dict]) -> str:
    """Accuracy per config x length (all fillers and depths); per config x filler kind (the held-out kinds
    marked, and their total); per config x depth; seconds per trial."""
    configs = list(dict.fromkeys(r["config"] for r in rows))
    lengths = sorted({r["length"] for r in rows})
    fillers = list(dict.fromkeys(r["filler"] for r in rows))
    depths = sorted({r["depth"] for r in rows})

    def acc(pred) -> str:
        sel = [r for r in rows if pred(r)]
        n, c = sum(r["trials"] for r in sel), sum(r["correct"] for r in sel)
        return f"{c / n:.2f} ({c:g}/{n})" if n else "-"  # (RULER's scores are shares: c a sum of them)

    def s_per_trial(config: str, length: int) -> str:
        sel = [r for r in rows if r["config"] == config and r["length"] == length]
        n = sum(r["trials"] for r in sel)
        return f"{sum((r['prefill_s'] + r['decode_s']) * r['trials'] for r in sel) / n:.1f}" if n else "-"

    out = [
        "| config | " + " | ".join(f"{n} tok" for n in lengths) + " | all |",
        "|---" * (len(lengths) + 2) + "|",
    ]
    for c in configs:
        cells = [acc(lambda r, c=c, n=n: r["config"] == c and r["length"] == n) for n in lengths]
        out.append(f"| {c} | " + " | ".join(cells) + f" | {acc(lambda r, c=c: r['config'] == c)} |")
    if fillers != ["classic"]:
        held = [f for f in fillers if f in HELD_OUT_FILLERS]
        names = [f"{f} (held out)" if f in held else f for f in fillers]
        out += [
            "",
            "| config | " + " | ".join(names) + (" | held out, all |" if held else " |"),
            "|---" * (len(fillers) + 1 + bool(held)) + "|",
        ]
        for c in configs:
            cells = [acc(lambda r, c=c, f=f: r["config"] == c and r["filler"] == f) for f in fillers]
            if held:
                cells.append(acc(lambda r, c=c: r["config"] == c and r["held_out"]))
            out.append(f"| {c} | " + " | ".join(cells) + " |")
    out += [
        "",
        "| config | " + " | ".join(f"depth {d:g}" for d in depths) + " |",
        "|---" * (len(depths) + 1) + "|",
    ]
    for c in configs:
        cells = [acc(lambda r, c=c, d=d: r["config"] == c and r["depth"] == d) for d in depths]
        out.append(f"| {c} | " + " | ".join(cells) + " |")
    out += [
        "",
        "| config | " + " | ".join(f"s/trial @{n}" for n in lengths) + " |",
        "|---" * (len(lengths) + 1) + "|",
    ]
    for c in configs:
        out.append(f"| {c} | " + " | ".join(s_per_trial(c, n) for n in lengths) + " |")
    return "\n".join(out)


def heatmap(rows: list[dict], path: str, title: str) -> None:
    """Depth (rows) x length (columns) accuracy over all fillers, one panel per config."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    configs = list(dict.fromkeys(r["config"] for r in rows))
    lengths = sorted({r["length"] for r in rows})
    depths = sorted({r["depth"] for r in rows})
    fig, axes = plt.subplots(
        1,
        len(configs),
        figsize=(1.2 + 0.9 * len(lengths) * len(configs) + 1.2 * len(configs), 1.2 + 0.35 * len(depths)),
        squeeze=False,
    )
    for ax, c in zip(axes[0], configs):
        correct, n = np.zeros((len(depths), len(lengths))), np.zeros((len(depths), len(lengths)))
        for r in rows:
            if r["config"] == c:
                at = depths.index(r["depth"]), lengths.index(r["length"])
                correct[at] += r["correct"]
                n[at] += r["trials"]
        grid = np.where(n > 0, correct / np.maximum(n, 1), np.nan)
        im = ax.imshow(grid, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
        for (i, j), v in np.ndenumerate(grid):
            if not np.isnan(v):
                ax.text(j, i, f"{v:.1f}", ha="center", va="center", fontsize=7)
        ax.set_xticks(range(len(lengths)), [str(n) for n in lengths])
        ax.set_yticks(range(len(depths)), [f"{d:g}" for d in depths])
        ax.set_xlabel("prompt tokens")
        ax.set_title(c)
    axes[0][0].set_ylabel("depth")
    fig.colorbar(im, ax=axes[0].tolist(), shrink=0.8, label="accuracy")
    fig.suptitle(title, y=1.02 + 0.15 / max(len(depths), 1))
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--task", choices=TASK_CHOICES, default="passkey")
    ap.add_argument("--lengths", default="2048,4096,8192", help="comma-separated prompt lengths, tokens")
    ap.add_argument(
        "--depths",
        default="0,0.1,0.2,0.3,0.4,0.5,0.6,0.7,0.8,0.9,1.0",
        help="comma-separated depths in [0, 1]",
    )
    ap.add_argument("--trials", type=int, default=3, help="prompts per (length, filler, depth)")
    ap.add_argument(
        "--fillers",
        default="classic",
        help="comma-separated filler kinds (classic, code, prose, narrative, json) or groups (tuning, "
        "held-out, all)",
    )
    ap.add_argument("--configs", default="dense", help="comma-separated YAML presets; 'dense' = defaults")
    ap.add_argument(
        "--model", default=None, help="GGUF path or bundled model name (default: the config's, else smollm2-135m)"
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=0, help="0 = the config's")
    ap.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="config override (all configs)"
    )
    ap.add_argument("--variant", action="append", default=[], metavar="NAME:KEY=VALUE[,KEY=VALUE]",
                    help="answer each prompt again under these decode-time long_context knobs (see above)")
    ap.add_argument("--json", default=None, help="write {meta, rows, trials} here")
    ap.add_argument("--png", default=None, help="write the depth x length heatmap here")
    ap.add_argument(
        "--fresh", action="store_true", help="prefill every prompt in full (default: reuse the shared prefix)"
    )
    ap.add_argument("--save-misses", default=None, metavar="DIR",
                    help="write the prompts some config missed here (for tools/attention_recall.py)")
    ap.add_argument("--resume", action="store_true",
                    help="with --json: keep the prompts a killed run with these arguments answered (JSON.partial)")
    ap.add_argument("--verbose", action="store_true", help="print every reply")
    ap.add_argument("--quiet", action="store_true", help="no progress bar")
    args = ap.parse_args(argv)
    if args.trials < 1:
        ap.error("--trials must be >= 1")
    try:
        fillers = parse_fillers(args.fillers)
    except ValueError as e:
        ap.error(str(e))
    if args.task == "kvretrieval" and fillers != ["classic"]:
        ap.error("--fillers: kvretrieval has only its own JSON haystack (classic)")
    if args.task in ruler.RULER_TASKS:
        if args.fillers != ap.get_default("fillers") or args.depths != ap.get_default("depths"):
            ap.error(f"--fillers and --depths: {args.task}'s haystack and needle depths are part of the task")
        args.depths = "0"  # one prompt a length and trial: the task draws its needles' depths

    if args.resume and not args.json:
        ap.error("--resume needs --json (the run's answers so far are in JSON.partial)")
    if args.resume and args.save_misses:
        ap.error("--save-misses cannot be combined with --resume (a resumed prompt's text is not rebuilt)")
    prior, partial = [], None
    if args.json:
        partial = Path(f"{args.json}.partial")
        if partial.exists() and not args.resume:
            print(f"{partial} holds the answers of a run that did not finish: --resume continues it, or delete "
                  "the file", file=sys.stderr)
            return 1
        if args.resume and partial.exists():
            try:
                prior = read_partial(partial, args)
            except (OSError, ValueError) as e:
                print(f"--resume: {e}", file=sys.stderr)
                return 1
            print(f"resuming: {sum(map(len, prior))} answers of {len(prior)} prompts from {partial}", file=sys.stderr)
        start_partial(partial, args, prior)

    t0 = time.perf_counter()
    rows, trials, unfinished = run(args, prior, partial)
    wall = time.perf_counter() - t0
    if unfinished:
        print(f"{', '.join(unfinished)}: answered part of the prompts before and could not be loaded now: "
              f"the run is not complete, its answers stay in {partial}", file=sys.stderr)
        return 1
    if not rows:
        print("no config could be run", file=sys.stderr)
        return 1
    n_tok = sum(t["prompt_tokens"] for t in trials)
    n_read = sum(t["prefilled_tokens"] for t in trials)
    compute = sum(t["prefill_s"] + t["decode_s"] for t in trials)
    print(f"## {args.task}: accuracy (seed {args.seed}, {args.trials} trial(s) per length, filler and depth)\n")
    print(markdown(rows))
    print(
        f"\n{len(trials)} trials, {n_tok} prompt tokens ({n_read} prefilled, the rest a reused prefix) in "
        f"{wall:.1f} s wall ({compute:.1f} s prefill + decode, {n_read / max(compute, 1e-9):.0f} prefilled prompt "
        f"tok/s overall, {compute / len(trials):.1f} s per trial)"
    )
    meta = {
        "task": args.task,
        "lengths": parse_list(args.lengths, int),
        "depths": parse_list(args.depths, float),
        "fillers": fillers,
        "held_out_fillers": [f for f in fillers if f in HELD_OUT_FILLERS],
        "trials": args.trials,
        "configs": parse_list(args.configs),
        "model": args.model,
        "seed": args.seed,
        "sets": args.set,
        "variants": args.variant,
        "fresh": args.fresh,
        "resumed_trials": sum(map(len, prior)),
        "wall_s": wall,
        "compute_s": compute,
        "prompt_tokens": n_tok,
        "argv": sys.argv[1:],
    }
    if args.json:
        write_json(args.json, {"meta": meta, "rows": rows, "trials": trials})
        partial.unlink(missing_ok=True)
    if args.png:
        heatmap(rows, args.png, f"{args.task} accuracy (seed {args.seed}, {args.trials} trials per cell)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
