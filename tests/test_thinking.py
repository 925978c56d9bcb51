"""Thinking models (Qwen3, QwQ, DeepSeek-R1): a reply's ``<think>`` block split from its answer, whole and
streamed in any pieces; the chat keeps the answer in its history and the thinking beside it as
``reasoning_content`` (the template decides: a Qwen3-style one renders it only after the last user message),
the next turn answering as a fresh engine given the same history; the server's ``reasoning_content`` field
and deltas; ``ktquest chat --show-thinking``.

A random-weights model never writes ``<think>``: the replies here are scripted (``script``), token by token,
through the real model (so the cache holds them as it would a thinking model's)."""

from __future__ import annotations

import http.client
import io
import json

import pytest
from conftest import make_tiny_model
from rich.console import Console
from test_server_requests import _serving

import ktquest
import ktquest.generate
from ktquest.cli import main
from ktquest.sequence import common_prefix_len
from ktquest.server.app import create_app
from ktquest.server.worker import Worker
from ktquest.structured import FormatError, ResponseFormat
from ktquest.terminal import DIM, PLAIN, Thinking
from ktquest.turn import ThinkSplit, opens_thinking, split_thinking

# Qwen3's way (written for this test): an assistant's reasoning_content is rendered only after the last user
# message; the generation prompt is {GEN}
THINK_TEMPLATE = (
    "{% set ns = namespace(last_query=-1) %}"
    "{% for m in messages %}{% if m.role == 'user' %}{% set ns.last_query = loop.index0 %}{% endif %}{% endfor %}"
    "{% for m in messages %}{{ '<|im_start|>' + m.role + '\\n' }}"
    "{% if m.role == 'assistant' and loop.index0 > ns.last_query and m.reasoning_content is string %}"
    "{{ '<think>\\n' + m.reasoning_content + '\\n</think>\\n\\n' }}{% endif %}"
    "{{ m.content + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ GEN }}{% endif %}"
)
THOUGHT, ANSWER = "the cat sat on the mat", "the dog"
REPLY = f"<think>\n{THOUGHT}\n</think>\n\n{ANSWER}"
LONG = ["--max-new-tokens", "32"]  # room for a scripted reply


def _template(gen: str) -> str:
    return THINK_TEMPLATE.replace("GEN", repr(gen))


@pytest.fixture(scope="module")
def thinker(tmp_path_factory, tiny_bpe):
    """The tiny llama with the Qwen3-style template."""
    return make_tiny_model(tmp_path_factory.mktemp("think"), "llama", tiny_bpe, _template("<|im_start|>assistant\n"))


@pytest.fixture(scope="module")
def opener(tmp_path_factory, tiny_bpe):
    """The same whose generation prompt opens the block (as Qwen3-2507 Thinking's does)."""
    return make_tiny_model(tmp_path_factory.mktemp("think_open"), "llama", tiny_bpe,
                           _template("<|im_start|>assistant\n<think>\n"))


@pytest.fixture
def script(monkeypatch):
    """Append text to it: the next generation samples its tokens (then the end of turn) before sampling as
    configured. The model reads each token as it would its own."""
    queue: list[str] = []
    real = ktquest.generate.Sampler

    class Scripted:
        def __init__(self, gen):
            self.sampler, self.left = real(gen), []
            if queue:
                tok = Scripted.tokenizer
                self.left = tok.encode(queue.pop(0), add_bos=False, parse_special=False) + [tok.eos_id]

        def __call__(self, logits, recent=()):
            return self.left.pop(0) if self.left else self.sampler(logits, recent)

    monkeypatch.setattr(ktquest.generate, "Sampler", Scripted)

    def use(engine) -> list[str]:
        Scripted.tokenizer = engine.tokenizer
        return queue

    return use


# ---- the split ----


