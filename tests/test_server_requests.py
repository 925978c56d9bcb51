"""``ktquest serve``'s request handling in process (``create_app`` over a tiny model, uvicorn on a thread): a
prompt that cannot fit is refused before it is tokenized, numbers past their bounds and deep JSON are 400s
naming the field, a client that leaves mid-body is not an error, and cached prompts are reused per API key.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import socket
import threading
import time

import pytest
import uvicorn

import ktquest
from ktquest.server.app import create_app
from ktquest.server.worker import Worker

MODEL = "tiny"
DOC = "the cat sat on the mat and the dog sat on the log " * 12


@contextlib.contextmanager
def _serving(app=None, make=None):
    """``app`` (or ``make(port)``'s, an app that knows its port) served on 127.0.0.1 by uvicorn on a thread;
    yields a ``post(path, body, headers)``."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    app = app if make is None else make(port)
    server = uvicorn.Server(uvicorn.Config(app, log_config=None, log_level="warning"))  # logs reach caplog
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.02)

    def post(path: str, body: bytes | dict | None = None, headers: dict | None = None) -> tuple[int, dict]:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        try:
            data = json.dumps(body).encode() if isinstance(body, dict) else body
            conn.request("GET" if body is None else "POST", path, body=data,
                         headers={"content-type": "application/json", **(headers or {})})
            r = conn.getresponse()
            return r.status, json.loads(r.read())
        finally:
            conn.close()

    post.port = port
    try:
        yield post
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


@pytest.fixture(scope="module")
def engine(tiny_llama):
    return ktquest.load(tiny_llama.path, max_seq_len=64, threads=1)


@pytest.fixture
def post(engine):
    with _serving(create_app(Worker(engine), MODEL)) as post:
        yield post


def _no_traceback(caplog) -> None:
    assert "Traceback" not in caplog.text and not [r for r in caplog.records if r.exc_info], caplog.text


