#!/usr/bin/env python3
"""A stand-in of the Hugging Face hub's HTTP API on 127.0.0.1, for ``ktquest pull`` without a network: the
model-info endpoint and ``resolve/<main or the commit>/<file>`` with the headers huggingface_hub reads
(X-Repo-Commit, ETag / X-Linked-Etag = an LFS file's sha256, X-Linked-Size, Content-Length, Range). It counts
the requests and can cut a download, lie about a checksum or a size (what tests/test_hub.py checks ``pull``
against), or move to another commit (``commit``).

    python tools/hub_standin.py --port 8765 local/SmolLM2-135M-Instruct-GGUF=path/to/dir
    HF_ENDPOINT=http://127.0.0.1:8765 ktquest pull local/SmolLM2-135M-Instruct-GGUF:Q4_K_M

Each ``REPO=PATH`` serves a file, or every file in a directory (names relative to it), as that repository.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import socket
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

COMMIT = "0123456789abcdef0123456789abcdef01234567"
RESOLVE = re.compile(r"^/(?P<repo>[^/]+/[^/]+)/resolve/(?P<revision>[^/]+)/(?P<file>.+)$")


class HubStandin(ThreadingHTTPServer):
    """The server; ``repos`` maps "owner/name" to {file name: bytes}."""

    daemon_threads = True

    def __init__(self, port: int = 0):
        super().__init__(("127.0.0.1", port), _Handler)
        self.repos: dict[str, dict[str, bytes]] = {}
        self.requests: list[tuple[str, str, str | None]] = []  # (method, path, Range)
        self.cut_once: set[str] = set()  # files whose first GET is cut off mid-body
        self.bad_sha: set[str] = set()  # files whose ETag is not their content's sha256
        self.bad_size: set[str] = set()  # files whose X-Linked-Size is 10 bytes more than they are
        self.commit = COMMIT  # the commit every repository is at (X-Repo-Commit, the model info's "sha")
        self.lock = threading.Lock()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class _Handler(BaseHTTPRequestHandler):
    server: HubStandin

    def log_message(self, *args) -> None:  # quiet
        pass

    def do_HEAD(self) -> None:
        self._serve(body=False)

    def do_GET(self) -> None:
        self._serve(body=True)

    def _serve(self, body: bool) -> None:
        s = self.server
        with s.lock:
            s.requests.append((self.command, self.path, self.headers.get("Range")))
        path = self.path.split("?")[0]
        if path.startswith("/api/models/"):
            repo = path.removeprefix("/api/models/").split("/revision/")[0]
            if repo not in s.repos:
                return self._reply(404, b'{"error": "not found"}', {"X-Error-Code": "RepoNotFound"})
            info = {"id": repo, "modelId": repo, "sha": s.commit, "private": False,
                    "siblings": [{"rfilename": f} for f in s.repos[repo]]}
            return self._reply(200, json.dumps(info).encode(), {"Content-Type": "application/json"}, body)
        m = RESOLVE.match(path)
        if m is None or m["revision"] not in ("main", s.commit):  # (only the current commit is served)
            return self._reply(404, b"", {"X-Error-Code": "RevisionNotFound"}, body)
        repo, file = m["repo"], m["file"]
        data = s.repos.get(repo, {}).get(file)
        if data is None:
            return self._reply(404, b"", {"X-Error-Code": "EntryNotFound", "X-Repo-Commit": s.commit}, body)
        sha = hashlib.sha256(data + b"x" * (file in s.bad_sha)).hexdigest()
        size = len(data) + 10 * (file in s.bad_size)
        headers = {"X-Repo-Commit": s.commit, "ETag": f'"{sha}"', "X-Linked-Etag": f'"{sha}"',
                   "X-Linked-Size": str(size), "Accept-Ranges": "bytes"}
        if not body:
            return self._reply(200, b"", {**headers, "Content-Length": str(len(data))}, False)
        start = int(self.headers["Range"].split("=")[1].split("-")[0]) if self.headers.get("Range") else 0
        if file in s.cut_once:
            s.cut_once.discard(file)
            self.send_response(200)
            for k, v in {**headers, "Content-Length": str(len(data))}.items():
                self.send_header(k, v)
            self.end_headers()
            self.wfile.write(data[: len(data) // 2])
            self.wfile.flush()
            self.connection.shutdown(socket.SHUT_RDWR)
            return
        if start:
            headers["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
        self._reply(206 if start else 200, data[start:], headers)

    def _reply(self, status: int, data: bytes, headers: dict, body: bool = True) -> None:
        self.send_response(status)
        headers.setdefault("Content-Length", str(len(data)))
        for k, v in headers.items():
            self.send_header(k, v)
        self.end_headers()
        if body:
            self.wfile.write(data)


def _files(path: Path) -> dict[str, bytes]:
    if path.is_file():
        return {path.name: path.read_bytes()}
    return {p.relative_to(path).as_posix(): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("repos", nargs="+", metavar="REPO=PATH", help="owner/name=a file or a directory")
    ap.add_argument("--port", type=int, default=8765)
    args = ap.parse_args()
    server = HubStandin(args.port)
    for spec in args.repos:
        repo, _, path = spec.partition("=")
        if repo.count("/") != 1 or not path or not Path(path).exists():
            ap.error(f"{spec!r}: expected owner/name=PATH, PATH a file or a directory")
        server.repos[repo] = _files(Path(path))
        print(f"{repo}: {', '.join(server.repos[repo])}", file=sys.stderr)
    print(f"serving on {server.url} (HF_ENDPOINT={server.url})", file=sys.stderr, flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