CASES = [  # (text, open_block) -> (thinking, answer)
    (REPLY, False, THOUGHT, ANSWER),
    ("  \n<think>a b\n\n</think>answer </think> x", False, "a b", "answer </think> x"),
    (f"{THOUGHT}\n</think>\n\n{ANSWER}", True, THOUGHT, ANSWER),  # the prompt opened the block
    ("\n\nno block <think>here</think>", False, None, "\n\nno block <think>here</think>"),
    ("<think>\ncut short </thi", False, "cut short </thi", ""),  # never closed: all thinking
    ("cut short", True, "cut short", ""),
    ("<thin", False, None, "<thin"),
    ("  ", False, None, "  "),
    ("<think></think>", False, "", ""),
]


@pytest.mark.parametrize(("text", "open_block", "thinking", "answer"), CASES)
def test_split_whole_and_streamed(text, open_block, thinking, answer):
    assert split_thinking(text, open_block) == (thinking, answer)
    for size in (1, 2, 3, 5, 8):  # streamed in pieces of any size: the tags cut anywhere
        split, out = ThinkSplit(open_block), []
        for i in range(0, len(text), size):
            out += split.push(text[i: i + size])
        out += split.flush()
        assert (split.reasoning, split.content) == (thinking, answer)
        assert "".join(t for k, t in out if k == "thinking") == (thinking or "")
        assert "".join(t for k, t in out if k == "answer") == answer


def test_split_streams_as_it_can():
    split = ThinkSplit()
    assert split.push(" <th") == [] and split.push("ink>\nI") == [("thinking", "I")]
    assert split.push(" think\n</") == [("thinking", " think")]  # the blank and a tag's start held
    assert split.push("think>\n\nSo") == [("answer", "So")]
    assert split.push(" yes") == [("answer", " yes")] and split.flush() == []
    assert opens_thinking("<|im_start|>assistant\n<think>\n") and not opens_thinking("<think>\n\n</think>\n\n")


# ---- the chat ----


def test_chat_history_holds_the_answer_and_turn_two_equals_a_fresh_engine(thinker, script):
    eng = ktquest.load(thinker.path, max_new_tokens=32, threads=1)
    script(eng).append(REPLY)
    session = eng.chat_session(system="be brief")
    thinking, answer = [], []
    reply = session.send("the cat", on_text=answer.append, on_thinking=thinking.append)
    assert (reply.thinking, reply.text) == (THOUGHT, ANSWER)
    assert ("".join(thinking), "".join(answer)) == (THOUGHT, ANSWER)
    assert session.messages[-1] == {"role": "assistant", "content": ANSWER, "reasoning_content": THOUGHT}
    held = eng.sequence.ids  # the cache holds the reply as generated, its think block included
    assert "</think>" in eng.tokenizer.decode(held)

    history = [dict(m) for m in session.messages]
    reply2 = session.send("the dog")  # greedy now, the model's own
    tokens = eng.tokenizer.encode_messages(session.messages[:-1])
    prompt = eng.tokenizer.decode(tokens)
    assert "<think>" not in prompt and THOUGHT not in prompt and f"assistant\n{ANSWER}<|im_end|>" in prompt
    shared = common_prefix_len(held, tokens)
    assert shared < len(held) and reply2.stats.prompt_tokens == len(tokens) - shared  # read again from the reply

    fresh = ktquest.load(thinker.path, max_new_tokens=32, threads=1).chat_session(system="be brief")
    fresh.messages = history
    again = fresh.send("the dog")
    assert (again.text, again.thinking) == (reply2.text, reply2.thinking)
    assert fresh.engine.sequence.ids == eng.sequence.ids


def test_a_saved_chat_keeps_the_thinking(thinker, script, tmp_path):
    eng = ktquest.load(thinker.path, max_new_tokens=32, threads=1)
    script(eng).append(REPLY)
    session = eng.chat_session(system="be brief")
    session.send("the cat")
    session.save(tmp_path / "chat.kv")
    loaded = ktquest.load(thinker.path, max_new_tokens=32, threads=1).load_session(tmp_path / "chat.kv")
    assert loaded.messages == session.messages and loaded.messages[-1]["reasoning_content"] == THOUGHT


