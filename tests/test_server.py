"""``ktquest serve``: a real server on 127.0.0.1 driven by the official ``openai`` client and raw HTTP.

Answers equal ``ktquest chat --message`` and ``Engine.generate`` for the same greedy request, prefix reuse is
read off the server's own counters, a bounded burst is answered or refused with 429, a client that leaves
mid-stream stops its generation, and every bad request is a 4xx with an OpenAI-style error body while the
server goes on serving. The bundled SmolLM2 (the server as users run it, a subprocess).
"""

from __future__ import annotations

import concurrent.futures
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.parse
from pathlib import Path

import openai
import pytest

from ktquest.cli import main

REPO = Path(__file__).resolve().parents[1]
MODEL = "smollm2-135m"
QUESTION = "What is the capital of France?"
# A document of ~1,400 tokens: two questions about it share all of it
DOC = " ".join(f"Record {i}: the warehouse in sector {i % 7} holds {i * 13 % 97} crates of apples." for i in range(90))


class _Reply:
    def __init__(self, status: int, text: str):
        self.status_code, self.text = status, text

    def json(self):
        return json.loads(self.text)


def _request(url: str, method: str = "GET", body: bytes | dict | None = None, timeout: float = 300) -> _Reply:
    """Raw HTTP (the standard library's), for what the openai client would not send."""
    u = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=timeout)
    try:
        data = json.dumps(body).encode() if isinstance(body, dict) else body
        conn.request(method, u.path, body=data, headers={"content-type": "application/json"})
        r = conn.getresponse()
        return _Reply(r.status, r.read().decode())
    finally:
        conn.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_server(*flags: str) -> tuple[subprocess.Popen, str, int]:
    """``ktquest serve`` with ``flags`` in a subprocess, once /health answers: (process, URL, port)."""
    port = _free_port()
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen([sys.executable, "-m", "ktquest.cli", "serve", "--port", str(port), *flags], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        try:
            if _request(f"{url}/health", timeout=1).status_code == 200:
                return proc, url, port
        except OSError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"the server did not start: {proc.stdout.read()}")
        time.sleep(0.2)


@pytest.fixture(scope="module")
def server(bundled_gguf):
    proc, url, _ = _start_server("--set", "threads=1", "--queue", "2", "--slots", "2", "--max-body-mb", "1")
    yield url
    proc.terminate()
    out, _ = proc.communicate(timeout=30)
    assert "Traceback" not in out, out


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="none", max_retries=0, timeout=120)


def _health(server) -> dict:
    return _request(f"{server}/health", timeout=5).json()


def _chat(client, messages, **kw):
    return client.chat.completions.create(model=MODEL, messages=messages, temperature=0, **kw)


def test_models_and_health(server, client):
    assert [m.id for m in client.models.list()] == [MODEL]
    h = _health(server)
    assert h["status"] == "ok" and h["model"] == MODEL and h["max_seq_len"] == 8192 and h["queue"] == 2


def test_chat_equals_cli_streamed_or_not(server, client, capsys):
    assert main(["chat", "--message", QUESTION, "--temperature", "0", "--max-new-tokens", "24",
                 "--set", "threads=1"]) == 0
    expected = capsys.readouterr().out.removesuffix("\n")
    assert "Paris" in expected
    r = _chat(client, [{"role": "user", "content": QUESTION}], max_tokens=24)
    assert r.choices[0].message.content == expected
    assert r.choices[0].finish_reason == "stop"
    u = r.usage
    assert u.completion_tokens >= 1 and u.total_tokens == u.prompt_tokens + u.completion_tokens
    stream = _chat(client, [{"role": "user", "content": QUESTION}], max_tokens=24, stream=True,
                   stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == expected
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].usage.prompt_tokens == u.prompt_tokens  # the usage chunk, last
    # the same conversation again: all of it was cached, but the last token (fed again for the logits)
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == u.prompt_tokens - 1


def test_completion_equals_generate_and_stops(server, client):
    import ktquest
    from ktquest.config import CHAT_GENERATION

    engine = ktquest.load(threads=1, **{**CHAT_GENERATION, "temperature": 0.0})
    prompt = "The three largest cities of France are"
    expected = engine.generate(prompt, max_new_tokens=16)
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0)
    assert r.choices[0].text == expected and r.choices[0].finish_reason in ("stop", "length")
    word = expected.split()[2]  # a stop string inside the answer: the text ends before it
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0, stop=[word, "\n\n\n"])
    assert r.choices[0].text == expected[: expected.index(word)] and r.choices[0].finish_reason == "stop"
    s = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0, stop=word, stream=True)
    assert "".join(c.choices[0].text for c in s) == expected[: expected.index(word)]