def test_a_prompt_that_cannot_fit_is_never_tokenized(engine, post, monkeypatch, caplog):
    seen: list[int] = []  # the length of every text the tokenizer was given
    tok = engine.tokenizer
    for name in ("encode", "encode_messages"):
        real = getattr(tok, name)

        def spy(arg, *a, _real=real, **kw):
            seen.append(len(arg) if isinstance(arg, str) else sum(len(m["content"]) for m in arg))
            return _real(arg, *a, **kw)
        monkeypatch.setattr(tok, name, spy)
    big = "apple " * 35_000  # 210 KB; the context is 64 tokens
    for path, body in (("/v1/completions", {"prompt": big}), ("/v1/completions", {"prompt": [big]}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": big}]})):
        t0 = time.monotonic()
        status, reply = post(path, {"model": MODEL, "max_tokens": 2, **body})
        err = reply["error"]
        assert status == 400 and err["code"] == "context_length_exceeded", reply
        assert "prompt too long" in err["message"] and "64 tokens (max_seq_len)" in err["message"], err
        assert time.monotonic() - t0 < 30
    assert not [n for n in seen if n > 10_000], seen  # refused on its length alone
    status, reply = post("/v1/completions", {"model": MODEL, "prompt": list(range(1, 100_001))})
    assert status == 400 and "100000 tokens" in reply["error"]["message"]  # token ids: counted first
    status, reply = post("/v1/completions", {"model": MODEL, "prompt": "the cat", "max_tokens": 2})
    assert status == 200 and reply["usage"]["completion_tokens"] >= 1  # one that fits still runs
    _no_traceback(caplog)


BOUNDS = [
    ("n true", b'"n": true', "n"),
    ("n huge", b'"n": 1000000000000000000000000000000', "n"),
    ("max_tokens past int32", b'"max_tokens": 2147483648', "max_tokens"),
    ("max_tokens 2**40", b'"max_tokens": 1099511627776', "max_tokens"),
    ("seed 2**70", b'"seed": 1180591620717411303424', "seed"),
    ("temperature 1e999", b'"temperature": 1e999', "temperature"),
    ("temperature true", b'"temperature": true', "temperature"),
    ("temperature NaN", b'"temperature": NaN', "NaN"),
    ("top_p -Infinity", b'"top_p": -Infinity', "Infinity"),
    ("top_p 1.5", b'"top_p": 1.5', "top_p"),
    ("stream 1", b'"stream": 1', "stream"),
    ("token id past int32", b'"prompt": [4294967296]', "prompt"),
    ("deep in an unknown field", b'"extra": ' + b"[" * 200 + b"]" * 200, "nested too deeply"),
    ("deep and unclosed", b'"extra": ' + b"[" * 100_000, "nested too deeply"),
]


@pytest.mark.parametrize("what,field,needle", BOUNDS, ids=[b[0] for b in BOUNDS])
def test_numbers_past_their_bounds_and_deep_json_are_400s(post, caplog, what, field, needle):
    body = b'{"model": "tiny", ' + (b'"prompt": "hi", ' if b'"prompt"' not in field else b"") + field + b"}"
    status, reply = post("/v1/completions", body)
    assert status == 400 and needle in reply["error"]["message"], reply
    assert (reply["error"]["param"] or needle).startswith(needle), reply  # named, where there is a field
    _no_traceback(caplog)


def test_a_client_that_leaves_mid_body_is_not_an_error(post, caplog):
    with socket.create_connection(("127.0.0.1", post.port)) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 100000\r\n\r\n" + b'{"model": "tiny", "prompt": "' + b"x" * 1000)
        time.sleep(0.3)
    time.sleep(0.5)
    status, _ = post("/v1/completions", {"model": MODEL, "prompt": "the cat", "max_tokens": 1})
    assert status == 200  # the server goes on
    _no_traceback(caplog)


def _complete(post, prompt: str, key: str | None = None) -> dict:
    status, reply = post("/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 1, "temperature": 0},
                         {"authorization": f"Bearer {key}"} if key else None)
    assert status == 200, reply
    return reply["usage"]


def test_cached_prompts_are_reused_per_api_key(tiny_llama):
    engine = ktquest.load(tiny_llama.path, max_seq_len=512, threads=1)
    worker = Worker(engine, slots=2)
    with _serving(create_app(worker, MODEL, api_keys=("key-one", "key-two"))) as post:
        for headers in (None, {"authorization": "Bearer key-three"}, {"authorization": "key-one"}):
            status, reply = post("/v1/completions", {"model": MODEL, "prompt": "hi"}, headers)
            assert status == 401 and reply["error"]["code"] == "invalid_api_key", reply
            assert post("/v1/models", None, headers)[0] == 401 and post("/health", None, headers)[0] == 401
        assert post("/v1/models", None, {"authorization": "Bearer key-two"})[0] == 200
        first = _complete(post, f"{DOC} Q: where did the cat sit?", "key-one")
        # another key sends the same document: nothing of the first's is reused (nor its slot taken)
        other = _complete(post, f"{DOC} Q: and the dog?", "key-two")
        assert other["prompt_tokens_details"]["cached_tokens"] == 0
        assert len(worker.slots) == 2
        # the first key again: its document is still cached (the single-user fast path)
        again = _complete(post, f"{DOC} Q: and the mat?", "key-one")
        assert again["prompt_tokens_details"]["cached_tokens"] > first["prompt_tokens"] // 2


def test_requests_without_a_key_share_one_group(tiny_llama):
    engine = ktquest.load(tiny_llama.path, max_seq_len=512, threads=1)
    with _serving(create_app(Worker(engine, slots=2), MODEL)) as post:
        first = _complete(post, f"{DOC} Q: where did the cat sit?")
        again = _complete(post, f"{DOC} Q: and the dog?")  # another client, no key: the same group
        assert again["prompt_tokens_details"]["cached_tokens"] > first["prompt_tokens"] // 2
        keyed = _complete(post, f"{DOC} Q: and the mat?", "mine")  # a key of its own keeps it apart
        assert keyed["prompt_tokens_details"]["cached_tokens"] == 0


def test_health_shows_the_time_to_first_token(post):
    """``/health``: the last request's time to first token (from its turn on the worker: the prefill and the
    first decode step) beside its steady decode speed, and the mean over the requests that produced a token."""
    status, h = post("/health")
    assert status == 200 and h["last"] is None and h["ttft_s_mean"] is None and h["answered"] == 0
    body = {"model": MODEL, "prompt": "the cat sat", "max_tokens": 3, "temperature": 0}
    assert post("/v1/completions", body)[0] == 200
    last = post("/health")[1]["last"]
    assert last["completion_tokens"] == 3 and last["ttft_s"] >= last["prefill_s"] + last["first_token_s"] > 0
    assert last["decode_tok_s"] > 0
    assert post("/v1/completions", {**body, "prompt": "the dog sat on the log"})[0] == 200
    h = post("/health")[1]
    assert h["answered"] == 2 and h["ttft_s_mean"] == pytest.approx((last["ttft_s"] + h["last"]["ttft_s"]) / 2)


def test_any_model_name_is_served_unless_strict(engine):
    """Clients hard-code model names: the loaded model answers any (the reply names the served one); with
    strict_model_name another name is a 404 naming both. Tools in a completion request are a 400 (a chat field),
    not a silent plain-text answer; the defaults (text format, no tools) pass."""
    body = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
            "response_format": {"type": "text"}, "tools": [], "tool_choice": "none"}
    with _serving(create_app(Worker(engine), MODEL)) as post:
        status, reply = post("/v1/chat/completions", body)
        assert status == 200 and reply["model"] == MODEL
        status, reply = post("/v1/completions", {"model": "text-davinci-003", "prompt": "hi", "max_tokens": 2,
                                                 "tools": [{"type": "function", "function": {"name": "f"}}]})
        assert status == 400 and reply["error"]["param"] == "tools"
    with _serving(create_app(Worker(engine), MODEL, strict_model_name=True)) as post:
        status, reply = post("/v1/chat/completions", body)
        assert status == 404 and "gpt-4o-mini" in reply["error"]["message"] and MODEL in reply["error"]["message"]


def _stream(port: int, path: str, body: dict) -> list[dict]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        conn.request("POST", path, body=json.dumps({**body, "stream": True}),
                     headers={"content-type": "application/json"})
        text = conn.getresponse().read().decode()
    finally:
        conn.close()
    return [json.loads(line[6:]) for line in text.split("\n") if line.startswith("data: {")]


def test_logprobs_are_the_models_own(engine):
    """Greedy chat with logprobs and 3 alternatives: one entry a reply token (the end of turn left out), their
    texts laid end to end are the reply, each the best of its alternatives (sorted), and each log probability is
    log_softmax of the model's own logits there (a forward pass over the prompt and the reply's tokens); streamed,
    the chunks carry the same entries; completions give the parallel lists; top_logprobs alone is a 400."""
    import torch

    from ktquest.kv.dense import DenseKVCache

    messages = [{"role": "user", "content": "tell me about the sky"}]
    body = {"model": MODEL, "messages": messages, "max_tokens": 12, "temperature": 0, "logprobs": True,
            "top_logprobs": 3}
    with _serving(create_app(Worker(engine), MODEL)) as post:
        status, reply = post("/v1/chat/completions", body)
        assert status == 200, reply
        content = reply["choices"][0]["logprobs"]["content"]
        assert "".join(e["token"] for e in content) == reply["choices"][0]["message"]["content"]
        eos = reply["choices"][0]["finish_reason"] == "stop"
        assert len(content) == reply["usage"]["completion_tokens"] - eos
        for e in content:
            tops = [t["logprob"] for t in e["top_logprobs"]]
            assert len(tops) == 3 and tops == sorted(tops, reverse=True) and e["logprob"] == tops[0] <= 0
            assert e["bytes"] == list(e["token"].encode())
        streamed = [e for c in _stream(post.port, "/v1/chat/completions", body)
                    for e in ((c["choices"][0].get("logprobs") or {}).get("content") or [])]
        assert [e["token"] for e in streamed] == [e["token"] for e in content]  # (the prompt now cached: its
        assert all(abs(a["logprob"] - b["logprob"]) < 1e-4 for a, b in zip(streamed, content))  # sums split anew)
        status, comp = post("/v1/completions", {"model": MODEL, "prompt": "The sky is", "max_tokens": 6,
                                                "temperature": 0, "logprobs": 2})
        lp = comp["choices"][0]["logprobs"]
        assert "".join(lp["tokens"]) == comp["choices"][0]["text"] and len(lp["top_logprobs"][0]) <= 2
        assert lp["text_offset"] == [sum(map(len, lp["tokens"][:i])) for i in range(len(lp["tokens"]))]
        status, bad = post("/v1/chat/completions", {**body, "logprobs": False})
        assert status == 400 and "top_logprobs needs logprobs" in bad["error"]["message"]
    # the reference: the same greedy tokens through a forward pass over the prompt and the reply
    ids: list[int] = []
    prompt = engine.tokenizer.encode_chat(engine.tokenizer.apply_chat_template(messages))
    a = engine.model.args
    cache = DenseKVCache(a.n_layers, a.n_kv_heads, a.head_dim, 64)
    with torch.inference_mode():
        logits = engine.model(torch.tensor(prompt), 0, cache, last_only=True)[0]
        for e in content:
            lsm = torch.log_softmax(logits.float(), -1)
            token = int(lsm.argmax())
            ids.append(token)
            assert abs(float(lsm[token]) - e["logprob"]) < 2e-3
            logits = engine.model(torch.tensor([token]), cache.pos, cache)[0]
    assert engine.tokenizer.decode(ids) == reply["choices"][0]["message"]["content"]


def test_a_line_per_request_and_prometheus_metrics(engine, caplog):
    """Each request leaves one line on the ktquest.serve logger (answered: its tokens, time to first token and
    speed; refused: its status and message), and /metrics counts them in Prometheus' text format."""
    import logging

    caplog.set_level(logging.INFO, logger="ktquest.serve")
    with _serving(create_app(Worker(engine), MODEL)) as post:
        status, _ = post("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                                                  "max_tokens": 3})
        assert status == 200
        status, _ = post("/v1/chat/completions", {"model": MODEL, "messages": []})
        assert status == 400
        conn = http.client.HTTPConnection("127.0.0.1", post.port, timeout=60)
        conn.request("GET", "/metrics")
        r = conn.getresponse()
        text = r.read().decode()
        conn.close()
    assert r.status == 200 and r.getheader("content-type").startswith("text/plain")
    assert 'ktquest_requests_total{endpoint="/v1/chat/completions",status="200"} 1.0' in text
    assert 'ktquest_requests_total{endpoint="/v1/chat/completions",status="400"} 1.0' in text
    assert 'ktquest_tokens_total{kind="completion"}' in text and "ktquest_time_to_first_token_seconds_bucket" in text
    lines = [r.getMessage() for r in caplog.records if r.name == "ktquest.serve"]
    assert any(" /v1/chat/completions 200 prompt=" in x and " tok/s " in x for x in lines)
    assert any(x.startswith("/v1/chat/completions 400 ") for x in lines)


def test_the_chat_page(engine):
    """GET / is the chat page: one HTML file, nothing fetched from elsewhere (no URL to another host), talking to
    the server's own /v1/chat/completions with streamed replies and usage, model text put in as text only."""
    from ktquest.server.page import PAGE

    with _serving(create_app(Worker(engine), MODEL)) as post:
        conn = http.client.HTTPConnection("127.0.0.1", post.port, timeout=60)
        conn.request("GET", "/")
        r = conn.getresponse()
        html = r.read().decode()
        conn.close()
    assert r.status == 200 and r.getheader("content-type").startswith("text/html") and html == PAGE
    assert "/v1/chat/completions" in html and "stream: true" in html and "include_usage: true" in html
    assert "http://" not in html and "https://" not in html and "<script src" not in html
    assert "innerHTML" not in html and "textContent = reply" in html
