"""``ktquest serve``'s HTTP side: an OpenAI-compatible API (FastAPI) over one ``Worker``.

    POST /v1/chat/completions   chat (the model's template), streamed by SSE when "stream": true
    POST /v1/completions        raw text completion
    GET  /v1/models             the one model ("chat_template": false for a base model)
    GET  /health                status, queue, the worker's counters (prefilled vs cached tokens), time to
                                first token (mean, and the last request's with its prefill and decode speed)
    GET  /metrics               the same in Prometheus' text format (``metrics.py``), and a line per request
    GET  /                      a chat page (``page.py``)

One sequence at a time, or up to N with parallel slots (``--parallel N``, ``server/parallel.py``: their decode
steps batched), at most ``queue`` waiting behind the running ones; past that a request is answered 429 at once. Every error is an OpenAI-style JSON body
(``{"error": {"message", "type", "param", "code"}}``, ``intake.APIError``) with a 4xx status naming what is
wrong; the server goes on serving. A streaming client that disconnects stops its generation at the next token
(the cache stays consistent: ``generate``'s invariant), and a request still waiting when its client leaves never
runs.

A chat reply's leading think block (Qwen3, QwQ, DeepSeek-R1) is the message's ``reasoning_content``, the rest
its ``content`` (``ktquest.turn.ThinkSplit``; streamed too: ``reasoning_content`` deltas until ``</think>``),
unless the request says ``"reasoning_format": "none"``. Usage counts every generated token, the thinking too.

A request's ``Authorization`` header, hashed, is its key: it reuses only cached prompts of the same key
(``worker``'s slots). With ``api_keys`` every request must bring one of them, else 401. A request is checked
whole before any work on it: JSON nesting and numbers bounded, a prompt measured before it is tokenized.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException

from ktquest.chat import opens_prompt_thinking
from ktquest.config import GenerationConfig
from ktquest.server.guard import GuardConfig, HostOriginGuard
from ktquest.server.intake import APIError, client_key, invalid, prompt_tokens, read_json, tool_use
from ktquest.server.logprobs import LogprobCollector, chat_logprobs, completion_logprobs
from ktquest.server.metrics import CONTENT_TYPE as METRICS_TYPE
from ktquest.server.metrics import ServerMetrics
from ktquest.server.page import PAGE
from ktquest.server.schema import ChatRequest, CompletionRequest
from ktquest.server.worker import Result, Worker
from ktquest.structured import FormatError, ResponseFormat
from ktquest.tool_calls import ToolUse
from ktquest.turn import ThinkSplit, split_thinking

log = logging.getLogger("ktquest.serve")
MAX_BODY_BYTES = 64 * 2**20  # a request body larger than this is refused (413) before it is read whole


class _Admission:
    """How many requests are in (running or waiting): at most ``running + queue`` (``running``: the replies that
    run at once, 1 or ``--parallel``). A ticket is released once, whichever of its holders gets there first."""

    def __init__(self, queue: int, running: int = 1):
        self.limit, self.queue = running + queue, queue
        self.inside = 0
        self.refused = 0
        self.lock = threading.Lock()

    def enter(self) -> _Ticket:
        with self.lock:
            if self.inside >= self.limit:
                self.refused += 1
                raise APIError(429, f"the server is busy: {self.inside} requests are running or waiting and the "
                                    f"queue holds {self.queue}; retry later", "rate_limit_error",
                               code="rate_limit_exceeded")
            self.inside += 1
        return _Ticket(self)


class _Ticket:
    def __init__(self, gate: _Admission):
        self.gate, self.done = gate, False

    def release(self) -> None:
        with self.gate.lock:
            if not self.done:
                self.done = True
                self.gate.inside -= 1


@dataclasses.dataclass(slots=True, eq=False)  # (hashed by identity: the live set)
class _Job:
    tokens: list[int]
    gen: GenerationConfig
    stops: list[str]
    ticket: _Ticket
    key: str | None  # the client's credential, hashed (None: none given): whose slots it may reuse
    cancel: threading.Event = dataclasses.field(default_factory=threading.Event)
    split: bool = False  # a chat reply: its think block goes to reasoning_content
    open_block: bool = False  # its prompt opened the think block (``opens_thinking``)
    logprobs: LogprobCollector | None = None  # the reply tokens' log probabilities, where asked for
    response_format: ResponseFormat | None = None  # the reply held to JSON / a JSON schema (ktquest.structured)
    tools: ToolUse | None = None  # the functions the model may call (ktquest.tool_calls)


def create_app(worker: Worker, model_id: str, queue: int = 8, max_body: int = MAX_BODY_BYTES,
               guard: GuardConfig | None = None, api_keys: tuple[str, ...] = (),
               strict_model_name: bool = False) -> FastAPI:
    """The API over ``worker``; ``model_id`` is the name /v1/models reports and replies carry; a request may name
    any model (clients hard-code theirs), unless ``strict_model_name``: then another name is a 404. ``guard``:
    the Host/Origin/Content-Type checks (``guard.py``; by default a server on 127.0.0.1:8080's). ``api_keys``:
    when given, a request must bring one of them (``Authorization: Bearer KEY``), else 401."""
    if queue < 0:
        raise ValueError(f"queue={queue} must be >= 0")
    engine = worker.engine
    running = 1 if worker.parallel is None else worker.parallel.n  # replies that run at once
    gate = _Admission(queue, running)
    executor = ThreadPoolExecutor(max_workers=running, thread_name_prefix="ktquest-generate")
    created = int(time.time())
    # the most text bytes one token stands for (a token's text is at least as long as what it encodes)
    longest = max((len(t.encode("utf-8", "surrogatepass")) for t in engine.tokenizer.tokens), default=1)
    app = FastAPI(title="ktquest", docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(HostOriginGuard, config=guard or GuardConfig(), error=APIError)

    metrics = ServerMetrics()
    # SIGINT / SIGTERM (``serve``): every request inside stops at its next token; a stream ends with an error
    # event and [DONE], a waiting one gets a 503, instead of generating on until uvicorn cancels it mid-stream
    live: set[_Job] = set()
    live_lock = threading.Lock()
    shutting_down = threading.Event()

    def begin_shutdown() -> None:
        shutting_down.set()
        with live_lock:
            for job in live:
                job.cancel.set()

    app.state.begin_shutdown = begin_shutdown

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError) -> JSONResponse:
        metrics.refused(request.url.path, e.status, e.message)
        return e.response()

    @app.exception_handler(HTTPException)
    async def _http_error(request: Request, e: HTTPException) -> JSONResponse:  # unknown path, wrong method
        what = "not_found" if e.status_code == 404 else None
        return APIError(e.status_code, f"{request.method} {request.url.path}: {e.detail}", code=what).response()

    @app.exception_handler(Exception)
    async def _bug(request: Request, e: Exception) -> JSONResponse:  # a bug: logged here, one line to the client
        log.exception("internal error on %s %s", request.method, request.url.path)
        return APIError(500, f"internal error: {type(e).__name__}", "server_error").response()

    def run(job: _Job, on_text=None) -> Result | None:
        """On the worker thread: the request, unless its client left while it waited (or the server stops)."""
        try:
            if job.cancel.is_set() or shutting_down.is_set():
                return None
            return worker.complete(job.tokens, job.gen, job.stops, on_text, job.cancel.is_set, key=job.key,
                                   on_logits=job.logprobs, response_format=job.response_format)
        finally:
            job.ticket.release()
            with live_lock:
                live.discard(job)

    async def admit(request: Request, kind: type[BaseModel]) -> tuple[BaseModel, _Job]:
        """The request's body checked and tokenized, a place in the queue taken: an APIError otherwise."""
        key = client_key(request, api_keys)
        body = await read_json(request, max_body)
        try:
            req = kind.model_validate(body)
        except ValidationError as e:
            raise invalid(e) from None
        tools = tool_use(req, engine.tokenizer)
        try:  # (a schema compiles off the event loop)
            fmt = await asyncio.get_running_loop().run_in_executor(None, ResponseFormat.parse, req.response_format)
        except FormatError as e:
            raise APIError(400, str(e), param="response_format", code="invalid_response_format") from None
        if tools is not None and tools.choice not in ("none", "auto"):  # the reply held to the call syntax
            if fmt is not None:
                raise APIError(400, f"tool_choice {tools.choice!r} and response_format both say what the reply is: "
                                    "send one of them", param="tool_choice", code="invalid_value")
            try:
                fmt = await asyncio.get_running_loop().run_in_executor(None, tools.format)
            except FormatError as e:
                raise APIError(400, str(e), param="tools", code="invalid_tools") from None
        if strict_model_name and req.model != model_id:
            raise APIError(404, f"model {req.model!r} is not served here; this server serves {model_id!r} "
                                "(GET /v1/models)", param="model", code="model_not_found")
        ticket = gate.enter()
        try:
            loop = asyncio.get_running_loop()
            tokens = await loop.run_in_executor(None, prompt_tokens, engine, req, longest, tools)  # off the event loop
            split = isinstance(req, ChatRequest) and req.reasoning_format != "none"
            open_block = split and opens_prompt_thinking(engine, tokens)
            if fmt is not None and open_block:  # the think block the prompt opened first, then the format
                try:
                    fmt = fmt.after_thinking()
                except FormatError as e:
                    raise APIError(400, str(e), param="response_format", code="invalid_value") from None
            elif fmt is not None:  # (else a held reply is its format from its first token: nothing to split off)
                split = False
            top = req.n_logprobs()
            collector = None if top is None else LogprobCollector(engine.tokenizer, top, engine.tokenizer.stop_ids)
            job = _Job(tokens, _generation(engine.config.generation, req), req.stops(), ticket, key,
                       split=split, open_block=open_block, logprobs=collector,
                       response_format=fmt, tools=tools)
            with live_lock:
                if shutting_down.is_set():
                    raise APIError(503, "the server is shutting down", "server_error", code="server_shutting_down")
                live.add(job)
            return req, job
        except BaseException:
            ticket.release()
            raise

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        req, job = await admit(request, ChatRequest)
        return await respond(request, req, job, chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request):
        req, job = await admit(request, CompletionRequest)
        return await respond(request, req, job, chat=False)

    async def respond(request: Request, req, job: _Job, chat: bool):
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        head = {"id": rid, "created": int(time.time()), "model": model_id}
        loop = asyncio.get_running_loop()
        if not req.stream:
            future = asyncio.wrap_future(executor.submit(run, job))
            try:
                while not (await asyncio.wait({future}, timeout=0.25))[0]:
                    if await request.is_disconnected():  # the client left: its generation stops
                        job.cancel.set()
                result = await future
            finally:
                job.cancel.set()  # (an error on this side: the job is skipped or stopped)
            if shutting_down.is_set() and (result is None or result.finish_reason == "cancelled"):
                raise APIError(503, "the server is shutting down: the reply was cut short", "server_error",
                               code="server_shutting_down")
            if result is None or result.finish_reason == "cancelled":
                metrics.refused(request.url.path, 499, "the client left")
                return JSONResponse({}, status_code=499)  # nobody reads it
            metrics.answered(rid, request.url.path, result)
            choice = _choice(chat, result.text, result.finish_reason, job)
            if job.logprobs is not None:
                records = job.logprobs.take(len(result.text), final=True)
                choice["logprobs"] = chat_logprobs(records) if chat else completion_logprobs(records)
            return JSONResponse({**head, "object": "chat.completion" if chat else "text_completion",
                                 "choices": [choice],
                                 "usage": _usage(result)})
        pieces: asyncio.Queue = asyncio.Queue()

        def on_text(piece: str) -> None:
            loop.call_soon_threadsafe(pieces.put_nowait, piece)

        future = asyncio.wrap_future(executor.submit(run, job, on_text))
        future.add_done_callback(lambda f: pieces.put_nowait(None))
        obj = "chat.completion.chunk" if chat else "text_completion"

        sent = [0]  # the reply's characters streamed so far (thinking and answer alike)

        def chunk(text: str | None, finish: str | None = None, first: bool = False, field: str = "content",
                  final_len: int | None = None, call: dict | None = None, consumed: int | None = None) -> str:
            lp = None
            if job.logprobs is not None and not first:  # the tokens whose text this chunk completes
                sent[0] += len(text or "") if consumed is None else consumed
                records = job.logprobs.take(sent[0] if final_len is None else final_len, final=final_len is not None)
                lp = chat_logprobs(records) if chat else completion_logprobs(records)
            if chat:
                delta = {"role": "assistant", "content": ""} if first else {"tool_calls": [call]} if call else \
                    {} if text is None else {field: text}
                choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": lp}
            else:
                choice = {"index": 0, "text": text or "", "finish_reason": finish, "logprobs": lp}
            return _sse({**head, "object": obj, "choices": [choice]})

        reader = job.tools.reader() if job.tools is not None else None  # the calls a reply writes
        carry = [0]  # characters read by ``reader`` not yet counted by a chunk

        def out(kind: str, text: str, end: bool = False) -> list[str]:
            """The chunks a piece of the reply makes: thinking, content, or (read by ``reader``) its calls."""
            if kind == "thinking":
                return [chunk(text, field="reasoning_content")]
            if reader is None:
                return [chunk(text)] if text else []
            chunks = []
            for t, call, n in reader.push(text) + (reader.flush() if end else []):
                carry[0] += n  # (the blanks between calls send nothing: their characters go with what follows)
                if call is not None or t:
                    call_delta = None if call is None else call.openai(index=reader.calls.index(call))
                    chunks.append(chunk(t or None, call=call_delta, consumed=carry[0]))
                    carry[0] = 0
            return chunks

        async def events() -> AsyncIterator[str]:
            try:
                if chat:
                    yield chunk(None, first=True)
                split = ThinkSplit(job.open_block) if job.split else None
                while (piece := await pieces.get()) is not None:
                    for kind, text in split.push(piece) if split else [("answer", piece)]:
                        for c in out(kind, text):
                            yield c
                for kind, text in (split.flush() if split else []) + [("answer", "")]:
                    for c in out(kind, text, end=kind == "answer" and not text):
                        yield c
                try:
                    result = future.result()
                except Exception as e:  # the response has begun: the error goes in the stream
                    log.exception("error while streaming")
                    yield _sse({"error": {"message": f"{type(e).__name__}: {e}", "type": "server_error",
                                          "param": None, "code": None}})
                    return
                if shutting_down.is_set() and (result is None or result.finish_reason == "cancelled"):
                    yield _sse({"error": {"message": "the server is shutting down: the reply was cut short",
                                          "type": "server_error", "param": None, "code": "server_shutting_down"}})
                    yield "data: [DONE]\n\n"
                    return
                finish = "tool_calls" if reader is not None and reader.calls and result.finish_reason == "stop" \
                    else result.finish_reason
                yield chunk(None, finish, final_len=len(result.text))
                metrics.answered(rid, request.url.path, result)
                if req.stream_options is not None and req.stream_options.include_usage:
                    yield _sse({**head, "object": obj, "choices": [], "usage": _usage(result)})
                yield "data: [DONE]\n\n"
            finally:
                job.cancel.set()  # the client left (or it is over): the generation stops at the next token

        return StreamingResponse(events(), media_type="text/event-stream", background=BackgroundTask(job.cancel.set))

    @app.get("/v1/models")
    async def models(request: Request):
        client_key(request, api_keys)
        # chat_template false: a base model, whose chat is the conversation as plain text that it continues
        return {"object": "list", "data": [{"id": model_id, "object": "model", "created": created,
                                            "owned_by": "ktquest",
                                            "chat_template": engine.tokenizer.chat_template is not None}]}

    @app.get("/")
    async def page(request: Request):  # the chat page (server/page.py): its requests bring their key
        return HTMLResponse(PAGE, headers={"Cache-Control": "no-store"})

    @app.get("/metrics")
    async def prometheus(request: Request):  # (with api keys: for them only, as /health)
        client_key(request, api_keys)
        with gate.lock:
            inside = gate.inside
        body = metrics.render(inside, [len(s.seq) for s in worker.slots])
        return Response(body, media_type=METRICS_TYPE)

    @app.get("/health")
    async def health(request: Request):  # (with api keys: for them only; it tells the slots' lengths)
        client_key(request, api_keys)
        with gate.lock:
            inside, refused = gate.inside, gate.refused
        counters = {**worker.snapshot(), "refused": refused}
        return {"status": "ok", "model": model_id, "mode": engine.config.mode, "max_seq_len": engine.max_seq_len,
                "running_or_waiting": inside, "queue": gate.queue, "parallel": running,
                "slots": [len(s.seq) for s in worker.slots], **counters}
    return app


def _generation(base: GenerationConfig, req) -> GenerationConfig:
    """The server's sampling (the chat's defaults under the config) with the request's fields over it."""
    over = {}
    if req.temperature is not None:
        over["temperature"] = req.temperature if req.temperature >= 1e-6 else 0.0
    if req.top_p is not None:
        over["top_p"] = req.top_p
    if req.seed is not None:
        over["seed"] = req.seed
    if req.limit() is not None:
        over["max_new_tokens"] = req.limit()
    try:
        return dataclasses.replace(base, **over)
    except ValueError as e:  # (the schema's bounds are the config's: a bound out of step with them)
        raise APIError(400, str(e), code="invalid_value") from None


def _choice(chat: bool, text: str, finish: str, job: _Job) -> dict:
    if chat:
        thinking, answer = split_thinking(text, job.open_block) if job.split else (None, text)
        message = {"role": "assistant", "content": answer}
        reader = job.tools.reader() if job.tools is not None else None
        if reader is not None:  # the calls the reply wrote, taken out of its content
            reader.push(answer)
            reader.flush()
            message["content"] = reader.message_content()
            if reader.calls:
                message["tool_calls"] = [c.openai() for c in reader.calls]
                finish = "tool_calls" if finish == "stop" else finish
        if thinking is not None:
            message["reasoning_content"] = thinking
        return {"index": 0, "message": message, "finish_reason": finish, "logprobs": None}
    return {"index": 0, "text": text, "finish_reason": finish, "logprobs": None}


def _usage(r: Result) -> dict:
    return {"prompt_tokens": r.prompt_tokens, "completion_tokens": r.completion_tokens,
            "total_tokens": r.prompt_tokens + r.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": r.cached_tokens}}


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"
