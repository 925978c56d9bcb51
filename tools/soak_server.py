#!/usr/bin/env python3
"""Soak of ``ktquest serve``: a real server (a subprocess) under concurrent clients for many mixed requests,
its resident memory read as they go; it must stay flat, and nothing may fail that should not.

The server: the bundled model (--model), a small context (--set max_seq_len=2048), --slots 2, a free port,
started from a KV file (``--load-kv``) of a document that ``ktquest chat --prompt-file DOC --save-kv F`` wrote
first, so questions about the document start from loaded KV. The server has no endpoint to load a KV file
while it runs, so the KV loads are server starts: the main run is one server started from the file, and
--kv-restarts more servers are started from the same file afterwards, each asked --kv-requests questions
about the document (the first must find the document's tokens cached: ``usage.prompt_tokens_details``).

The main run: --clients threads (stdlib http.client) share --requests requests, a fixed mix drawn by request
number (--seed): chat and text completions, streamed or not, max_tokens 8..--max-tokens, prompts that begin
with the document (prefix reuse) and short ones that do not, streams whose client closes the connection after
the first SSE chunk (deliberate disconnects), and malformed requests (a body that is not JSON, fields of the
wrong type, a missing field, an unknown model) that must be answered 4xx. Every request sends
``Host: 127.0.0.1:PORT``, ``Content-Type: application/json`` and ``Authorization: Bearer soak-key-<client>``.

The server's VmRSS (/proc/PID/status) is read every --every requests after --warmup; the report gives it at
the start and end, its maximum, and the least-squares slope in MiB per 100 requests. Unexpected: a 5xx, a
well-formed request not answered 200 (or a stream without ``[DONE]``), a malformed one not answered 4xx, a
connection error other than the deliberate disconnects, "Traceback" in the server's stderr, a server that
exits. Exit status 1 when the slope passes --max-slope or anything unexpected happened. Example:

    python tools/soak_server.py --requests 500 --clients 4 --json docs/results/issue60/soak_server.json
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import stdlib_text, write_json

REPO = Path(__file__).resolve().parent.parent
QUESTIONS = ["What does this code do?", "Name one function defined above.", "Summarize it in one line.",
             "Which module is imported first?", "Is there a class above? Name it."]
SHORT = ["Tell me a fact about the number {i}.", "Say hello in three words.", "What is {i} plus {i}?",
         "Name a colour.", "Write one short sentence about rivers."]
# (name, body, why it is malformed): each must be answered 4xx
MALFORMED = [
    ("not-json", b'{"model": "m", "messages": [', "the body is not JSON"),
    ("max_tokens-string", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": "ten"}, "wrong type"),
    ("messages-string", {"messages": "hi", "max_tokens": 8}, "wrong type"),
    ("no-messages", {"max_tokens": 8}, "missing field"),
    ("prompt-object", {"prompt": {"text": "hi"}, "max_tokens": 8, "_completion": True}, "wrong type"),
    ("unknown-model", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "model": "nope"},
     "unknown model"),
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def slope_per_100(xs: list[int], ys: list[float]) -> float:
    n = len(xs)
    if n < 2:
        return 0.0
    mx, my = sum(xs) / n, sum(ys) / n
    var = sum((x - mx) ** 2 for x in xs)
    return 100 * sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var if var else 0.0


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "ktquest.cli", *args]


def env() -> dict:
    return dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))


class Server:
    """``ktquest serve`` as a subprocess, its stderr in a file; ready once /health answers."""

    def __init__(self, args, kv: str | None, log: Path):
        self.port = free_port()
        self.model = args.model
        cmd = cli("serve", "--model", args.model, "--port", str(self.port), "--slots", str(args.slots),
                  *[a for kv_ in args.sets for a in ("--set", kv_)])
        if kv:
            cmd += ["--load-kv", kv]
        self.cmd = cmd
        self.log = log
        self.err = open(log, "w")  # noqa: SIM115 (closed by close())
        t0 = time.perf_counter()
        self.proc = subprocess.Popen(cmd, env=env(), stdout=subprocess.DEVNULL, stderr=self.err)
        deadline = time.monotonic() + args.start_timeout
        while True:
            try:
                status, body = self.request("GET", "/health", None, timeout=5)
                if status == 200 and json.loads(body)["status"] == "ok":
                    break
            except (OSError, http.client.HTTPException, ValueError):
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.close()
                raise RuntimeError(f"the server did not start ({' '.join(cmd)}):\n{log.read_text()[-3000:]}")
            time.sleep(0.25)
        self.start_s = time.perf_counter() - t0

    def headers(self, client: int | str) -> dict:
        return {"Host": f"127.0.0.1:{self.port}", "Content-Type": "application/json",
                "Authorization": f"Bearer soak-key-{client}"}

    def request(self, method: str, path: str, body: bytes | None, client: int | str = "main", timeout=600):
        c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            c.request(method, path, body, self.headers(client))
            r = c.getresponse()
            return r.status, r.read()
        finally:
            c.close()

    def health(self) -> dict:
        return json.loads(self.request("GET", "/health", None)[1])

    def tracebacks(self) -> int:
        self.err.flush()
        return self.log.read_text(errors="replace").count("Traceback")

    def close(self) -> int | None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.err.close()
        return self.proc.returncode


def plan(i: int, seed: int, max_tokens: int, doc: str) -> dict:
    """Request ``i`` of the mix: {"kind", "path", "body" (bytes), "stream", "expect", "disconnect"}."""
    rng = random.Random(f"{seed}:{i}")
    if i % 25 == 7:  # 4 %: malformed, expected 4xx
        name, body, _ = MALFORMED[(i // 25) % len(MALFORMED)]
        body = dict(body) if isinstance(body, dict) else body  # (the model is added by send)
        completion = isinstance(body, dict) and body.pop("_completion", False)
        path = "/v1/completions" if completion else "/v1/chat/completions"
        return {"kind": f"malformed:{name}", "path": path, "body": body, "stream": False, "expect": "4xx", "disconnect": False}
    chat = rng.random() < 0.6
    with_doc = rng.random() < 0.5
    disconnect = i % 12 == 5  # ~8 %: the client leaves after the first chunk
    stream = disconnect or rng.random() < 0.5
    n = rng.randint(8, max(8, max_tokens))
    q = QUESTIONS[rng.randrange(len(QUESTIONS))] if with_doc else SHORT[rng.randrange(len(SHORT))].format(i=i)
    body = {"max_tokens": n, "stream": stream, "temperature": rng.choice([0, 0.7])}
    if stream and rng.random() < 0.5:
        body["stream_options"] = {"include_usage": True}
    if chat:
        body["messages"] = [{"role": "user", "content": f"{doc}\n\n{q}" if with_doc else q}]
    else:
        body["prompt"] = f"{doc}\n\nQ: {q}\nA:" if with_doc else f"Q: {q}\nA:"
    kind = f"{'chat' if chat else 'completion'}{'+doc' if with_doc else ''}" \
           f"{'+disconnect' if disconnect else '+stream' if stream else ''}"
    return {"kind": kind, "path": "/v1/chat/completions" if chat else "/v1/completions", "body": body,
                "stream": stream, "expect": "200", "disconnect": disconnect}


def send(srv: Server, model: str, client: int, req: dict) -> dict:
    """One request: {"status", "outcome", "detail", "cached", "seconds"}; outcome ok/disconnected/unexpected."""
    body = req["body"]
    if isinstance(body, dict):
        body = json.dumps({"model": model, **body}).encode()
    t0 = time.perf_counter()
    out = {"kind": req["kind"], "status": None, "outcome": "unexpected", "detail": "", "cached": None}
    c = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=600)
    try:
        c.request("POST", req["path"], body, srv.headers(client))
        r = c.getresponse()
        out["status"] = r.status
        if req["expect"] == "4xx":
            data = r.read()
            good = 400 <= r.status < 500 and "error" in json.loads(data)
            out.update(outcome="ok" if good else "unexpected", detail="" if good else data[:300].decode(errors="replace"))
        elif r.status != 200:
            out["detail"] = r.read()[:300].decode(errors="replace")
        elif not req["stream"]:
            data = json.loads(r.read())
            ok = bool(data.get("choices")) and "usage" in data
            out.update(outcome="ok" if ok else "unexpected", detail="" if ok else str(data)[:300],
                       cached=((data.get("usage") or {}).get("prompt_tokens_details") or {}).get("cached_tokens"))
        else:
            done = False
            while line := r.readline():
                if not line.startswith(b"data: "):
                    continue
                if req["disconnect"]:  # the first chunk: leave mid-stream
                    c.sock.shutdown(socket.SHUT_RDWR)
                    c.close()
                    out["outcome"] = "disconnected"
                    break
                if line.strip() == b"data: [DONE]":
                    done = True
                    break
                event = json.loads(line[6:])
                if "error" in event:
                    out["detail"] = str(event)[:300]
                    break
                if event.get("usage"):
                    out["cached"] = (event["usage"].get("prompt_tokens_details") or {}).get("cached_tokens")
            if not req["disconnect"]:
                out["outcome"] = "ok" if done else "unexpected"
                if not done and not out["detail"]:
                    out["detail"] = "the stream ended without [DONE]"
    except (OSError, http.client.HTTPException, ValueError) as e:
        out["detail"] = f"{type(e).__name__}: {e}"
    finally:
        c.close()
    out["seconds"] = time.perf_counter() - t0
    return out


def soak(srv: Server, args, doc: str) -> dict:
    lock = threading.Lock()
    state = {"next": 0, "done": 0}
    results: list[dict] = []
    xs: list[int] = []
    ys: list[float] = []

    def client(k: int) -> None:
        while True:
            with lock:
                i = state["next"]
                if i >= args.requests or srv.proc.poll() is not None:
                    return
                state["next"] += 1
            res = send(srv, args.model, k, plan(i, args.seed, args.max_tokens, doc))
            res.update(request=i, client=k)
            with lock:
                results.append(res)
                state["done"] += 1
                n = state["done"]
                if n >= args.warmup and (n - args.warmup) % args.every == 0 and srv.proc.poll() is None:
                    xs.append(n)
                    ys.append(rss_mib(srv.proc.pid))
                if n % 50 == 0:
                    bad = sum(r["outcome"] == "unexpected" for r in results)
                    print(f"  {n:>4} requests, {time.perf_counter() - t0:6.0f} s, RSS "
                          f"{rss_mib(srv.proc.pid) if srv.proc.poll() is None else float('nan'):.1f} MiB, "
                          f"{bad} unexpected", flush=True)

    rss_start = rss_mib(srv.proc.pid)
    t0 = time.perf_counter()
    threads = [threading.Thread(target=client, args=(k,), daemon=True) for k in range(args.clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    seconds = time.perf_counter() - t0
    time.sleep(1.0)  # let the last cancelled generations end before the final reading
    alive = srv.proc.poll() is None
    health = srv.health() if alive else None
    rss_end = rss_mib(srv.proc.pid) if alive else None
    return {"results": results, "xs": xs, "ys": ys, "seconds": seconds, "rss_before_mib": rss_start, "rss_final_mib": rss_end,
                "health": health, "alive": alive}


def kv_restarts(args, kv: str, doc: str, logdir: Path) -> list[dict]:
    """--kv-restarts servers started from the KV file, each asked --kv-requests questions about the document."""
    rows = []
    for k in range(args.kv_restarts):
        srv = Server(args, kv, logdir / f"kv_restart_{k}.log")
        try:
            res = [send(srv, args.model, f"kv{k}", {
                "kind": "chat+doc", "path": "/v1/chat/completions", "stream": False, "expect": "200", "disconnect": False,
                "body": {"messages": [{"role": "user", "content": f"{doc}\n\n{QUESTIONS[(k + j) % len(QUESTIONS)]}"}],
                      "max_tokens": 8 + j, "temperature": 0}}) for j in range(args.kv_requests)]
            rss = rss_mib(srv.proc.pid)
            tb = srv.tracebacks()
        finally:
            srv.close()
        row = {"restart": k, "start_s": round(srv.start_s, 2), "rss_mib": round(rss, 1), "tracebacks": tb,
                   "statuses": [r["status"] for r in res], "first_cached_tokens": res[0]["cached"],
                   "unexpected": [r for r in res if r["outcome"] != "ok"]}
        if not row["first_cached_tokens"]:
            row["unexpected"].append({"detail": "the first question after --load-kv found nothing cached"})
        print(f"  KV restart {k}: up in {row['start_s']:.1f} s, statuses {row['statuses']}, first request "
              f"{row['first_cached_tokens']} tokens cached, RSS {row['rss_mib']:.1f} MiB", flush=True)
        rows.append(row)
    return rows


def make_kv(args, doc_path: Path, kv: Path) -> float:
    t0 = time.perf_counter()
    cmd = cli("chat", "--model", args.model, "--prompt-file", str(doc_path), "--save-kv", str(kv),
              "--message", "hi", "--max-new-tokens", "4", *[a for kv_ in args.sets for a in ("--set", kv_)])
    p = subprocess.run(cmd, env=env(), capture_output=True, text=True, timeout=600, check=False)
    if p.returncode != 0 or not kv.is_file():
        raise RuntimeError(f"{' '.join(cmd)} failed ({p.returncode}):\n{p.stderr[-3000:]}")
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--set", action="append", dest="sets", metavar="KEY=VALUE",
                    help="a config override for the server (default: max_seq_len=2048 threads=2)")
    ap.add_argument("--slots", type=int, default=2)
    ap.add_argument("--requests", type=int, default=500)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=32, help="max_tokens is drawn from 8..N")
    ap.add_argument("--doc-chars", type=int, default=3000, help="the shared document, characters of code")
    ap.add_argument("--warmup", type=int, default=50, help="requests before the first memory reading")
    ap.add_argument("--every", type=int, default=10, help="requests between two memory readings")
    ap.add_argument("--max-slope", type=float, default=1.0, help="MiB per 100 requests allowed")
    ap.add_argument("--kv-restarts", type=int, default=3, help="servers started again from the KV file after")
    ap.add_argument("--kv-requests", type=int, default=3, help="questions each of those answers")
    ap.add_argument("--seed", type=int, default=60)
    ap.add_argument("--start-timeout", type=float, default=300, help="seconds a server may take to answer /health")
    ap.add_argument("--keep-logs", metavar="DIR", help="keep the servers' stderr here (default: a temp dir)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    args.sets = args.sets or ["max_seq_len=2048", "threads=2"]

    tmp = tempfile.TemporaryDirectory(prefix="soak_server_")
    logdir = Path(args.keep_logs or tmp.name)
    logdir.mkdir(parents=True, exist_ok=True)
    doc = stdlib_text(args.doc_chars)[:args.doc_chars]
    doc_path, kv = Path(tmp.name) / "doc.txt", Path(tmp.name) / "doc.kv"
    doc_path.write_text(doc)
    t_all = time.perf_counter()
    kv_s = make_kv(args, doc_path, kv)
    print(f"KV file of the document ({len(doc):,} chars): {kv.stat().st_size / 2**20:.1f} MiB in {kv_s:.1f} s",
          flush=True)

    srv = Server(args, str(kv), logdir / "server.log")
    print(f"server pid {srv.proc.pid} on port {srv.port}, up in {srv.start_s:.1f} s: {' '.join(srv.cmd)}",
          flush=True)
    try:
        run = soak(srv, args, doc)
        tracebacks = srv.tracebacks()
    finally:
        code = srv.close()
    results, xs, ys = run["results"], run["xs"], run["ys"]
    unexpected = [r for r in results if r["outcome"] == "unexpected"]
    server_5xx = [r for r in results if (r["status"] or 0) >= 500]
    restarts = kv_restarts(args, str(kv), doc, logdir) if run["alive"] else []
    wall = time.perf_counter() - t_all

    statuses = Counter(str(r["status"]) for r in results)
    kinds = Counter(r["kind"].split(":")[0] for r in results)
    slope = slope_per_100(xs, ys)
    print(f"\n{'kind':<28}{'count':>6}")
    for k, n in sorted(kinds.items()):
        print(f"{k:<28}{n:>6}")
    print(f"\nstatus {dict(sorted(statuses.items()))}, deliberate disconnects "
          f"{sum(r['outcome'] == 'disconnected' for r in results)}, unexpected {len(unexpected)} "
          f"(5xx {len(server_5xx)}), Tracebacks in the server's stderr {tracebacks}, server alive at the end "
          f"{run['alive']}")
    if ys:
        print(f"RSS {ys[0]:.1f} MiB after {xs[0]} requests -> {ys[-1]:.1f} MiB after {xs[-1]} (max {max(ys):.1f}), "
              f"slope {slope:+.3f} MiB per 100 requests (limit {args.max_slope}); {len(results)} requests in "
              f"{run['seconds']:.0f} s ({len(results) / run['seconds']:.2f}/s)")
    for r in unexpected[:10]:
        print(f"  unexpected: request {r['request']} {r['kind']}: status {r['status']} {r['detail']}")
    restart_bad = [u for row in restarts for u in row["unexpected"]] + \
        [f"restart {row['restart']}: Traceback" for row in restarts if row["tracebacks"]]
    failures = []
    if slope > args.max_slope:
        failures.append(f"RSS slope {slope:+.3f} MiB/100 requests > {args.max_slope}")
    if unexpected:
        failures.append(f"{len(unexpected)} unexpected responses")
    if tracebacks:
        failures.append(f"{tracebacks} Tracebacks in the server's stderr")
    if not run["alive"] or len(results) < args.requests:
        failures.append(f"the server exited ({code}) after {len(results)} requests")
    if restart_bad:
        failures.append(f"{len(restart_bad)} problems after KV restarts")
    print("PASS" if not failures else "FAIL: " + "; ".join(failures), f"(wall {wall:.0f} s)")

    if args.json:
        write_json(args.json, {
            "command": " ".join(["python", "tools/soak_server.py", *(argv if argv is not None else sys.argv[1:])]),
            "server_command": " ".join(srv.cmd[2:]), "model": args.model, "sets": args.sets, "slots": args.slots,
            "clients": args.clients, "requests": args.requests, "max_tokens": args.max_tokens,
            "doc_chars": args.doc_chars, "kv_file_mib": round(kv.stat().st_size / 2**20, 2),
            "server_start_s": round(srv.start_s, 2), "seconds": round(run["seconds"], 1),
            "wall_s": round(wall, 1), "requests_per_s": round(len(results) / run["seconds"], 3),
            "kinds": dict(sorted(kinds.items())), "statuses": dict(sorted(statuses.items())),
            "disconnects": sum(r["outcome"] == "disconnected" for r in results),
            "malformed_4xx": sum(r["kind"].startswith("malformed") and r["outcome"] == "ok" for r in results),
            "unexpected": [{k: r[k] for k in ("request", "kind", "status", "detail")} for r in unexpected],
            "tracebacks": tracebacks, "server_alive_at_end": run["alive"],
            "rss": {"warmup_requests": args.warmup, "every": args.every, "points": len(ys),
                    "before_mib": round(run["rss_before_mib"], 1),
                    "start_mib": round(ys[0], 1) if ys else None, "end_mib": round(ys[-1], 1) if ys else None,
                    "final_idle_mib": round(run["rss_final_mib"], 1) if run["rss_final_mib"] else None,
                    "max_mib": round(max(ys), 1) if ys else None,
                    "slope_mib_per_100": round(slope, 4), "max_slope": args.max_slope,
                    "series": [[x, round(y, 2)] for x, y in zip(xs, ys)]},
            "health_at_end": run["health"], "kv_restarts": restarts,
            "passed": not failures, "failures": failures})
    tmp.cleanup()
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
