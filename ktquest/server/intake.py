"""A request's way in to ``ktquest serve``'s API (``app.py``): who is asking (its key), its body read bounded and
parsed as JSON, its tools checked against the model's template, its prompt measured and tokenized, and the error
every refusal is (``APIError``: an OpenAI-style JSON body with a 4xx status naming what is wrong)."""

from __future__ import annotations

import hashlib
import hmac
import json

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect

from ktquest.chat import encode_chat
from ktquest.server.schema import MAX_DEPTH, ChatRequest, deeper_than
from ktquest.tool_calls import ToolError, ToolUse
from ktquest.turn import PromptTooLongError

TOKEN_SLACK_BYTES = 1024  # over the context times the longest token: what normalization may shrink


class APIError(Exception):
    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def response(self) -> JSONResponse:
        return JSONResponse({"error": {"message": self.message, "type": self.type, "param": self.param,
                                       "code": self.code}}, status_code=self.status)


def client_key(request: Request, api_keys: tuple[str, ...]) -> str | None:
    """Who is asking, as the worker keys its slots: the ``Authorization`` header's value hashed (None: no
    header, the anonymous group). With ``api_keys``, 401 unless the header is ``Bearer`` one of them (each
    compared in constant time)."""
    auth = request.headers.get("authorization")
    if api_keys:
        scheme, _, token = (auth or "").partition(" ")
        given = token.strip().encode("utf-8", "surrogateescape") if scheme.lower() == "bearer" else b""
        if not sum(hmac.compare_digest(given, k.encode()) for k in api_keys):
            raise APIError(401, "a valid API key is required: send it as 'Authorization: Bearer KEY'",
                           param="authorization", code="invalid_api_key")
    return None if auth is None else hashlib.sha256(auth.encode("utf-8", "surrogateescape")).hexdigest()


async def read_json(request: Request, max_body: int) -> object:
    """The body as JSON: 413 past ``max_body`` bytes (said by Content-Length, or found while reading); 400 for
    invalid JSON (NaN and Infinity included) or JSON nested deeper than ``MAX_DEPTH``."""
    size = request.headers.get("content-length")
    if size is not None and size.isdigit() and int(size) > max_body:
        raise _too_large(int(size), max_body)
    body = bytearray()
    try:
        async for part in request.stream():
            body += part
            if len(body) > max_body:
                raise _too_large(len(body), max_body)
    except ClientDisconnect:  # the client left mid-body: nobody reads the answer, nothing to log
        raise APIError(499, "the client disconnected before sending the whole body", code="client_disconnected") \
            from None
    try:
        value = json.loads(body, parse_constant=_not_json)
        too_deep = deeper_than(value, MAX_DEPTH)
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError, _not_json's
        raise APIError(400, f"the request body is not valid JSON: {e}") from None
    except RecursionError:  # json's parser recurses per level: past the interpreter's limit
        too_deep = True
    if too_deep:
        raise APIError(400, f"the request body is nested too deeply: more than {MAX_DEPTH} levels of arrays and "
                            "objects", code="invalid_value") from None
    return value


def _not_json(name: str) -> float:  # Python's json reads NaN and Infinity; JSON has neither
    raise ValueError(f"{name} is not a JSON number")


def invalid(e: ValidationError) -> APIError:
    """400 naming the first field pydantic refused and why."""
    err = e.errors(include_url=False)[0]
    where = ".".join(str(p) for p in err["loc"]) or "body"
    got = f" (got {json.dumps(err['input'])[:80]})" if err.get("type") != "missing" else ""
    return APIError(400, f"{where}: {err['msg']}{got}", param=where,
                    code="missing_field" if err["type"] == "missing" else "invalid_value")


def _too_large(n: int, limit: int) -> APIError:
    return APIError(413, f"the request body is too large: {n:,} bytes, more than the {limit:,} allowed",
                    code="request_too_large")


def tool_use(req: BaseModel, tokenizer) -> ToolUse | None:
    """A chat request's tools checked against each other and the model's template: APIError 400 otherwise."""
    if not isinstance(req, ChatRequest):
        return None
    try:
        return ToolUse.parse(req.tool_list(), req.tool_choice_value(), req.parallel_tool_calls, tokenizer)
    except ToolError as e:
        param = "tool_choice" if str(e).startswith("tool_choice") else "tools"
        raise APIError(400, str(e), param=param, code="invalid_tools") from None


def prompt_tokens(engine, req: BaseModel, longest: int, tools: ToolUse | None = None) -> list[int]:
    """The prompt's token ids; APIError 400 for a prompt the model cannot take (too long, a template error).
    Its length is checked before any work on it: token ids counted, text measured in bytes against the
    context times ``longest`` (the most bytes one token stands for), so a huge prompt is never tokenized."""
    try:
        if isinstance(req, ChatRequest):
            messages = req.chat()
            render = tools.render if tools is not None else None
            _check_text_fits(engine, [m["content"] for m in messages] +
                             [m["reasoning_content"] for m in messages if "reasoning_content" in m] +
                             [json.dumps(m["tool_calls"]) for m in messages if "tool_calls" in m] +
                             ([json.dumps(render)] if render else []), longest)
            return encode_chat(engine, messages, render)
        if isinstance(req.prompt, list) and req.prompt and isinstance(req.prompt[0], int):
            engine.check_fits(len(req.prompt))
            tokens = list(req.prompt)
            if max(tokens) >= engine.tokenizer.vocab_size:
                raise ValueError(f"prompt: token id {max(tokens)} is not in the vocabulary "
                                 f"(0..{engine.tokenizer.vocab_size - 1})")
        else:
            text = req.prompt if isinstance(req.prompt, str) else req.prompt[0]
            _check_text_fits(engine, [text], longest)
            tokens = engine.tokenizer.encode(text)
        engine.check_fits(len(tokens))
        return tokens
    except ValueError as e:  # PromptTooLongError, ChatTemplateError, TokenizerError are ValueErrors
        code = "context_length_exceeded" if type(e).__name__ == "PromptTooLongError" else None
        raise APIError(400, str(e), param="messages" if isinstance(req, ChatRequest) else "prompt",
                       code=code) from None


def _check_text_fits(engine, texts: list[str], longest: int) -> None:
    """PromptTooLongError when ``texts`` hold more bytes than the context's tokens can stand for."""
    limit = engine.max_seq_len * longest + TOKEN_SLACK_BYTES
    chars = sum(len(t) for t in texts)  # a character is 1 to 4 bytes: measured only where it matters
    if chars > limit or (4 * chars > limit and sum(len(t.encode("utf-8", "surrogatepass")) for t in texts) > limit):
        raise PromptTooLongError(
            f"prompt too long: more than {limit:,} bytes, more than the context of {engine.max_seq_len} tokens "
            f"(max_seq_len) can hold at {longest} bytes a token at most; shorten the prompt or raise max_seq_len")