def test_template_renders_reasoning_only_after_the_last_user_message(thinker):
    tok = ktquest.load(thinker.path, threads=1).tokenizer
    turn = [{"role": "user", "content": "q"},
            {"role": "assistant", "content": "a", "reasoning_content": "r <|im_end|>"}]
    last = tok.apply_chat_template(turn, add_generation_prompt=False)
    assert "<think>\nr <|im_end|>\n</think>\n\na<|im_end|>" in last
    assert "<think>" not in tok.apply_chat_template(turn + [{"role": "user", "content": "q2"}])
    ids = tok.encode_messages(turn, add_generation_prompt=False)  # the reasoning's special-token text is text
    assert ids.count(tok.eos_id) == 2


def test_template_without_reasoning_never_gets_it_back(tiny_llama, script):
    eng = ktquest.load(tiny_llama.path, max_new_tokens=32, threads=1)
    script(eng).append(REPLY)
    session = eng.chat_session()
    assert session.send("hello").text == ANSWER
    reply = session.send("again")
    assert reply.stats.prompt_tokens > 0
    prompt = eng.tokenizer.apply_chat_template(session.messages[:-1])
    assert "<think>" not in prompt and THOUGHT not in prompt


def test_prompt_that_opens_the_block(opener, script):
    eng = ktquest.load(opener.path, max_new_tokens=32, threads=1)
    script(eng).append(f"{THOUGHT}\n</think>\n\n{ANSWER}")
    session = eng.chat_session()
    reply = session.send("the cat")
    assert (reply.thinking, reply.text) == (THOUGHT, ANSWER)
    reply = session.send("the dog")  # the model's own: it never closes the block, so all of it is thinking
    assert reply.text == "" and reply.thinking == eng.tokenizer.decode(
        [t for t in eng.sequence.ids[-reply.stats.new_tokens:] if t not in eng.tokenizer.stop_ids]).strip()
    assert reply.stats.stopped_by == "max_new_tokens"


# ---- the command line ----


@pytest.mark.parametrize(("flags", "shown"), [([], f"{ANSWER}\n"), (["--show-thinking"], f"{THOUGHT}\n\n{ANSWER}\n")])
def test_cli_hides_or_shows_thinking(thinker, script, capsys, flags, shown):
    script(ktquest.load(thinker.path, threads=1)).append(REPLY)  # (the same tokenizer as the chat's engine)
    code = main(["chat", "--model", str(thinker.path), "--message", "hi", *LONG, *flags])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert out == shown  # not a terminal: no escape codes, no "thinking..." line


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_terminal_dims_or_hides_thinking():
    err = Console(file=_Terminal(), force_terminal=True)
    shown = Thinking(_Terminal(), err, show=True)
    assert (shown.piece("a"), shown.piece("b"), shown.end(), shown.end()) == (DIM + "a", "b", PLAIN + "\n\n", "")
    hidden = Thinking(_Terminal(), err, show=False)
    assert hidden.piece("a") == "" and hidden.status is not None  # the "thinking..." line on err
    assert hidden.end() == "" and hidden.status is None


# ---- the server ----


