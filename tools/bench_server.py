#!/usr/bin/env python3
"""``ktquest serve`` measured as a client sees it: time to first token with and without the reused prefix,
and resident memory over many sequential requests.

- ttft (per --lengths N): a fresh server gets a question about a document of about N tokens (cold: the whole
  prompt is read), then another question about the same document (reused: the server rewinds to the common
  prefix and reads the new question alone); both streamed, the time from sending the request to the first
  piece of text, with the prompt and cached token counts the server reports, and the server's own time to
  first token (``/health``'s ``last.ttft_s``: from the request taken up to its first token, no HTTP or queue).
- memory (--sequential K): K requests one after another on one server (questions about a document, new
  conversations, follow-ups, streamed or not, stop strings, max_tokens), the server's VmRSS after each; the
  report gives it after a warm-up of 10, at the end, its maximum, the least-squares slope per 100 requests,
  and the requests that failed.

    python tools/bench_server.py --model smollm2-135m --lengths 8192 --json docs/results/bench_server_smollm2.json
    python tools/bench_server.py --model gemma3-270m --lengths 32768 --config configs/snapkv.yaml
    python tools/bench_server.py --sequential 200 --lengths 0 --json docs/results/bench_server_soak.json
    python tools/bench_server.py --model /work/shaped/qwen3.5-0.8b-q4_k_m.gguf --lengths 16384 --peer llama.cpp

``--peer llama.cpp`` runs llama-cpp-python's OpenAI server (``python -m llama_cpp.server``, its extras
installed) on the same GGUF, context and threads beside it, the same two requests, one server at a time: the
peer's row has what a client sees (its own prompt-cache reuse, whatever it can do for the model).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import context_tokens, write_json  # noqa: E402

from ktquest.cli import served_model_id  # noqa: E402
from ktquest.formats.tokenizer import Tokenizer  # noqa: E402
from ktquest.hub import resolve_model  # noqa: E402
from ktquest.models.loader import read_gguf  # noqa: E402

REPO = Path(__file__).resolve().parent.parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    ready_path = "/health"

    def __init__(self, model: str, config: str | None, threads: int, sets: list[str]):
        self.port = _free_port()
        cmd = [sys.executable, "-m", "ktquest.cli", "serve", "--model", model, "--port", str(self.port),
               "--slots", "1", "--set", f"threads={threads}"] + [a for kv in sets for a in ("--set", kv)]
        if config:
            cmd += ["--config", config]
        self._start(cmd, model)

    def _start(self, cmd: list[str], model: str) -> None:
        env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
        self.proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        self.model = served_model_id(model)  # what the server calls it
        deadline = time.monotonic() + 300
        while True:
            try:
                if self.ready():
                    return
            except OSError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.proc.kill()
                raise RuntimeError(f"the server did not start: {self.proc.stderr.read()}")
            time.sleep(0.2)

    def ready(self) -> bool:
        return self.get("/health")["status"] == "ok"

    def get(self, path: str) -> dict:
        c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=10)
        try:
            c.request("GET", path)
            return json.loads(c.getresponse().read())
        finally:
            c.close()

    def chat(self, messages: list[dict], max_tokens: int, stream: bool, **kw) -> dict:
        """One request: {"ttft_s", "total_s", "text", "usage", "status"}; the usage asked for when streamed."""
        body = {"model": self.model, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
                "stream": stream, **kw}
        if stream:
            body["stream_options"] = {"include_usage": True}
        c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=3600)
        t0 = time.perf_counter()
        try:
            c.request("POST", "/v1/chat/completions", json.dumps(body), {"content-type": "application/json"})
            r = c.getresponse()
            if not stream or r.status != 200:
                out = json.loads(r.read())
                return {"status": r.status, "ttft_s": None, "total_s": time.perf_counter() - t0,
                        "text": out["choices"][0]["message"]["content"] if r.status == 200 else out,
                        "usage": out.get("usage")}
            ttft, text, usage = None, "", None
            while line := r.readline():
                if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if event.get("usage"):
                    usage = event["usage"]
                for ch in event.get("choices", []):
                    piece = ch["delta"].get("content")
                    if piece and ttft is None:
                        ttft = time.perf_counter() - t0
                    text += piece or ""
            return {"status": r.status, "ttft_s": ttft, "total_s": time.perf_counter() - t0, "text": text,
                    "usage": usage}
        finally:
            c.close()

    def rss_mib(self) -> float:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        raise RuntimeError("no VmRSS")

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=60)


class LlamaServer(Server):
    """llama-cpp-python's OpenAI server on the same file, context and threads."""

    def __init__(self, model: str, n_ctx: int, threads: int):
        self.port = _free_port()
        cmd = [sys.executable, "-m", "llama_cpp.server", "--model", str(resolve_model(model)), "--port",
               str(self.port), "--n_ctx", str(n_ctx), "--n_threads", str(threads), "--n_threads_batch",
               str(threads), "--verbose", "false", "--model_alias", served_model_id(model)]
        self._start(cmd, model)

    def ready(self) -> bool:
        return bool(self.get("/v1/models").get("data"))


def document(model: str, n_tokens: int) -> str:
    tok = Tokenizer.from_gguf_metadata(read_gguf(resolve_model(model)).metadata)
    return tok.decode(context_tokens(tok, n_tokens, "prose"))


