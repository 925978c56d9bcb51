"""``ktquest serve``: an OpenAI-compatible HTTP server (``app``) over one engine and its cached conversations
(``worker``)."""

from __future__ import annotations

import sys


def serve(engine, host: str = "127.0.0.1", port: int = 8080, slots: int = 2, queue: int = 8,
          model_id: str | None = None, max_body: int | None = None, load_kv: str | None = None) -> None:
    """Serve ``engine`` until interrupted (uvicorn; Ctrl-C stops it)."""
    import uvicorn

    from ktquest.server.app import create_app
    from ktquest.server.worker import Worker

    name = model_id or engine.model_path.stem
    from ktquest.server.app import MAX_BODY_BYTES

    worker = Worker(engine, slots)
    if load_kv:
        print(f"ktquest serve: {worker.load_kv(load_kv):,} tokens of KV loaded from {load_kv}", file=sys.stderr)
    app = create_app(worker, name, queue, max_body or MAX_BODY_BYTES)
    print(f"ktquest serve: {name} ({engine.config.mode}, context {engine.max_seq_len} tokens, {slots} slots) on "
          f"http://{host}:{port}/v1", file=sys.stderr, flush=True)
    uvicorn.run(app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=5)