def test_sampling_fields_are_honoured(client):
    def ask(max_tokens=12, **kw):
        r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Name a color."}],
                                           max_tokens=max_tokens, **kw)
        return r.choices[0].message.content, r.usage.completion_tokens

    a, b = ask(temperature=1.5, top_p=1.0, seed=1), ask(temperature=1.5, top_p=1.0, seed=1)
    assert a == b  # the seed makes sampling repeatable
    assert len({ask(temperature=1.5, top_p=1.0, seed=s)[0] for s in range(2, 6)} | {a[0]}) > 1  # and it matters
    assert ask(temperature=1.5, top_p=1e-6, seed=7) == ask(temperature=0)  # top_p tiny: the best token alone
    assert ask(temperature=0, max_tokens=3)[1] == 3


def test_prefix_reuse(server, client):
    before = _health(server)
    q1 = [{"role": "user", "content": f"{DOC}\n\nHow many crates are in record 3?"}]
    a1 = _chat(client, q1, max_tokens=12)
    # another question about the same document: only the question is prefilled
    q2 = [{"role": "user", "content": f"{DOC}\n\nWhich sector holds record 5?"}]
    a2 = _chat(client, q2, max_tokens=12)
    doc_tokens = a1.usage.prompt_tokens - 20
    assert a2.usage.prompt_tokens_details.cached_tokens > doc_tokens
    # a follow-up in the conversation: the whole first turn is cached
    q3 = q2 + [{"role": "assistant", "content": a2.choices[0].message.content},
               {"role": "user", "content": "And record 6?"}]
    a3 = _chat(client, q3, max_tokens=12)
    assert a3.usage.prompt_tokens_details.cached_tokens >= a2.usage.prompt_tokens
    after = _health(server)
    prefilled = after["prefilled_tokens"] - before["prefilled_tokens"]
    cached = after["cached_tokens"] - before["cached_tokens"]
    prompts = sum(a.usage.prompt_tokens for a in (a1, a2, a3))
    assert prefilled + cached == prompts and prefilled < a1.usage.prompt_tokens + 60
    # the reused cache answers as a cold one: the same greedy tokens as a fresh session of the engine
    import ktquest
    from ktquest.config import CHAT_GENERATION

    engine = ktquest.load(threads=1, **{**CHAT_GENERATION, "temperature": 0.0, "max_new_tokens": 12})
    assert engine.chat_session().send(q2[0]["content"]).text == a2.choices[0].message.content


def test_burst_is_answered_or_refused(server):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Tell me a long story about a dragon."}],
            "max_tokens": 48, "temperature": 0}
    before = _health(server)

    def post(_):
        return _request(f"{server}/v1/chat/completions", "POST", body)

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        replies = list(pool.map(post, range(8)))
    codes = sorted(r.status_code for r in replies)
    assert set(codes) <= {200, 429} and 200 in codes and 429 in codes, codes
    assert codes.count(200) <= 3  # one running + a queue of 2 admitted while the burst arrived... or later
    for r in replies:
        if r.status_code == 429:
            err = r.json()["error"]
            assert err["code"] == "rate_limit_exceeded" and "busy" in err["message"]
        else:
            assert r.json()["choices"][0]["message"]["content"]
    after = _health(server)
    assert after["refused"] - before["refused"] == codes.count(429)
    assert after["running_or_waiting"] == 0


def test_disconnect_stops_generation(server, client):
    before = _health(server)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Write a very long essay about rivers."}],
            "max_tokens": 1000, "temperature": 0, "stream": True}
    u = urllib.parse.urlsplit(server)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=60)
    conn.request("POST", "/v1/chat/completions", body=json.dumps(body), headers={"content-type": "application/json"})
    r = conn.getresponse()
    assert r.status == 200
    got = []
    while len(got) < 8:
        line = r.readline()
        assert line, got
        if line.startswith(b"data:"):
            got.append(line)
    r.close()
    conn.close()  # the client leaves mid-stream
    deadline = time.monotonic() + 60
    while (h := _health(server))["running_or_waiting"] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert h["cancelled"] == before["cancelled"] + 1
    assert h["completion_tokens"] - before["completion_tokens"] < 500  # stopped, not run to max_tokens
    # not streamed: the client leaving is noticed while it waits for the answer
    body["stream"] = False
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=60)
    conn.request("POST", "/v1/chat/completions", body=json.dumps(body), headers={"content-type": "application/json"})
    time.sleep(1.0)
    conn.close()
    deadline = time.monotonic() + 60
    while (h2 := _health(server))["running_or_waiting"] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert h2["cancelled"] == h["cancelled"] + 1
    assert h2["completion_tokens"] - h["completion_tokens"] < 500
    # the server and its cache go on: the same answer as ever
    r = _chat(client, [{"role": "user", "content": QUESTION}], max_tokens=8)
    assert r.choices[0].message.content == "The capital of France is Paris."


