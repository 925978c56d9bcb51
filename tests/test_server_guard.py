"""``ktquest serve``'s guard (``ktquest/server/guard.py``): connections that send nothing, half a request head or
idle too long are closed, past ``--max-connections`` a request is answered 503 at once, and requests addressed
to another host (DNS rebinding), from another origin, or POSTed as anything but JSON are refused. A real uvicorn
server in a thread over the tiny llama, driven with raw sockets and ``http.client``."""

from __future__ import annotations

import contextlib
import dataclasses
import http.client
import json
import socket
import threading
import time
import types

import pytest
import uvicorn

import ktquest
from ktquest.cli import main
from ktquest.server.app import create_app
from ktquest.server.guard import GuardConfig
from ktquest.server.worker import Worker

HALF_HEAD = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n"  # no blank line: the head never ends


@pytest.fixture(scope="module")
def worker(tiny_llama):
    return Worker(ktquest.load(tiny_llama.path, max_seq_len=64, threads=1), 1)


@contextlib.contextmanager
def _serving(worker, **options):
    """A real server on 127.0.0.1 (an ephemeral port) with these GuardConfig options, as ``serve`` runs it."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    guard = GuardConfig(host="127.0.0.1", port=sock.getsockname()[1], **options)
    config = uvicorn.Config(create_app(worker, "tiny", guard=guard), log_level="warning", **guard.uvicorn_options())
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.02)
    try:
        yield guard
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


def _get(port: int, path: str = "/health", method: str = "GET", headers: dict | None = None,
         body: bytes | None = None, timeout: float = 10) -> tuple[int, dict, str]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        r = conn.getresponse()
        return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read().decode()
    finally:
        conn.close()


_OPEN: list[socket.socket] = []


@pytest.fixture(autouse=True)
def _close_sockets():
    yield
    while _OPEN:
        _OPEN.pop().close()


def _open(port: int, data: bytes = b"") -> socket.socket:
    """A raw connection, closed after the test whatever happens."""
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    _OPEN.append(s)
    if data:
        s.sendall(data)
    return s


def _closed_within(s: socket.socket, seconds: float) -> float:
    """How long until the server closed ``s`` (recv gives b""); fails if it is still open after ``seconds``."""
    t0 = time.monotonic()
    s.settimeout(seconds)
    try:
        while s.recv(4096):  # (a response first, for a connection that had a request)
            pass
    except TimeoutError:
        pytest.fail(f"the server did not close the connection within {seconds} s")
    return time.monotonic() - t0


# ---- connections ----


def test_silent_and_half_sent_connections_are_closed(worker):
    with _serving(worker, header_timeout=1, idle_timeout=30) as guard:
        silent = [_open(guard.port) for _ in range(3)]
        half = [_open(guard.port, HALF_HEAD) for _ in range(3)]
        assert _get(guard.port)[0] == 200  # served meanwhile
        for s in silent + half:
            assert _closed_within(s, 5) < 5


def test_half_head_after_a_response_is_closed(worker):
    """uvicorn's keep-alive timer is cancelled by any byte: a head begun after a response must still end."""
    with _serving(worker, header_timeout=1, idle_timeout=30) as guard:
        s = _open(guard.port, b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        time.sleep(0.3)  # the response
        s.sendall(HALF_HEAD)
        assert _closed_within(s, 5) < 5


def test_idle_keep_alive_connection_is_closed(worker):
    with _serving(worker, header_timeout=30, idle_timeout=1) as guard:
        s = _open(guard.port, b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        assert _closed_within(s, 3) < 3  # (uvicorn's default: 5 s)


def test_past_max_connections_a_request_is_answered_503_at_once(worker):
    with _serving(worker, header_timeout=30, idle_timeout=30, max_connections=3) as guard:
        held = [_open(guard.port) for _ in range(3)]
        time.sleep(0.2)  # accepted
        t0 = time.monotonic()
        assert _get(guard.port, timeout=5)[0] == 503 and time.monotonic() - t0 < 2
        for s in held:
            s.close()
        time.sleep(0.2)
        assert _get(guard.port)[0] == 200


def test_uvicorn_options():
    options = GuardConfig(header_timeout=2, idle_timeout=3, max_connections=7).uvicorn_options()
    assert options["timeout_keep_alive"] == 3 and options["limit_concurrency"] == 8
    assert options["http"].header_timeout == 2


# ---- hosts, origins, content types ----


@pytest.fixture(scope="module")
def served(worker):
    with _serving(worker, allow_hosts=("myhost.lan",), allow_origins=("http://localhost:3000",)) as guard:
        yield guard


def _error(reply: tuple[int, dict, str]) -> tuple[int, str, str]:
    status, _, text = reply
    err = json.loads(text)["error"]
    assert set(err) == {"message", "type", "param", "code"}
    return status, err["code"], err["message"]


@pytest.mark.parametrize("path, method", [("/health", "GET"), ("/v1/models", "GET"),
                                          ("/v1/chat/completions", "POST")])
def test_foreign_host_is_refused(served, path, method):
    status, code, message = _error(_get(served.port, path, method, {"Host": "evil.example:8080",
                                                                    "Content-Type": "application/json"}, b"{}"))
    assert status == 403 and code == "host_not_allowed"
    assert "'evil.example:8080'" in message and "--allow-host evil.example" in message


@pytest.mark.parametrize("host", ["localhost", "LOCALHOST:8080", "127.0.0.1", "127.0.0.1:1", "[::1]", "[::1]:8080",
                                  "myhost.lan:99"])
def test_own_hosts_are_served(served, host):
    assert _get(served.port, headers={"Host": host})[0] == 200


def test_hosts_when_bound_to_every_address():
    own = GuardConfig(host="0.0.0.0").hosts()
    assert socket.gethostname().lower() in own and "localhost" in own
    assert "192.168.1.5" not in GuardConfig().hosts() and "*" in GuardConfig(allow_hosts=("*",)).hosts()


def test_origins(served):
    port = served.port
    for origin in (f"http://localhost:{port}", f"http://127.0.0.1:{port}", f"http://[::1]:{port}",
                   "http://localhost:3000"):
        status, headers, _ = _get(port, headers={"Origin": origin})
        assert status == 200 and headers["access-control-allow-origin"] == origin, origin
    for origin in ("http://evil.example", f"http://localhost:{port + 1}", "null"):
        status, code, message = _error(_get(port, "/v1/models", headers={"Origin": origin}))
        assert status == 403 and code == "origin_not_allowed" and f"--allow-origin {origin}" in message
    assert "access-control-allow-origin" not in _get(port)[1]  # no Origin: no CORS headers


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data",
                                          None])
