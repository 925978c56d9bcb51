"""Smoke runs of tools/eval_longctx.py and tools/attention_recall.py, and the recall measurement's contracts.

The smoke runs use the bundled SmolLM2 at a few hundred tokens (seconds); the contracts run the recall
measurement on random keys and queries recorded through the cache wrapper (no model).
"""

from __future__ import annotations

import collections
import importlib.util
import json
import math
from pathlib import Path

import pytest
import torch

from ktquest.config import LongContextConfig, load_config
from ktquest.kv.dense import DenseKVCache

TOOLS = Path(__file__).resolve().parent.parent / "tools"


def _tool(name: str):
    spec = importlib.util.spec_from_file_location(f"tool_{name}", TOOLS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def recall_tool():
    return _tool("attention_recall")


# ---- the recall measurement on random tensors ----


def _recorded(recall_tool, n=300, L=2, H=4, KVH=2, D=16, W=3, seed=0):
    """A RecordingCache after a chunked 'prefill' of random q/k/v through it."""
    g = torch.Generator().manual_seed(seed)
    rec = recall_tool.RecordingCache(DenseKVCache(L, KVH, D, n), record_from=n - W)
    for start in range(0, n, 128):
        t = min(128, n - start)
        for layer in range(L):
            q = torch.randn(t, H, D, generator=g) * 2
            k = torch.randn(t, KVH, D, generator=g) * 2
            v = torch.randn(t, KVH, D, generator=g)
            out = rec.attend(layer, q, k, v, start)
            assert out.shape == (t, H, D)
    assert rec.pos == n and rec.query(0).shape == (W, H, D)
    return rec


@pytest.mark.parametrize("mode", ["SEPARATE", "SHARED"])
def test_recall_contracts(recall_tool, mode):
    n = 300
    rec = _recorded(recall_tool, n=n)
    lc = LongContextConfig(block_size=16, init_windows_len=16, local_windows_len=40, head_select_mode=mode)
    b0, b1 = recall_tool.candidate_range(n, 16, 16, 40)
    assert (b0, b1) == (1, 16)  # init: block 0; local: from 16 * 16 = 256 <= 300 - 40 on
    anchors = ["QUEST", "BLOCK_MEAN", "FIXED", "DYNAMIC"]
    # A budget covering every candidate block: sparse attention sees everything, recall 1.
    rows, quest = recall_tool.measure(rec, n, lc, b1 - b0, 4, 1, anchors)
    assert len(rows) == 2 * 4 * len(anchors) and len(quest) == 2 * 4
    for r in rows:
        assert r["recall"] == pytest.approx(1, abs=1e-5) and r["ctx_recall"] == pytest.approx(1, abs=1e-5)
        assert r["oracle"] == pytest.approx(1, abs=1e-5)
    for r in quest:  # the QUEST bound is an upper bound of the true block maximum
        assert r["quest_gap"] >= 0 and r["quest_gap_max"] >= r["quest_gap"] and r["quest_topk_overlap"] == 1
    # No budget: only the windows.
    rows, _ = recall_tool.measure(rec, n, lc, 0, 4, 1, anchors)
    for r in rows:
        assert r["recall"] == pytest.approx(r["window_mass"], abs=1e-6) and r["ctx_recall"] == 0
    # A partial budget: between the two, never above 1; the oracle is the best for the group.
    rows, _ = recall_tool.measure(rec, n, lc, 4, 4, 1, anchors)
    for r in rows:
        assert r["window_mass"] - 1e-6 <= r["recall"] <= 1 + 1e-6 and 0 <= r["ctx_recall"] <= 1 + 1e-6
    for a in anchors:
        sel = [r for r in rows if r["anchor"] == a]
        assert sum(r["recall"] for r in sel) <= sum(r["oracle"] for r in sel) + 1e-6


def test_recall_matches_a_direct_computation(recall_tool):
    """QUEST recall of one query head recomputed from the selected blocks by hand."""
    n, bs = 200, 16
    rec = _recorded(recall_tool, n=n, L=1, W=1, seed=1)
    lc = LongContextConfig(block_size=bs, init_windows_len=16, local_windows_len=32, second_select_num=3)
    rows, _ = recall_tool.measure(rec, n, lc, 3, 4, 1, ["QUEST"])
    from ktquest.native.store import KVStore

    k, v = (t[:, :n] for t in rec.inner.layer_kv(0))  # [KVH, n, D]
    q = rec.query(0)[0]  # [H, D]
    store = KVStore(1, 2, 16, n, block_size=bs, kv_type="FP32", anchor_type="QUEST", anchor_num=2)
    store.append(0, k.transpose(0, 1).contiguous(), v.transpose(0, 1).contiguous())
    b0, b1 = recall_tool.candidate_range(n, bs, 16, 32)
    ids = store.select(0, q, 3, exclude_ranges=[(0, b0), (b1, math.ceil(n / bs))])
    for h in range(4):
        p = torch.softmax(q[h] @ k[h // 2].T / 4.0, -1)  # D = 16
        seen = torch.zeros(n, dtype=torch.bool)
        seen[: b0 * bs] = seen[b1 * bs :] = True
        for b in ids[h // 2].tolist():
            seen[b * bs : (b + 1) * bs] = True
        assert rows[h]["recall"] == pytest.approx(p[seen].sum().item(), abs=1e-5)


# ---- smoke runs with the bundled model ----


@pytest.mark.slow
def test_eval_longctx_smoke(bundled_gguf, tmp_path, capsys):
    tool = _tool("eval_longctx")
    out_json, out_png = tmp_path / "e.json", tmp_path / "e.png"
    rc = tool.main(["--task", "passkey", "--lengths", "320", "--depths", "0.5", "--trials", "1", "--seed", "1",
                    "--configs", f"dense,{tmp_path / 'missing.yaml'}", "--model", str(bundled_gguf),
                    "--json", str(out_json), "--png", str(out_png), "--quiet"])  # fmt: skip
    assert rc == 0
    out = capsys.readouterr()
    assert "| dense | 1.00 (1/1) | 1.00 (1/1) |" in out.out  # the bundled model finds the pass key
    assert "skipping" in out.err and "missing.yaml" in out.err  # a config that does not load is skipped
    assert "prompt tok/s" in out.out and "s per trial" in out.out
    data = json.loads(out_json.read_text())
    (row,) = data["rows"]
    assert {"task", "config", "length", "depth", "trials", "correct", "accuracy"} <= row.keys()
    assert (row["task"], row["config"], row["length"], row["depth"], row["trials"]) == ("passkey", "dense", 320, 0.5, 1)
    (trial,) = data["trials"]
    assert 320 - 16 <= trial["prompt_tokens"] <= 320 and trial["answer"] in trial["reply"]
    assert out_png.stat().st_size > 1000


def test_eval_longctx_runs_ruler_tasks(tiny_models, tmp_path, capsys):
    """A RULER task through the tool: one prompt a length and trial (its depths are the task's: --depths and
    --fillers refused), each trial's ``correct`` RULER's share of the expected strings in the reply."""
    tool = _tool("eval_longctx")
    out_json = tmp_path / "r.json"
    rc = tool.main(["--task", "niah_multiquery", "--lengths", "600", "--trials", "2", "--configs", "dense",
                    "--model", str(tiny_models("llama").path), "--json", str(out_json), "--quiet"])  # fmt: skip
    assert rc == 0
    data = json.loads(out_json.read_text())
    assert [t["depth"] for t in data["trials"]] == [0.0, 0.0] and len(data["rows"]) == 1
    assert all(0 <= t["correct"] <= 1 and len(t["answer"].split("; ")) == 4 for t in data["trials"])
    assert all(t["correct"] == sum(a in t["reply"].lower() for a in t["answer"].split("; ")) / 4
               for t in data["trials"])
    assert "| dense |" in capsys.readouterr().out
    for bad in (["--depths", "0.5"], ["--fillers", "prose"]):
        with pytest.raises(SystemExit):
            tool.main(["--task", "vt", *bad])
        assert "part of the task" in capsys.readouterr().err


def test_eval_longctx_fillers(capsys):
    tool = _tool("eval_longctx")
    assert tool.parse_fillers("held-out,code,prose") == ["prose", "narrative", "json", "code"]
    assert tool.parse_fillers("tuning") == ["classic", "code"] and len(tool.parse_fillers("all")) == 5
    with pytest.raises(ValueError, match="'poetry' is not a filler kind"):
        tool.parse_fillers("prose,poetry")
    for bad in (["--fillers", "poetry"], ["--task", "kvretrieval", "--fillers", "prose"]):
        with pytest.raises(SystemExit):
            tool.main(bad)
        assert "--fillers" in capsys.readouterr().err


def test_context_tokens_kinds(bundled_gguf):
    from ktquest.formats.tokenizer import Tokenizer
    from ktquest.models.loader import read_gguf

    common = _tool("common")
    tok = Tokenizer.from_gguf_metadata(read_gguf(bundled_gguf).metadata)
    texts = {k: common.context_tokens(tok, 700, k) for k in common.TEXT_KINDS}
    assert all(len(ids) == 700 for ids in texts.values())
    assert texts["stdlib"] == common.context_tokens(tok, 700)  # the default: the presets' tuning text
    assert common.context_tokens(tok, 700, "prose") == texts["prose"]  # a fixed draw
    assert len({tuple(ids[:50]) for ids in texts.values()}) == len(common.TEXT_KINDS)
    assert "stdlib" not in common.HELD_OUT_TEXTS and set(common.HELD_OUT_TEXTS) < set(common.TEXT_KINDS)
    with pytest.raises(ValueError, match="text kind 'poetry'"):
        common.context_tokens(tok, 10, "poetry")


def test_eval_longctx_save_misses(tmp_path):
    tool = _tool("eval_longctx")
    Sample = collections.namedtuple("Sample", "user_text answer")
    samples = {(400, "prose", 0.5, 0): Sample("doc A\n\nq?", "123456"), (400, "json", 0.5, 1): Sample("B", "7")}
    trials = [{"length": 400, "filler": "prose", "depth": 0.5, "trial": 0, "config": c, "correct": ok}
              for c, ok in (("dense", True), ("quest", False), ("snapkv", False))]
    trials.append({"length": 400, "filler": "json", "depth": 0.5, "trial": 1, "config": "dense", "correct": True})
    tool.save_misses(str(tmp_path / "m"), "passkey", trials, samples)
    assert (tmp_path / "m" / "passkey_400_prose_d0.5_t0.txt").read_text() == "doc A\n\nq?"
    assert json.loads((tmp_path / "m" / "misses.json").read_text()) == [
        {"file": "passkey_400_prose_d0.5_t0.txt", "answer": "123456", "missed_by": ["quest", "snapkv"]}]
    assert sorted(p.name for p in (tmp_path / "m").iterdir()) == ["misses.json", "passkey_400_prose_d0.5_t0.txt"]


@pytest.mark.slow
def test_eval_longctx_held_out_smoke(bundled_gguf, tmp_path, capsys):
    """Two filler kinds: one row per filler, the per-filler table with the held-out kind marked, and the
    two depths of a trial sharing their haystack (the second prompt re-reads only what follows its needle)."""
    tool = _tool("eval_longctx")
    out_json = tmp_path / "e.json"
    rc = tool.main(["--task", "needle", "--lengths", "400", "--depths", "0.2,0.8", "--trials", "1",
                    "--fillers", "narrative,code", "--model", str(bundled_gguf), "--json", str(out_json),
                    "--quiet"])  # fmt: skip
    assert rc == 0
    out = capsys.readouterr().out
    assert "| config | narrative (held out) | code | held out, all |" in out
    data = json.loads(out_json.read_text())
    assert data["meta"]["fillers"] == ["narrative", "code"] and data["meta"]["held_out_fillers"] == ["narrative"]
    assert sorted((r["filler"], r["depth"], r["held_out"]) for r in data["rows"]) == [
        ("code", 0.2, False), ("code", 0.8, False), ("narrative", 0.2, True), ("narrative", 0.8, True)]
    for filler in ("narrative", "code"):  # one haystack, two needles: the second prompt re-reads its tail
        first, second = (t for t in data["trials"] if t["filler"] == filler)
        assert first["phrasing"] >= 1 and first["prefilled_tokens"] > 0.9 * first["prompt_tokens"]
        assert second["prefilled_tokens"] < 0.9 * second["prompt_tokens"]


@pytest.mark.slow
def test_eval_longctx_resumes_a_killed_run(bundled_gguf, tmp_path, monkeypatch, capsys):
    """A run killed before its JSON leaves JSON.partial, a prompt a line (its answers under every label);
    --resume keeps those answers (not asked again), drops a line cut short, asks the rest, writes the JSON and
    removes the partial file. A partial file of another run (arguments, a config's bytes) or a bad line is
    refused naming it, and a run without --resume does not overwrite one."""
    tool = _tool("eval_longctx")
    quest = tmp_path / "quest.yaml"
    quest.write_text((Path(__file__).resolve().parent.parent / "configs" / "quest.yaml").read_text())
    out, part = tmp_path / "e.json", tmp_path / "e.json.partial"
    args = ["--task", "passkey", "--lengths", "320", "--depths", "0.2,0.8", "--trials", "1", "--seed", "1",
            "--configs", f"dense,{quest}", "--set", "long_context.local_windows_len=64",
            "--variant", "s8:sticky_blocks=8", "--model", str(bundled_gguf),
            "--json", str(out), "--quiet"]  # fmt: skip
    assert tool.main(args) == 0
    full = json.loads(out.read_text())["trials"]
    assert [t["config"] for t in full] == ["dense"] * 2 + ["quest", "quest+s8"] * 2 and not part.exists()
    assert full[0]["depth"] != full[1]["depth"] and full[0]["reply"] != full[1]["reply"]

    def killed(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(tool, "write_json", killed)
    with pytest.raises(KeyboardInterrupt):
        tool.main(args)
    monkeypatch.undo()
    head, *lines = part.read_text().splitlines()
    assert [len(json.loads(x)) for x in lines] == [1, 1, 2, 2]  # quest's lines: its answer and the variant's
    kept = [json.loads(x) for x in lines[:3]]
    for rows in kept:  # markers: these prompts must not be asked again
        for r in rows:
            r["reply"] = f"kept {r['config']} {r['depth']}"
    torn = lines[3][: len(lines[3]) // 2]
    part.write_text("".join(json.dumps(x) + "\n" for x in [json.loads(head), *kept]) + torn)
    assert tool.main([*args, "--resume"]) == 0
    got = json.loads(out.read_text())
    assert [(t["config"], t["depth"]) for t in got["trials"]] == [(t["config"], t["depth"]) for t in full]
    assert [t["reply"] for t in got["trials"]] == [
        *(f"kept {t['config']} {t['depth']}" for t in full[:4]), full[4]["reply"], full[5]["reply"]]
    assert got["meta"]["resumed_trials"] == 4 and not part.exists()

    def refused(argv, message):
        capsys.readouterr()
        assert tool.main(argv) == 1
        assert message in capsys.readouterr().err

    part.write_text(f"{head}\n")
    other = [*args, "--resume"]
    other[other.index("--seed") + 1] = "2"
    refused(other, "was written with --seed 1, not 2")
    refused(args, "e.json.partial holds the answers of a run that did not finish: --resume continues it")
    part.write_text(f"{head}\nnot json\n{lines[0]}\n")
    refused([*args, "--resume"], "line 2 is not JSON")
    part.write_text(f"{head}\n[1]\n")
    refused([*args, "--resume"], "line 2 is not a prompt's answers")
    part.write_text(f"{head}\n{lines[0]}\n{lines[0]}\n")
    refused([*args, "--resume"], "line 3 answers a prompt answered before it")
    part.write_text("5\n")
    refused([*args, "--resume"], "not a partial eval_longctx run")
    part.write_text(f"{head}\n")
    quest.write_text(quest.read_text() + "\n# edited\n")
    refused([*args, "--resume"], f"was written with sha256 of {quest}")
    for extra, message in ((["--save-misses", str(tmp_path / "m")], "--save-misses cannot be combined"),
                           ([], "--resume needs --json")):
        with pytest.raises(SystemExit):
            tool.main([*(args[:-3] if not extra else args), "--quiet", "--resume", *extra])
        assert message in capsys.readouterr().err


@pytest.mark.slow
def test_eval_longctx_variants_answer_as_loaded_configs(bundled_gguf, tmp_path, capsys):
    """--variant answers each prompt again on the same cache under decode-time knobs: with the knobs the
    config already has, the same replies; with others, the replies of the config loaded with them (read in
    full), while reading one token a variant. A knob the prompt was read with is refused, naming it."""
    tool = _tool("eval_longctx")
    quest = str(Path(__file__).resolve().parent.parent / "configs" / "quest.yaml")
    common = ["--task", "passkey", "--lengths", "1100", "--depths", "0.2,0.4", "--trials", "1", "--seed", "2",
              "--fillers", "prose", "--model", str(bundled_gguf), "--threads", "2", "--quiet"]

    def trials(*extra):
        out_json = tmp_path / f"v{len(list(tmp_path.iterdir()))}.json"
        assert tool.main([*common, *extra, "--json", str(out_json)]) == 0
        return json.loads(out_json.read_text())["trials"]

    shipped = load_config(quest).long_context.sticky_blocks
    got = trials("--configs", quest, "--variant", f"same:sticky_blocks={shipped}",
                 "--variant", "s4:sticky_blocks=4,second_select_num=24",
                 "--variant", "blind:second_select_num=0,dense_layer_num=0")
    by = collections.defaultdict(list)
    for t in got:
        by[t["config"]].append(t)
    assert sorted(by) == ["quest", "quest+blind", "quest+s4", "quest+same"] and all(len(v) == 2 for v in by.values())
    assert [t["reply"] for t in by["quest+same"]] == [t["reply"] for t in by["quest"]]
    assert all(t["prefilled_tokens"] == 1 for t in by["quest+s4"] + by["quest+same"] + by["quest+blind"])
    # the pass key lies before the local window: quest finds it, with no context block attended none can
    assert all(t["correct"] for t in by["quest"]) and not any(t["correct"] for t in by["quest+blind"])
    loaded = trials("--configs", quest, "--set", "long_context.sticky_blocks=4",
                    "--set", "long_context.second_select_num=24")
    assert [t["reply"] for t in loaded] == [t["reply"] for t in by["quest+s4"]]
    capsys.readouterr()
    assert tool.main([*common, "--configs", quest, "--variant", "b:block_size=16"]) == 1
    assert "long_context.block_size is not a decode-time knob" in capsys.readouterr().err
    assert tool.main([*common, "--configs", quest, "--variant", "t:prefill.exact_tail=0"]) == 1
    assert "prefill.exact_tail is not a long_context key" in capsys.readouterr().err


@pytest.mark.slow
def test_attention_recall_smoke(recall_tool, bundled_gguf, tmp_path, capsys):
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("The grass is green. The sky is blue. " * 40 + "The pass key is 4242. What is the pass key?")
    out_json, out_png = tmp_path / "r.json", tmp_path / "r.png"
    rc = recall_tool.main(["--prompt-file", str(prompt), "--model", str(bundled_gguf), "--budget", "2",
                           "--queries", "2", "--anchors", "QUEST,BLOCK_MAX", "--set", "long_context.block_size=32",
                           "--set", "long_context.local_windows_len=64", "--set", "long_context.dense_layer_num=2",
                           "--json", str(out_json), "--png", str(out_png), "--quiet"])  # fmt: skip
    assert rc == 0
    out = capsys.readouterr().out
    assert "| QUEST |" in out and "| 1* |" in out and "| 2 |" in out and "tok/s" in out
    data = json.loads(out_json.read_text())
    assert data["meta"]["budget"] == 2 and data["meta"]["prompt_tokens"] > 300
    assert len(data["rows"]) == 30 * 9 * 2 and len(data["quest"]) == 30 * 9
    assert all(0 <= r["recall"] <= 1 + 1e-5 for r in data["rows"])
    assert out_png.stat().st_size > 1000


def test_fidelity_budget_sets(tmp_path):
    """--budget sets the picks; SnapKV's candidates keep the preset's ratio to them."""
    tool = _tool("fidelity")
    assert tool.budget_sets("configs/quest.yaml", 4096) == ["second_select_num=512"]
    assert tool.budget_sets("configs/snapkv.yaml", 1024) == ["second_select_num=128", "preselect_block_count=384"]
    assert tool.budget_sets("configs/snapkv.yaml", 2048) == ["second_select_num=256", "preselect_block_count=768"]
    assert tool.budget_sets("configs/ada_snapkv.yaml", 1024) == ["second_select_num=128", "preselect_block_count=384"]
    assert tool.budget_sets("configs/ktransformers.yaml", 1024) == ["second_select_num=128", "preselect_block_count=512"]
    plain = tmp_path / "plain_snapkv.yaml"  # keeps exactly what it attends: both follow the budget
    plain.write_text("mode: long_context\nlong_context:\n  block_size: 32\n  preselect_block: true\n"
                     "  preselect_block_count: 32\n  second_select_num: 32\n")
    assert tool.budget_sets(str(plain), 2048) == ["second_select_num=64", "preselect_block_count=64"]
    few = tmp_path / "few.yaml"  # fewer candidates than the budget's picks: every candidate is a pick
    few.write_text("mode: long_context\nlong_context:\n  block_size: 8\n  preselect_block: true\n"
                   "  preselect_block_count: 8\n  second_select_num: 16\n")
    assert tool.budget_sets(str(few), 1024) == ["second_select_num=128", "preselect_block_count=128"]


@pytest.mark.slow
def test_fidelity_smoke(bundled_gguf, tmp_path, capsys):
    tool = _tool("fidelity")
    out_json = tmp_path / "f.json"
    # quest with a budget that covers every block: the same attention as dense up to FP16 storage
    rc = tool.main(["--model", str(bundled_gguf), "--length", "400", "--positions", "8", "--budget", "4096",
                    "--configs", "configs/quest.yaml", "--set", "long_context.local_windows_len=64",
                    "--variant", "one:second_select_num=1,dense_layer_num=0", "--variant", "bs:block_size=16",
                    "--threads", "2", "--json", str(out_json)])  # fmt: skip
    assert rc == 0
    out, err = capsys.readouterr()
    assert "skipping --variant bs:block_size=16 for configs/quest.yaml: long_context.block_size is not a " \
           "decode-time knob" in err
    assert "| dense | all | 1.000 | 0.0000 |" in out and "| quest | 512 x 8 |" in out and "| quest+one | 1 x 8 |" in out
    dense, quest, one = json.loads(out_json.read_text())
    assert (dense["config"], dense["top1_agreement"], dense["kl_mean"]) == ("dense", 1.0, 0.0)
    assert quest["top1_agreement"] == 1.0 and 0 <= quest["kl_mean"] < 1e-3 and quest["positions"] == 8
    # the variant on the same prompt: one 8-token block a step instead of all, in every layer
    assert one["config"] == "quest+one" and one["kl_mean"] > 10 * quest["kl_mean"]
    assert {"config", "budget", "top1_agreement", "kl_mean", "kl_max", "top1_accuracy", "nll", "decode_tok_s",
            "length"} <= quest.keys()


@pytest.mark.slow
def test_fidelity_generated_drift(bundled_gguf, tmp_path, capsys):
    """--generate: the steps are dense's own greedy reply (dense's top-1 accuracy on it is 1 by construction),
    agreement reported per --window steps; a budget covering every block agrees in every window."""
    tool = _tool("fidelity")
    out_json = tmp_path / "g.json"
    rc = tool.main(["--model", str(bundled_gguf), "--length", "330", "--positions", "30", "--budget", "4096",
                    "--generate", "--window", "10", "--configs", "configs/quest.yaml",
                    "--set", "long_context.local_windows_len=64", "--threads", "2", "--json", str(out_json)])  # fmt: skip
    assert rc == 0
    dense, quest = json.loads(out_json.read_text())
    assert dense["generated"] and dense["top1_accuracy"] == 1.0 and dense["agreement_by_window"] == [1.0] * 3
    assert quest["agreement_by_window"] == [1.0] * 3 and quest["top1_accuracy"] == 1.0
    assert "top-1 agreement per 10 steps (the drift over the reply)" in capsys.readouterr().out


@pytest.mark.slow
def test_eval_multiturn_smoke(bundled_gguf, tmp_path, capsys):
    """One 2-turn conversation over a 1K document, dense and quest: a record per turn, the table per turn."""
    tool = _tool("eval_multiturn")
    out_json = tmp_path / "m.json"
    rc = tool.main(["--model", str(bundled_gguf), "--lengths", "1024", "--turns", "2", "--trials", "1",
                    "--configs", "dense,configs/quest.yaml", "--threads", "2", "--json", str(out_json)])  # fmt: skip
    assert rc == 0
    rows = json.loads(out_json.read_text())
    assert [(r["config"], r["turn"]) for r in rows] == [("dense", 0), ("dense", 1), ("quest", 0), ("quest", 1)]
    assert all(isinstance(r["correct"], bool) for r in rows)
    out = capsys.readouterr().out
    assert "| config | length | turn 1 | turn 2 | all |" in out and "| quest | 1024 |" in out


@pytest.mark.slow
def test_bench_decode_takes_preset_names(bundled_gguf, tmp_path, capsys):
    tool = _tool("bench_decode")
    out_json = tmp_path / "b.json"
    rc = tool.main(["--model", str(bundled_gguf), "--contexts", "600,700", "--modes", "snapkv", "--peer", "none",
                    "--threads", "1", "--decode-tokens", "2", "--rounds", "3", "--json", str(out_json)])  # fmt: skip
    assert rc == 0
    rows = json.loads(out_json.read_text())
    assert [(r["label"], r["mode"], r["context"]) for r in rows] == [("snapkv", "long_context", 600),
                                                                     ("snapkv", "long_context", 700)]
    assert rows[0]["config"].endswith("configs/snapkv.yaml")
    for r in rows:  # three rounds per cell; the reported speed is their median
        assert len(r["decode_rounds_tok_s"]) == 3 and r["decode_tok_s"] == sorted(r["decode_rounds_tok_s"])[1]
        assert r["first_token_s"] > 0  # the first token after the prompt (SnapKV's preselection), timed apart
    out = capsys.readouterr().out
    assert "round 3/3" in out and "snapkv: decode at 700 is" in out and "first token" in out
    with pytest.raises(SystemExit):  # argparse error: names the known modes and presets
        tool.main(["--model", str(bundled_gguf), "--modes", "nosuchpreset", "--peer", "none"])
    assert "nosuchpreset" in capsys.readouterr().err


@pytest.mark.slow
def test_bench_decode_selection_views(bundled_gguf, tmp_path, capsys):
    """--selection-views: on a store with an index, two more rows decode on the runner's caches with SnapKV's
    candidate lists set aside, through the index and by the flat scan; the runner gets its lists back."""
    tool = _tool("bench_decode")
    sets = ["long_context.local_windows_len=64", "long_context.preselect_block_count=8",
            "long_context.second_select_num=4", "long_context.index_group=2"]
    out_json = tmp_path / "b.json"
    argv = ["--model", str(bundled_gguf), "--contexts", "700", "--modes", "snapkv", "--peer", "none", "--threads",
            "1", "--decode-tokens", "2", "--rounds", "2", "--selection-views", "--json", str(out_json)]
    assert tool.main(argv + [x for kv in sets for x in ("--set", kv)]) == 0
    rows = json.loads(out_json.read_text())
    assert [r["label"] for r in rows] == ["snapkv", "snapkv/all-blocks-index", "snapkv/all-blocks-flat"]
    assert all(len(r["decode_rounds_tok_s"]) == 2 and r["prefill_s"] == rows[0]["prefill_s"] for r in rows)
    n_layers = 30  # SmolLM2; 8 recorded queries each
    assert rows[1]["picks_compared"] == n_layers * 8 and rows[1]["picks_differing"] == 0
    assert rows[1]["picks_index_walked"] == n_layers * 8  # the index pruned: a comparison, not two flat scans
    assert "decode through the index is" in capsys.readouterr().out
    # a max_seq_len the rounds would overrun (the runner's and its views' tokens after the context): refused first
    with pytest.raises(SystemExit):
        tool.main(argv + [x for kv in [*sets, "max_seq_len=712"] for x in ("--set", kv)])
    assert "max_seq_len=712 leaves 12 positions after the 700-token context; the run decodes 13" in capsys.readouterr().err

    r = tool.KtquestRunner(bundled_gguf, "snapkv", "long_context", str(TOOLS.parent / "configs/snapkv.yaml"), 720, 1,
                           0, sets)
    r.prefill(700)
    cache = r.state[700][0]
    lists = list(cache.planner.allowed)
    assert sum(a is not None for a in lists) > 0  # the warm-up step preselected
    seen = []
    real_decode = r.decode

    def spy(ctx, n):  # what a view's selection sees
        seen.append(list(cache.planner.allowed))
        out = real_decode(ctx, n)
        seen.append(cache.store.last_index_stats()["groups"])
        return out

    r.decode = spy
    for walk in (True, False):
        tool.SelectionView(r, walk).decode(700, 1)
        assert [a is lists[i] for i, a in enumerate(cache.planner.allowed)] == [True] * len(lists)  # restored
    assert seen[0] == [None] * len(lists) and seen[2] == [None] * len(lists)
    assert seen[1] > 0 and seen[3] == 0  # the index walked, then the flat scan (no group bounds)
    r.decode(700, 1)  # the runner's own selection: its candidate lists, planned anew
    assert all(a is b for a, b in zip(seen[4], lists)) and cache.planner._token_steps.lb > 0
    # picks that differ are counted: the flat scan's stand-in returns other blocks
    real_select = cache.store.select
    walking = []
    cache.store.set_walk_index = walking.append
    cache.store.select = lambda layer, q, k, **kw: real_select(layer, q, k, **kw) + (0 if walking[-1] else 1)
    n, differ, _ = tool.SelectionView(r, True).same_picks(700, 2)
    assert n == differ == 2 * r.eng.model.args.n_layers


@pytest.mark.slow
def test_profile_decode_smoke(bundled_gguf, tmp_path, capsys):
    tool = _tool("profile_decode")
    # quest with a local window small enough that a 300-token prompt has context blocks to select from
    rc = tool.main(["--model", str(bundled_gguf), "--config", str(TOOLS.parent / "configs/quest.yaml"),
                    "--set", "long_context.local_windows_len=64", "--context", "300", "--tokens", "2",
                    "--threads", "1"])  # fmt: skip
    assert rc == 0
    out = capsys.readouterr().out
    assert "tok/s" in out and "attention, dense layers" in out and "attention, sparse layers" in out
    assert "store score in the sparse layers" in out and "store attend in the sparse layers" in out


@pytest.mark.slow
def test_bench_memory_smoke(bundled_gguf, tmp_path, capsys):
    tool = _tool("bench_memory")
    out_json = tmp_path / "m.json"
    rc = tool.main(["--model", str(bundled_gguf), "--contexts", "600,900", "--modes", "dense,snapkv",
                    "--threads", "1", "--json", str(out_json)])  # fmt: skip
    assert rc == 0
    rows = {(r["label"], r["context"]): r for r in json.loads(out_json.read_text())}
    assert set(rows) == {("dense", 600), ("dense", 900), ("snapkv", 600), ("snapkv", 900)}
    lc, dense = (rows["snapkv", 600], rows["snapkv", 900]), (rows["dense", 600], rows["dense", 900])
    # the windows are fixed; the store grows with the prompt; dense holds max_seq_len (context + 64) tokens
    assert lc[0]["kv_device_bytes"] == lc[1]["kv_device_bytes"] > 0
    assert 0 < lc[0]["store_bytes"] < lc[1]["store_bytes"]
    assert [r["kv_device_bytes"] for r in dense] == [2 * 30 * 3 * (n + 64) * 64 * 4 for n in (600, 900)]
    assert all(r["store_bytes"] == 0 and r["peak_growth_bytes"] > 0 for r in dense)
    assert all(r["device_peak_source"].startswith("VmHWM") for r in rows.values())
    assert "device peak" in capsys.readouterr().out
    with pytest.raises(SystemExit):  # argparse error: names the known modes and presets
        tool.main(["--modes", "nosuchpreset"])
    assert "nosuchpreset" in capsys.readouterr().err


def test_bench_gemv_quant_smoke(tmp_path, capsys):
    tool = _tool("bench_gemv_quant")
    out_json = tmp_path / "g.json"
    rc = tool.main(["--shapes", "64x512", "--types", "Q4_K,F16", "--threads", "1,2", "--rounds", "1",
                    "--min-mib", "0.1", "--json", str(out_json)])  # fmt: skip
    assert rc == 0
    rows = json.loads(out_json.read_text())
    assert {(r["type"], r["threads"]) for r in rows} == {
        (t, n) for t in ("Q4_K", "F16", "Q8_0 x16") for n in (1, 2)}
    assert all(r["us"] > 0 and r["gbps"] > 0 and r["calls"] >= 2 for r in rows)
    assert all(r["bytes"] == {"Q4_K": 64 * 288, "F16": 64 * 1024, "Q8_0 x16": 64 * 544}[r["type"]]
               for r in rows)
    assert "GB/s" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        tool.main(["--types", "Q3_K"])
    assert "Q3_K" in capsys.readouterr().err


def test_bench_load_smoke(tiny_llama, tmp_path, capsys):
    tool = _tool("bench_load")
    out_json = tmp_path / "l.json"
    assert tool.main(["--model", str(tiny_llama.path), "--peer", "none", "--new-tokens", "4", "--threads", "1",
                      "--json", str(out_json)]) == 0
    (row,) = json.loads(out_json.read_text())
    assert row["engine"] == "ktquest" and row["weights"] == "gguf" and 0 < row["new_tokens"] <= 4
    assert row["load_s"] > 0 and row["peak_rss_mib"] > 10 and row["kv_mib"] > 0
    assert row["budget_mib"] == pytest.approx((row["file_bytes"] + row["kv"]) / 2**20 + 600)
    assert "| ktquest |" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        tool.main(["--model", str(tmp_path / "missing.gguf")])


def test_attention_recall_on_a_sliding_window_model(recall_tool, tiny_models, tmp_path, capsys):
    """A gemma3 model (sliding-window layers beside global ones: a HybridCache) is measured on its global layers,
    under the model's layer numbers, dense_layer_num counting global layers as the cache does."""
    path = tiny_models("gemma3").path  # layers 0-4 slide, 5 is global
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("The grass is green. The sky is blue. " * 20 + "The pass key is 4242.")
    out_json = tmp_path / "r.json"
    rc = recall_tool.main(["--prompt-file", str(prompt), "--model", str(path), "--raw", "--max-tokens", "200",
                           "--budget", "2", "--queries", "2", "--anchors", "QUEST", "--set", "long_context.block_size=8",
                           "--set", "long_context.local_windows_len=16", "--set", "long_context.dense_layer_num=0",
                           "--json", str(out_json), "--quiet"])  # fmt: skip
    assert rc == 0
    data = json.loads(out_json.read_text())
    assert {r["layer"] for r in data["rows"]} == {5} and not any(r["dense_layer"] for r in data["rows"])
    assert all(0 <= r["recall"] <= 1 + 1e-5 for r in data["rows"])
    assert "| 5 |" in capsys.readouterr().out


def test_ruler_table_averages_against_dense(tmp_path):
    """tools/ruler_table.py: accuracy a task and config from the runs' rows, the average over a config's tasks,
    and the difference from dense's average over the same tasks."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
    from ruler_table import collect, table

    def run(name, rows):
        (tmp_path / f"{name}.json").write_text(json.dumps({"rows": rows}))

    run("a_dense", [{"task": "a", "config": "dense", "correct": 18.0, "trials": 20}])
    run("b_dense", [{"task": "b", "config": "dense", "correct": 10.0, "trials": 20}])
    run("a_quest", [{"task": "a", "config": "quest", "correct": 16.0, "trials": 20},
                    {"task": "a", "config": "quest+ada", "correct": 20.0, "trials": 20}])
    lines = table(collect(tmp_path)).splitlines()
    assert lines[2] == "| dense | 90 | 50 | 70.0 | - |"
    assert "| quest | 80 | - | 80.0 | -10.0 |" in lines and "| quest+ada | 100 | - | 100.0 | +10.0 |" in lines


def test_budget_curve_second_stage_by_mass_reaches_the_oracle():
    """tools/budget_curve.py on random queries and keys: the anchors alone hold at most the oracle's mass, and a
    second stage by mass over every candidate picks the oracle's blocks (one query head a KV head)."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
    from budget_curve import layer_rows

    g = torch.Generator().manual_seed(3)
    n, D = 400, 16
    q = torch.randn(4, 2, D, generator=g)  # [W, H, D]
    k = torch.randn(2, n, D, generator=g) * 2  # [KVH, n, D]
    lc = LongContextConfig(block_size=8, init_windows_len=8, local_windows_len=32, second_select_num=4)
    rows = layer_rows(q, k, n, lc, [0.1], ["QUEST"], ["SEPARATE"], [1, 1000], 10, 1, 0, "mass")
    alone, full = (next(r for r in rows if r["rerank"] == x) for x in (1, 1000))
    assert alone["mass"] <= alone["oracle_mass"] + 1e-6
    assert full["mass"] == pytest.approx(full["oracle_mass"], abs=1e-6)
    assert 0 < alone["top"] <= 1 and full["top"] >= alone["top"] - 0.05


def test_budget_curve_store_second_stage_and_its_plot(tmp_path):
    """--rerank-by store: the store's own second stage (long_context.rerank) over every candidate picks the
    oracle's blocks when each KV head has one query head (its shares order the blocks as their true mass); the
    curves plot from the run's JSON (--replot)."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
    from budget_curve import layer_rows, main

    g = torch.Generator().manual_seed(4)
    n, D = 400, 16
    q = torch.randn(4, 2, D, generator=g)
    k = torch.randn(2, n, D, generator=g) * 2
    lc = LongContextConfig(block_size=8, init_windows_len=8, local_windows_len=32, second_select_num=4)
    rows = layer_rows(q, k, n, lc, [0.1, 0.2], ["QUEST"], ["SEPARATE"], [1, 16], 10, 1, 0, "store")  # 16 k >= 45
    for share in (0.1, 0.2):
        alone, full = (next(r for r in rows if (r["rerank"], r["share"]) == (x, share)) for x in (1, 16))
        assert full["mass"] == pytest.approx(full["oracle_mass"], abs=1e-5)
        assert alone["mass"] < full["mass"]
    (tmp_path / "run.json").write_text(json.dumps({"task": "t", "n": n, "rows": rows}))
    assert main(["--replot", str(tmp_path / "run.json"), "--png", str(tmp_path / "c.png")]) == 0
    assert (tmp_path / "c.png").stat().st_size > 10_000
