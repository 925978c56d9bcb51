"""What keeps ``ktquest serve`` usable and private: connection limits (uvicorn's side) and a check of who is
asking (an ASGI middleware), both set by one ``GuardConfig`` (the serve flags).

Connections. A socket that sends nothing, or only part of a request head, holds a file descriptor; enough of
them and no one else gets in. uvicorn's h11 protocol (0.54) never closes such a socket: its keep-alive timer is
armed only after a response, and any byte received cancels it. ``GuardedH11Protocol`` (``connections.py``) adds one timer: a request
head must be complete within ``header_timeout`` of the connection opening or of its previous response, else the
connection is closed. An idle keep-alive connection is closed after ``idle_timeout`` (uvicorn's
``timeout_keep_alive``), and past ``max_connections`` open connections a request is answered 503 at once
(uvicorn's ``limit_concurrency``) instead of waiting.

Who is asking. A web page the user visits can send requests to a server on localhost: a "simple" cross-origin
request (a ``text/plain`` POST) needs no CORS preflight, and DNS rebinding makes the page's own host name point
at 127.0.0.1, so even the response is readable. ``HostOriginGuard`` therefore answers 403 to a ``Host`` that is
not the server's own (a rebinding page sends its own name) and to an ``Origin`` not allowed, and 415 to a POST
whose body is not declared ``application/json`` (so every cross-origin POST needs a preflight, which is answered
only for allowed origins). The server's own hosts: localhost, 127.0.0.1, [::1] and the bound ``--host``; bound
to every address (0.0.0.0 or ::), also this machine's name and any IP address (a browser sends an IP address
only when the page itself was loaded from that address, so rebinding cannot produce one). A request without
``Host`` (HTTP/1.0, not a browser) passes. The allowed origins: http://localhost:PORT, http://127.0.0.1:PORT,
http://[::1]:PORT and the bound host's, plus ``--allow-origin``s.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import re
import socket
import urllib.parse

LOOPBACK = ("localhost", "127.0.0.1", "::1")
WILDCARD = ("0.0.0.0", "::", "")
_NAME = re.compile(r"[a-z0-9_]([a-z0-9_.-]*[a-z0-9_])?")
PREFLIGHT_METHODS = "GET, POST, OPTIONS"
PREFLIGHT_HEADERS = "Authorization, Content-Type"


@dataclasses.dataclass(slots=True)
class GuardConfig:
    """The server's address (``host``, ``port``: what "its own" host and origins are) and the serve flags that
    limit connections and requests. ``"*"`` in ``allow_hosts`` / ``allow_origins`` allows any."""
    host: str = "127.0.0.1"
    port: int = 8080
    allow_hosts: tuple[str, ...] = ()
    allow_origins: tuple[str, ...] = ()
    header_timeout: float = 10.0  # seconds for a request head, from the connection opening or the last response
    idle_timeout: float = 5.0  # seconds a keep-alive connection may idle between requests
    max_connections: int = 100  # open connections served at once; a request past them is answered 503

    def __post_init__(self):
        for flag, value in (("--header-timeout", self.header_timeout), ("--idle-timeout", self.idle_timeout)):
            if not value > 0:
                raise ValueError(f"{flag} {value}: must be > 0 seconds")
        if self.max_connections < 1:
            raise ValueError(f"--max-connections {self.max_connections}: must be >= 1")
        self.allow_hosts = tuple(_allowed_host(h) for h in self.allow_hosts)
        self.allow_origins = tuple(_allowed_origin(o) for o in self.allow_origins)

    def hosts(self) -> set[str]:
        """Host names (lowercase, IPv6 without brackets) a request may address; ``"*"`` among them: any."""
        own = {*LOOPBACK, *self.allow_hosts}
        bound = _plain_host(self.host)
        if bound in WILDCARD:
            own |= {socket.gethostname().lower(), socket.getfqdn().lower()}
        else:
            own.add(bound)
        return own

    def origins(self) -> set[str]:
        """Origins (``scheme://host[:port]``, lowercase) whose pages may call the server; ``"*"``: any."""
        names = {*LOOPBACK} | (set() if _plain_host(self.host) in WILDCARD else {_plain_host(self.host)})
        return {f"http://{_bracketed(n)}:{self.port}" for n in names} | set(self.allow_origins)

    def uvicorn_options(self) -> dict:
        """``uvicorn.Config`` / ``uvicorn.run`` keywords for the connection limits."""
        from ktquest.server.connections import GuardedH11Protocol  # (uvicorn: only where a server starts)

        protocol = type("GuardedH11Protocol", (GuardedH11Protocol,), {"header_timeout": self.header_timeout})
        # uvicorn answers 503 once the open connections (this one counted) reach limit_concurrency
        return {"http": protocol, "timeout_keep_alive": self.idle_timeout,
                "limit_concurrency": self.max_connections + 1}


class HostOriginGuard:
    """ASGI middleware: 403 for a Host or Origin that is not allowed, 415 for a POST that is not JSON, CORS
    preflights answered for allowed origins, and their responses marked readable by them. ``error``: the
    server's error (``intake.APIError``: ``error(status, message, type, code=...).response()``)."""

    def __init__(self, app, config: GuardConfig, error):
        self.app, self.config, self.error = app, config, error
        self.hosts, self.origins = config.hosts(), config.origins()
        self.any_ip = _plain_host(config.host) in WILDCARD

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        problem = self._refusal(scope["method"], headers)
        if problem is not None:
            return await problem(scope, receive, send)
        origin = headers.get("origin")
        if origin is None:
            return await self.app(scope, receive, send)
        cors = [(b"access-control-allow-origin", b"*" if "*" in self.origins else origin.encode("latin-1")),
                (b"vary", b"Origin")]
        if scope["method"] == "OPTIONS" and "access-control-request-method" in headers:  # a CORS preflight
            asked = headers.get("access-control-request-headers", "").strip()
            return await _respond(send, 204, cors + [
                (b"access-control-allow-methods", PREFLIGHT_METHODS.encode()),
                (b"access-control-allow-headers", (asked or PREFLIGHT_HEADERS).encode("latin-1")),
                (b"access-control-max-age", b"600")])

        async def send_with_cors(message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), *cors]}
            await send(message)
        await self.app(scope, receive, send_with_cors)

    def _refusal(self, method: str, headers: dict[str, str]):
        """The error response for a request refused here, else None."""
        host, origin = headers.get("host"), headers.get("origin")
        if host is not None and not self._host_allowed(host):
            return self.error(403, f"Host {host!r} is not this server's (refused against DNS rebinding); allow it "
                                   f"with --allow-host {_plain_host(_strip_port(host)) or host}",
                              "permission_error", code="host_not_allowed").response()
        if origin is not None and "*" not in self.origins and origin.lower().rstrip("/") not in self.origins:
            return self.error(403, f"Origin {origin!r} is not allowed to call this server; allow it with "
                                   f"--allow-origin {origin}", "permission_error", code="origin_not_allowed").response()
        kind = headers.get("content-type", "").split(";")[0].strip().lower()
        if method == "POST" and kind != "application/json":
            return self.error(415, f"Content-Type {kind or '(none)'!r}: the body must be sent as 'application/json'",
                              param="content-type", code="unsupported_media_type").response()
        return None

    def _host_allowed(self, host: str) -> bool:
        name = _plain_host(_strip_port(host))
        return "*" in self.hosts or name in self.hosts or (self.any_ip and _is_ip(name))