def ttft(args, n: int, peer: bool = False) -> dict:
    doc = document(args.model, n - 64)
    ask = [f"{doc}\n\nWhat is this document about?", f"{doc}\n\nName one word the document uses often."]
    srv = LlamaServer(args.model, n + 256, args.threads) if peer else Server(args.model, args.config, args.threads,
                                                                            args.sets)
    try:
        cold = srv.chat([{"role": "user", "content": ask[0]}], 8, stream=True)
        cold_server = None if peer else srv.get("/health")["last"]
        warm = srv.chat([{"role": "user", "content": ask[1]}], 8, stream=True)
        health = None if peer else srv.get("/health")
    finally:
        srv.close()
    if peer:
        row = {"engine": "llama.cpp", "model": args.model, "tokens": n, "cold_ttft_s": cold["ttft_s"],
               "reused_ttft_s": warm["ttft_s"], "speedup": cold["ttft_s"] / warm["ttft_s"],
               "reused_usage": warm["usage"]}
        print(f"{n:>6} tokens, llama.cpp: cold TTFT {row['cold_ttft_s']:.2f} s, another question "
              f"{row['reused_ttft_s']:.3f} s, x{row['speedup']:.1f}", flush=True)
        return row
    row = {"engine": "ktquest", "model": args.model, "config": args.config or "dense", "tokens": n,
           "cold_ttft_s": cold["ttft_s"], "reused_ttft_s": warm["ttft_s"],
           "cold_prompt_tokens": cold["usage"]["prompt_tokens"],
           "reused_prompt_tokens": warm["usage"]["prompt_tokens"],
           "reused_cached_tokens": warm["usage"]["prompt_tokens_details"]["cached_tokens"],
           "speedup": cold["ttft_s"] / warm["ttft_s"], "server_prefilled_tokens": health["prefilled_tokens"],
           "server_cold_ttft_s": cold_server["ttft_s"], "server_reused_ttft_s": health["last"]["ttft_s"],
           "server_reused_decode_tok_s": health["last"]["decode_tok_s"]}
    print(f"{n:>6} tokens: cold TTFT {row['cold_ttft_s']:.2f} s, reused {row['reused_ttft_s']:.3f} s "
          f"({row['reused_cached_tokens']} of {row['reused_prompt_tokens']} cached), x{row['speedup']:.0f}; "
          f"server side {row['server_cold_ttft_s']:.2f} s and {row['server_reused_ttft_s']:.3f} s",
          flush=True)
    return row


def sequential(args) -> dict:
    doc = document(args.model, 1500)
    srv = Server(args.model, args.config, args.threads, args.sets)
    rss, failed = [], []
    try:
        history: list[dict] = []
        for i in range(args.sequential):
            if i % 10 == 0:  # a new conversation about the document
                history = [{"role": "user", "content": f"{doc}\n\nQuestion {i}: what is in it?"}]
            elif i % 10 == 5:  # a conversation without it
                history = [{"role": "user", "content": f"Tell me a fact about the number {i}."}]
            else:
                history.append({"role": "user", "content": f"And question {i}?"})
            kw = {"stop": ["\n\n"]} if i % 3 == 0 else {}
            r = srv.chat(history, 16 + i % 17, stream=i % 2 == 0, **kw)
            if r["status"] != 200:
                failed.append({"request": i, "status": r["status"], "body": r["text"]})
                history.pop()
            else:
                history.append({"role": "assistant", "content": r["text"]})
            rss.append(srv.rss_mib())
        health = srv.get("/health")
    finally:
        srv.close()
    warm = rss[10:]
    n = len(warm)
    mean_x, mean_y = (n - 1) / 2, sum(warm) / n
    slope = sum((x - mean_x) * (y - mean_y) for x, y in enumerate(warm)) / sum((x - mean_x) ** 2 for x in range(n))
    row = {"model": args.model, "config": args.config or "dense", "requests": args.sequential, "failed": failed,
           "rss_mib_after_warmup": warm[0], "rss_mib_end": warm[-1], "rss_mib_max": max(warm),
           "rss_slope_mib_per_100": slope * 100, "server": health}
    print(f"{args.sequential} requests, {len(failed)} failed: RSS {warm[0]:.1f} MiB after 10, {warm[-1]:.1f} at the "
          f"end, max {max(warm):.1f}, slope {slope * 100:+.2f} MiB per 100 requests", flush=True)
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--config", help="a YAML config (default: dense)")
    p.add_argument("--lengths", default="8192", help="document sizes, tokens, comma-separated (0: none)")
    p.add_argument("--sequential", type=int, default=0, metavar="K", help="also K sequential requests")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--set", action="append", default=[], dest="sets", metavar="KEY=VALUE")
    p.add_argument("--peer", choices=("none", "llama.cpp"), default="none",
                   help="also llama-cpp-python's server on the same requests (ttft)")
    p.add_argument("--json")
    args = p.parse_args()
    lengths = [int(n) for n in args.lengths.split(",") if int(n) > 0]
    rows = {"ttft": [ttft(args, n) for n in lengths]}
    if args.peer == "llama.cpp":
        rows["ttft"] += [ttft(args, n, peer=True) for n in lengths]
    if args.sequential:
        rows["sequential"] = sequential(args)
    if args.json:
        write_json(args.json, rows)


if __name__ == "__main__":
    main()
