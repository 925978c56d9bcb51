"""``ktquest bench``: a tiny smoke run (a markdown table, JSON rows with every field) and its clean errors."""

from __future__ import annotations

import json
import sys

from ktquest.cli import main

# quest on the tiny model: 4-token blocks, 4 blocks a step, so a 64-token context already selects
QUEST_SETS = ["--set", "long_context.block_size=4", "--set", "long_context.init_windows_len=4",
              "--set", "long_context.local_windows_len=16", "--set", "long_context.second_select_num=4",
              "--set", "long_context.dense_layer_num=0", "--set", "chunk_size=32"]
FIELDS = {"engine", "preset", "mode", "context", "threads", "prefill_s", "prefill_tok_s", "first_token_s",
          "decode_tokens", "decode_tok_s"}


def test_bench_writes_table_and_json(tiny_llama, tmp_path, capsys):
    out = tmp_path / "out.json"
    code = main(["bench", "-m", str(tiny_llama.path), "-c", "64,128", "--config", "dense,quest", "-n", "4",
                 "-t", "1", *QUEST_SETS, "--json", str(out)])
    assert code == 0
    rows = json.loads(out.read_text())
    assert [(r["preset"], r["context"]) for r in rows] == [("dense", 64), ("dense", 128),
                                                           ("quest", 64), ("quest", 128)]
    for r in rows:
        assert FIELDS <= set(r)
        assert r["engine"] == "ktquest" and r["decode_tokens"] == 4 and r["threads"] == 1
        assert r["prefill_tok_s"] > 0 and r["first_token_s"] > 0 and r["decode_tok_s"] > 0
    assert [r["mode"] for r in rows] == ["dense", "dense", "long_context", "long_context"]
    table = capsys.readouterr().out.strip().splitlines()
    assert table[0] == "| engine | preset | context | pp tok/s | first token s | tg tok/s |"
    assert len(table) == 2 + len(rows) and table[2].startswith("| ktquest | dense | 64 |")


def test_bench_without_llama_cpp_is_one_error_line(tiny_llama, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # `import llama_cpp` raises ImportError
    assert main(["bench", "-m", str(tiny_llama.path), "-c", "64", "--config", "dense", "--llama-cpp"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("ktquest: error: --llama-cpp needs llama-cpp-python")


def test_bench_refuses_bad_contexts(capsys):
    assert main(["bench", "-c", "64,abc"]) == 2
    assert "--contexts '64,abc'" in capsys.readouterr().err


def test_bench_repetitions_give_medians_and_spread(tiny_llama, tmp_path, capsys):
    out = tmp_path / "out.json"
    assert main(["bench", "-m", str(tiny_llama.path), "-c", "64", "--config", "dense", "-n", "2", "-t", "1",
                 "-r", "3", "--json", str(out)]) == 0
    (row,) = json.loads(out.read_text())
    assert row["repetitions"] == 3 and len(row["runs"]) == 3
    for key in ("prefill_tok_s", "first_token_s", "decode_tok_s"):
        values = sorted(r[key] for r in row["runs"])
        assert row[key] == values[1] and row[key + "_sd"] >= 0  # the median of the three
    line = capsys.readouterr().out.strip().splitlines()[2]
    assert line.startswith("| ktquest | dense | 64 | ") and line.count(" ± ") == 3
    assert main(["bench", "-c", "64", "-r", "0"]) == 2
    assert "-r 0: run each measurement at least once" in capsys.readouterr().err


def test_bench_warns_past_the_trained_context_and_records_the_cache(tiny_llama, tmp_path, capsys):
    out = tmp_path / "out.json"
    assert main(["bench", "-m", str(tiny_llama.path), "-c", "300", "--config", "dense", "-n", "2", "-t", "1",
                 "--json", str(out)]) == 0
    err = capsys.readouterr().err
    assert "ktquest: context 300 tokens is past the 256 the model was trained on" in err
    (row,) = json.loads(out.read_text())
    assert row["max_seq_len"] >= 300 + 2