async def _respond(send, status: int, headers: list[tuple[bytes, bytes]]) -> None:
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": b""})


def _strip_port(host: str) -> str:
    """``name:port`` -> ``name``, ``[v6]:port`` -> ``[v6]``; a bare IPv6 address is left whole."""
    host = host.strip()
    if host.startswith("["):
        return host[:host.find("]") + 1] if "]" in host else host
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


def _plain_host(host: str) -> str:
    """Lowercase, IPv6 without brackets, no trailing dot."""
    return host.strip().lower().removeprefix("[").removesuffix("]").rstrip(".")


def _bracketed(name: str) -> str:
    return f"[{name}]" if ":" in name else name


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
        return True
    except ValueError:
        return False


def _allowed_host(value: str) -> str:
    name = _plain_host(value)
    if value.strip() == "*" or _is_ip(name) or _NAME.fullmatch(name):
        return "*" if value.strip() == "*" else name
    raise ValueError(f"--allow-host {value!r}: not a host name or IP address (give it without a scheme or port, "
                     "e.g. --allow-host myhost.lan, or * for any)")


def _allowed_origin(value: str) -> str:
    if value.strip() == "*":
        return "*"
    u = urllib.parse.urlsplit(value.strip().lower().rstrip("/"))
    try:
        u.port  # noqa: B018 (raises on a bad port)
        ok = u.scheme in ("http", "https") and u.hostname and not (u.path or u.query or u.fragment or u.username)
    except ValueError:
        ok = False
    if not ok:
        raise ValueError(f"--allow-origin {value!r}: not an origin (scheme://host[:port], e.g. "
                         "--allow-origin http://localhost:3000, or * for any)")
    return u.geturl()