def _stream(port: int, body: dict) -> list[dict]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        conn.request("POST", "/v1/chat/completions", body=json.dumps({**body, "stream": True}).encode(),
                     headers={"content-type": "application/json"})
        r = conn.getresponse()
        assert r.status == 200
        events = [line[6:] for line in r.read().decode().splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        return [json.loads(e) for e in events[:-1]]
    finally:
        conn.close()


def test_server_reasoning_content(thinker, script):
    eng = ktquest.load(thinker.path, max_seq_len=128, max_new_tokens=40, threads=1)
    queue = script(eng)
    n_reply = len(eng.tokenizer.encode(REPLY, add_bos=False)) + 1
    ask = {"model": "tiny", "messages": [{"role": "user", "content": "the cat"}]}
    with _serving(create_app(Worker(eng), "tiny")) as post:
        queue.append(REPLY)
        status, body = post("/v1/chat/completions", ask)
        assert status == 200
        message = body["choices"][0]["message"]
        assert message == {"role": "assistant", "content": ANSWER, "reasoning_content": THOUGHT}
        assert body["usage"]["completion_tokens"] == n_reply  # counted as generated, the think block included

        queue.append(REPLY)
        events = _stream(post.port, ask)
        deltas = [e["choices"][0]["delta"] for e in events if e["choices"]]
        assert "".join(d.get("reasoning_content", "") for d in deltas) == THOUGHT
        assert "".join(d.get("content", "") for d in deltas) == ANSWER
        first = next(i for i, d in enumerate(deltas) if d.get("content"))
        assert all("content" not in d or not d["content"] for d in deltas[:first])  # thinking, then the answer
        assert all("reasoning_content" not in d for d in deltas[first:])
        assert events[-1]["choices"][0]["finish_reason"] == "stop"

        queue.append(REPLY)
        status, body = post("/v1/chat/completions", {**ask, "reasoning_format": "none"})  # kept inline
        assert body["choices"][0]["message"] == {"role": "assistant", "content": REPLY}

        # a reply's thinking sent back: given to the template, which leaves it out before the last user message
        history = [ask["messages"][0], {"role": "assistant", "content": ANSWER, "reasoning_content": THOUGHT},
                   {"role": "user", "content": "the dog"}]
        status, body = post("/v1/chat/completions", {**ask, "messages": history, "max_tokens": 1})
        assert status == 200
        assert body["usage"]["prompt_tokens"] == len(eng.tokenizer.encode_messages(history))
        status, body = post("/v1/chat/completions", {**ask, "messages": [{**history[1], "reasoning_content": 1}]})
        assert status == 400 and body["error"]["param"] == "messages.0.reasoning_content"


def test_a_held_reply_thinks_first_where_the_prompt_opened_the_block(opener, thinker, script):
    """A reply held to a format (the chat's response_format, the server's) on a template whose generation prompt
    opens <think>: it thinks up to </think>, then it is held to the format (the scripted thought would break a
    format held from the first token); an answer that breaks it after </think> is refused. Where the prompt
    opened no block the format holds from the first token, as before."""
    eng = ktquest.load(opener.path, max_new_tokens=64, threads=1)
    queue = script(eng)
    value = '{"a": 1}'
    queue.append(f"{THOUGHT}\n</think>\n\n{value}")
    session = eng.chat_session()
    session.response_format = ResponseFormat.parse({"type": "json_object"})
    reply = session.send("the cat")
    assert (reply.thinking, reply.text) == (THOUGHT, value)
    queue.append(f"{THOUGHT}\n</think>\n\nthe dog")
    with pytest.raises(FormatError, match="does not follow the grammar"):
        session.send("the dog")
    ask = {"model": "tiny", "messages": [{"role": "user", "content": "the cat"}],
           "response_format": {"type": "json_object"}}
    with _serving(create_app(Worker(eng), "tiny")) as post:
        queue.append(f"{THOUGHT}\n</think>\n\n{value}")
        status, body = post("/v1/chat/completions", ask)
        assert status == 200
        assert body["choices"][0]["message"] == {"role": "assistant", "content": value, "reasoning_content": THOUGHT}
    plain = ktquest.load(thinker.path, max_new_tokens=64, threads=1)
    script(plain).append(REPLY)  # (<think> itself breaks JSON held from the first token)
    session = plain.chat_session()
    session.response_format = ResponseFormat.parse({"type": "json_object"})
    with pytest.raises(FormatError):
        session.send("the cat")
