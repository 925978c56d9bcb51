"""``ktquest serve``: an OpenAI-compatible HTTP server (``app``) over one engine and its cached conversations
(``worker``)."""

from __future__ import annotations

import dataclasses
import sys

from ktquest.server.guard import GuardConfig


def serve(engine, host: str = "127.0.0.1", port: int = 8080, slots: int = 2, queue: int = 8,
          model_id: str | None = None, max_body: int | None = None, load_kv: str | None = None,
          guard: GuardConfig | None = None, prefix_reuse: str = "per-key", api_keys: tuple[str, ...] = (),
          strict_model_name: bool = False, verbose: bool = False, parallel: int = 1) -> None:
    """Serve ``engine`` until interrupted (uvicorn; Ctrl-C stops it). ``guard``: the connection limits and the
    allowed hosts and origins (its ``host``/``port`` are set from these). ``prefix_reuse``: whose cached
    prompts a request may reuse (``worker.REUSE``); ``api_keys``: when given, a request needs one of them;
    ``strict_model_name``: a request naming another model than ``model_id`` is a 404 (else any name is served);
    a line per request goes to stderr (``server/metrics.py``), and with ``verbose`` uvicorn's own access log too.
    ``parallel``: replies that run at once, their decode steps batched (``server/parallel.py``); ConfigError
    when that many caches of the engine's context would not fit."""
    import logging

    import uvicorn

    from ktquest.server.app import create_app
    from ktquest.server.worker import Worker

    name = model_id or engine.model_path.stem
    from ktquest.server.app import MAX_BODY_BYTES

    if parallel > 1:
        from ktquest.context import check_parallel_fits

        check_parallel_fits(engine.config, engine.args, engine.max_seq_len, engine.device, engine.dtype, parallel,
                            engine.weights_bytes)
    worker = Worker(engine, slots, prefix_reuse, parallel)
    if load_kv:
        print(f"ktquest serve: {worker.load_kv(load_kv):,} tokens of KV loaded from {load_kv}", file=sys.stderr)
    guard = dataclasses.replace(guard or GuardConfig(), host=host, port=port)
    app = create_app(worker, name, queue, max_body or MAX_BODY_BYTES, guard, api_keys=tuple(api_keys),
                     strict_model_name=strict_model_name)
    lines = logging.StreamHandler(sys.stderr)
    lines.setFormatter(logging.Formatter("ktquest serve: %(message)s"))
    log = logging.getLogger("ktquest.serve")
    log.addHandler(lines)
    log.setLevel(logging.INFO)
    print(f"ktquest serve: {name} ({engine.config.mode}, context {engine.max_seq_len} tokens, {max(slots, parallel)} slots"
          f"{f', {parallel} at once' if parallel > 1 else ''}) on "
          f"http://{host}:{port}/v1", file=sys.stderr, flush=True)
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="info" if verbose else "warning",
                                           timeout_graceful_shutdown=5, **guard.uvicorn_options()))
    stop = server.handle_exit

    def handle_exit(sig, frame) -> None:  # SIGINT / SIGTERM: the requests inside end at their next token first
        app.state.begin_shutdown()
        stop(sig, frame)

    server.handle_exit = handle_exit
    server.run()
