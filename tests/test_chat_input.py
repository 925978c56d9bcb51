"""``ktquest chat``'s input: multi-line messages (a block between two lines of three double quotes, a bracketed
paste), /commands (an unknown one refused, the conversation unchanged; /quit), ``--chat-template FILE``, and a
base model named as such in the banner, /stats and the server's /v1/models."""

from __future__ import annotations

import io
import re
import sys

import pytest
from conftest import BOOM_TEMPLATE, CHAT_TEMPLATE, make_tiny_model
from test_cli import STATS
from test_server_requests import _serving

import ktquest
from ktquest.cli import main
from ktquest.config import ConfigError
from ktquest.server.app import create_app
from ktquest.server.worker import Worker
from ktquest.terminal import PASTE_END, PASTE_START, read_message


def _chat(monkeypatch, capsys, argv: list[str], stdin: str = "") -> tuple[int, str, str]:
    monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
    code = main(["chat", "--max-new-tokens", "3", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def _turns(out: str) -> list[int]:
    """The turn counts each /stats printed."""
    return [int(n) for n in re.findall(r"\bturns\s+(\d+)", out)]


def _reader(*lines: str):
    it = iter(lines)

    def read_line(prompt: str) -> str:
        try:
            return next(it)
        except StopIteration:
            raise EOFError from None

    return read_line


# ---- reading a message ----


def test_a_block_is_one_message():
    m = read_message(_reader('"""', "first line", "", "/not a command", '"""', "after"), ">>> ", "... ")
    assert m.text == "first line\n\n/not a command" and m.block


def test_a_paste_whose_escapes_arrive_is_one_message():
    m = read_message(_reader(f"{PASTE_START}one", "two", f"three{PASTE_END}"), ">>> ", "... ")
    assert m.text == "one\ntwo\nthree" and m.block
    assert read_message(_reader("one line\nand another"), ">>> ", "... ").block  # readline's bracketed paste
    assert not read_message(_reader("/stats"), ">>> ", "... ").block


def test_an_unfinished_block_ends_with_the_input():
    with pytest.raises(EOFError):
        read_message(_reader('"""', "never closed"), ">>> ", "... ")


# ---- the chat ----


def test_a_block_is_one_turn(tiny_llama, monkeypatch, capsys):
    code, out, _ = _chat(monkeypatch, capsys, ["--model", str(tiny_llama.path)],
                         '"""\nthe cat\nsat on\n\nthe mat\n"""\n/stats\n')
    assert code == 0
    assert _turns(out) == [1] and len(re.findall("^" + STATS, out, re.MULTILINE)) == 1
    code, out, _ = _chat(monkeypatch, capsys, ["--model", str(tiny_llama.path)],
                         f"{PASTE_START}the cat\nsat{PASTE_END}\n/stats\n")
    assert code == 0 and _turns(out) == [1]


def test_an_unknown_command_is_refused_and_sends_nothing(tiny_llama, monkeypatch, capsys):
    code, out, _ = _chat(monkeypatch, capsys, ["--model", str(tiny_llama.path)], "/foo bar\n/stats\n/save\n/stats\n")
    assert code == 0
    refusals = [line.removeprefix(">>> ") for line in out.splitlines() if "unknown command" in line]
    assert refusals == ["unknown command /foo bar; commands: /reset /stats /save FILE /load FILE /help /exit /quit "
                        '(a message that starts with / goes in a """ block)']
    assert "usage: /save FILE" in out  # /save without a file
    assert _turns(out) == [0, 0] and not re.search(STATS, out)


def test_quit_exits(tiny_llama, monkeypatch, capsys):
    code, out, _ = _chat(monkeypatch, capsys, ["--model", str(tiny_llama.path)], "/quit\nthe cat\n/stats\n")
    assert code == 0 and not re.search(STATS, out) and not _turns(out)
    assert "/exit, /quit or Ctrl-D quits" in out  # the help line says so


# ---- --chat-template ----


def test_a_chat_template_file_is_used(tiny_llama_base, tmp_path, monkeypatch, capsys):
    template = tmp_path / "boom.jinja"
    template.write_text(BOOM_TEMPLATE, encoding="utf-8")  # a template error on a message containing "boom"
    code, out, err = _chat(monkeypatch, capsys, ["--model", str(tiny_llama_base.path), "--chat-template",
                                                 str(template)], "boom\nthe cat\n/stats\n")
    assert code == 0
    assert "boom refused" in out and _turns(out) == [1]
    assert "base model" not in out and "no chat template" not in err
    assert re.search(r"chat template\s+yes", out)


def test_a_chat_template_file_rescues_a_model_whose_own_does_not_compile(tmp_path, tiny_bpe, monkeypatch, capsys):
    broken = make_tiny_model(tmp_path, "llama", tiny_bpe, chat_template="{% for m in messages %}")
    with pytest.raises(ktquest.GGUFError, match="chat template: syntax error"):
        ktquest.load(broken.path, max_seq_len=64, threads=1)  # its own: refused at load, naming the file
    template = tmp_path / "chat.jinja"
    template.write_text(CHAT_TEMPLATE, encoding="utf-8")
    engine = ktquest.load(broken.path, max_seq_len=64, threads=1, chat_template=str(template))  # (a config key)
    assert engine.tokenizer.chat_template == CHAT_TEMPLATE
    assert "hi" in engine.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
    code, out, err = _chat(monkeypatch, capsys, ["--model", str(broken.path), "--chat-template", str(template)],
                           "the cat\n/stats\n")
    assert code == 0 and _turns(out) == [1] and re.search(r"chat template\s+yes", out), err
    with pytest.raises(ConfigError, match=r"^chat_template: \S*gone.jinja: no such file$"):
        ktquest.load(broken.path, max_seq_len=64, threads=1, chat_template=str(tmp_path / "gone.jinja"))


@pytest.mark.parametrize(("text", "why"), [
    ("{% for message in messages %}{{ message['content'] }", "syntax error"),
    ("{{ messages[0].content.nope() }}", "chat template"),
    ("  \n", "the file is empty"),
])
def test_a_broken_chat_template_file_is_refused_naming_it(tiny_llama, tmp_path, monkeypatch, capsys, text, why):
    bad = tmp_path / "bad.jinja"
    bad.write_text(text, encoding="utf-8")
    for command in ("chat", "serve"):
        monkeypatch.setattr(sys, "stdin", io.StringIO(""))
        assert main([command, "--model", str(tiny_llama.path), "--chat-template", str(bad)]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"ktquest: error: --chat-template {bad}: ") and why in err and err.count("\n") == 1
    code, _, err = _chat(monkeypatch, capsys, ["--model", str(tiny_llama.path), "--chat-template",
                                               str(tmp_path / "missing.jinja")])
    assert code == 2 and "missing.jinja: no such file" in err


# ---- a base model, named as such ----


def test_a_base_model_is_named_in_the_banner_and_stats(tiny_llama, tiny_llama_base, monkeypatch, capsys):
    _, out, _ = _chat(monkeypatch, capsys, ["--model", str(tiny_llama_base.path)], "/stats\n")
    assert "(base model: no chat template" in out.splitlines()[0]
    assert re.search(r"chat template\s+none: a base model", out)
    _, out, _ = _chat(monkeypatch, capsys, ["--model", str(tiny_llama.path)], "/stats\n")
    assert "base model" not in out


def test_v1_models_says_whether_the_model_has_a_chat_template(tiny_llama, tiny_llama_base, tmp_path, monkeypatch):
    for model, has in ((tiny_llama, True), (tiny_llama_base, False)):
        with _serving(create_app(Worker(ktquest.load(model.path, max_seq_len=64, threads=1)), "tiny")) as get:
            status, body = get("/v1/models")
        assert status == 200 and body["data"][0]["id"] == "tiny" and body["data"][0]["chat_template"] is has
    # serve --chat-template gives the base model one
    template = tmp_path / "t.jinja"
    template.write_text(BOOM_TEMPLATE, encoding="utf-8")
    served = []
    monkeypatch.setattr("ktquest.server.serve", lambda engine, *a, **kw: served.append(engine))
    assert main(["serve", "--model", str(tiny_llama_base.path), "--chat-template", str(template)]) == 0
    assert served[0].tokenizer.chat_template == BOOM_TEMPLATE