def test_post_that_is_not_json_is_refused(served, content_type):
    headers = {"Content-Type": content_type} if content_type else {}
    status, code, _ = _error(_get(served.port, "/v1/chat/completions", "POST", headers, b'{"model": "tiny"}'))
    assert status == 415 and code == "unsupported_media_type"


def test_post_as_json_passes(served):
    body = json.dumps({"model": "other", "messages": [{"role": "user", "content": "hi"}],
                       "tools": [{"type": "function", "function": {"name": "f"}}]}).encode()
    reply = _get(served.port, "/v1/chat/completions", "POST", {"Content-Type": "application/json; charset=utf-8"}, body)
    assert _error(reply)[:2] == (400, "invalid_tools")  # past the guard: the app's own answer (no tools template)


def test_preflight(served):
    asked = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "content-type"}
    status, headers, _ = _get(served.port, "/v1/chat/completions", "OPTIONS",
                              {"Origin": "http://localhost:3000", **asked})
    assert status == 204 and headers["access-control-allow-origin"] == "http://localhost:3000"
    assert "POST" in headers["access-control-allow-methods"]
    assert headers["access-control-allow-headers"] == "content-type"
    status, _, _ = _get(served.port, "/v1/chat/completions", "OPTIONS", {"Origin": "http://evil.example", **asked})
    assert status == 403


def test_any_host_and_origin(worker):
    with _serving(worker, allow_hosts=("*",), allow_origins=("*",)) as guard:
        status, headers, _ = _get(guard.port, headers={"Host": "anything.example", "Origin": "http://x.example"})
        assert status == 200 and headers["access-control-allow-origin"] == "*"


# ---- the serve flags ----


def test_flags_reach_the_server(monkeypatch):
    got = {}
    engine = types.SimpleNamespace(context_note=None, context_warning=None, state_note=None, weights="gguf",
                                   weights_note=None)  # (what the command reads of it)
    monkeypatch.setattr("ktquest.engine.load", lambda model, cfg: engine)
    monkeypatch.setattr("ktquest.server.serve", lambda *a, **k: got.update(k))
    assert main(["serve", "--port", "9000", "--header-timeout", "2.5", "--idle-timeout", "1", "--max-connections",
                 "12", "--allow-host", "MyHost.lan", "--allow-host", "[::2]", "--allow-origin",
                 "http://LOCALHOST:3000/", "--allow-origin", "*"]) == 0
    assert got["guard"] == GuardConfig(host="127.0.0.1", port=9000, allow_hosts=("myhost.lan", "::2"),
                                       allow_origins=("http://localhost:3000", "*"), header_timeout=2.5,
                                       idle_timeout=1, max_connections=12)
    main(["serve"])
    defaults = dataclasses.asdict(got["guard"])
    assert defaults == dataclasses.asdict(GuardConfig(port=8080))


@pytest.mark.parametrize("argv, needle", [
    (["--header-timeout", "0"], "--header-timeout 0.0: must be > 0"),
    (["--idle-timeout", "-1"], "--idle-timeout -1.0: must be > 0"),
    (["--header-timeout", "x"], "argument --header-timeout: invalid float value: 'x'"),
    (["--max-connections", "0"], "--max-connections 0: must be >= 1"),
    (["--allow-host", "http://evil.example"], "--allow-host 'http://evil.example': not a host name"),
    (["--allow-host", "a b"], "--allow-host 'a b': not a host name"),
    (["--allow-origin", "localhost:3000"], "--allow-origin 'localhost:3000': not an origin"),
    (["--allow-origin", "http://x.example/page"], "--allow-origin 'http://x.example/page': not an origin"),
])
def test_bad_flags_are_one_line_errors(monkeypatch, capsys, argv, needle):
    monkeypatch.setattr("ktquest.engine.load", lambda model, cfg: pytest.fail("loaded despite a bad flag"))
    assert main(["serve", *argv]) == 2
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert out == "" and len(lines) == 1 and lines[0].startswith("ktquest: error: ") and needle in lines[0], err