BAD = [
    ("malformed JSON", b'{"model": "x", "messages": [', 400, "not valid JSON"),
    ("not an object", b"[1, 2]", 400, "valid dictionary"),
    ("missing messages", json.dumps({"model": MODEL}).encode(), 400, "messages: Field required"),
    ("wrong type", json.dumps({"model": MODEL, "messages": "hi"}).encode(), 400, "messages"),
    ("temperature text", json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                                     "temperature": "0.5"}).encode(), 400, "temperature"),
    ("unknown role", json.dumps({"model": MODEL, "messages": [{"role": "wizard", "content": "hi"}]}).encode(), 400,
     "role"),
    ("top_logprobs alone", json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                                       "top_logprobs": 2}).encode(), 400, "top_logprobs needs logprobs"),
    ("top_logprobs 21", json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                                    "logprobs": True, "top_logprobs": 21}).encode(), 400, "top_logprobs"),
    ("bad format", json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                               "response_format": {"type": "xml"}}).encode(), 400, "response_format type 'xml'"),
    ("tools", json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                          "tools": [{"type": "function", "function": {"name": "f"}}]}).encode(), 400, "tools"),
    ("max_tokens 0", json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                                 "max_tokens": 0}).encode(), 400, "max_tokens"),
    ("max_tokens negative", json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                                        "max_tokens": -5}).encode(), 400, "max_tokens"),
    ("too long", json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "apple " * 9000}]}).encode(),
     400, "prompt too long"),
    ("body too large", json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "a" * 1_100_000}]})
     .encode(), 413, "too large"),
]


@pytest.mark.parametrize("what,body,status,needle", BAD, ids=[b[0] for b in BAD])
def test_bad_requests(server, what, body, status, needle):
    r = _request(f"{server}/v1/chat/completions", "POST", body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert needle in err["message"] and set(err) == {"message", "type", "param", "code"}, err
    assert "Traceback" not in r.text
    assert _health(server)["status"] == "ok"


def test_bad_completion_requests(server):
    for body, needle in (({"model": MODEL, "prompt": ""}, "empty"), ({"model": MODEL, "prompt": [99999999]}, "vocab"),
                         ({"model": MODEL, "prompt": "hi", "n": 2}, "n"),
                         ({"model": MODEL, "prompt": "hi", "top_p": 0}, "top_p")):
        r = _request(f"{server}/v1/completions", "POST", body)
        assert r.status_code == 400 and needle in r.json()["error"]["message"], r.text
    r = _request(f"{server}/v1/nothing")
    assert r.status_code == 404 and "error" in r.json()


def test_sigterm_ends_a_running_stream_at_its_next_token(bundled_gguf):
    """SIGTERM while a long reply streams: the stream ends at the next token with an error event saying the
    server is shutting down and [DONE], and the process exits within 3 s, no traceback (uvicorn used to
    generate on until its 5 s grace ran out and cut the stream without a last event)."""
    proc, _, port = _start_server("--set", "threads=1")
    try:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        conn.request("POST", "/v1/chat/completions", body=json.dumps(
            {"model": "x", "stream": True, "max_tokens": 3000, "temperature": 0,
             "messages": [{"role": "user", "content": "Write a very long story about a cat."}]}),
            headers={"content-type": "application/json"})
        r = conn.getresponse()
        first = r.readline()  # the stream has begun
        assert first.startswith(b"data: ")
        proc.send_signal(signal.SIGTERM)
        t0 = time.monotonic()
        rest = r.read().decode()
        conn.close()
        out, _ = proc.communicate(timeout=10)
        assert time.monotonic() - t0 < 3.0
        events = [line for line in rest.split("\n") if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]" and "server_shutting_down" in events[-2]
        assert "Traceback" not in out and "timeout graceful shutdown exceeded" not in out, out
    finally:
        if proc.poll() is None:
            proc.kill()
