"""A request's way in to ``ktquest serve``'s API (``app.py``): who is asking (its key), its body read bounded and
parsed as JSON, and the error every refusal is (``APIError``: an OpenAI-style JSON body with a 4xx status naming
what is wrong)."""

from __future__ import annotations

import hashlib
import hmac
import json

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.requests import ClientDisconnect

MAX_DEPTH = 64  # JSON nested deeper than this is refused (400): OpenAI's requests nest a few levels


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
        too_deep = _deeper_than(value, MAX_DEPTH)
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


def _deeper_than(value: object, limit: int) -> bool:
    """Whether arrays and objects nest in ``value`` more than ``limit`` levels (without recursion)."""
    todo = [(value, 1)]
    while todo:
        item, depth = todo.pop()
        if depth > limit:
            return True
        children = item.values() if isinstance(item, dict) else item
        todo.extend((c, depth + 1) for c in children if isinstance(c, (list, dict)))
    return False


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
