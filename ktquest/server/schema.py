"""The requests ``ktquest serve`` takes, as OpenAI's API defines them (the fields ktquest honours), checked by
pydantic in strict mode: a wrong type is an error, not a conversion (``true`` is not 1). Every number is bounded
as ``GenerationConfig`` bounds it (so a value past them is a 400 naming the field, never an error later), floats
are finite. Fields ktquest does not know are ignored, as OpenAI's clients send many; ``n`` other than 1 and
content parts other than text are refused; ``response_format`` is checked by ``ktquest.structured`` and
``tools`` by ``ktquest.tool_calls`` (against the model's template). An assistant message may bring its thinking
(``reasoning_content``, as the server answers it) and the calls it made (``tool_calls``, their arguments JSON
text), a ``tool`` message a call's result: the chat template decides how to render them."""

from __future__ import annotations

import json
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from ktquest.config import INT_MAX, SEED_MAX

MAX_STOPS = 4  # OpenAI's limit
MAX_DEPTH = 64  # JSON nested deeper than this is refused (400): OpenAI's requests nest a few levels


class _Request(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)

    model: str
    max_tokens: Annotated[int, Field(ge=1, le=INT_MAX)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    stop: str | Annotated[list[str], Field(max_length=MAX_STOPS)] | None = None
    seed: Annotated[int, Field(ge=0, le=SEED_MAX)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: Annotated[int, Field(ge=1, le=1)] = 1  # (not Literal[1]: True == 1 would match it)

    response_format: dict | None = None  # text, json_object or json_schema (ktquest.structured.ResponseFormat)

    def stops(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def limit(self) -> int | None:
        return self.max_tokens


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    include_usage: bool = False


class TextPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    type: Literal["text"]
    text: str


class FunctionSpec(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    name: str
    description: str | None = None
    parameters: dict | None = None  # a JSON schema of the arguments object
    strict: bool | None = None


class Tool(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    type: Literal["function"]
    function: FunctionSpec


class FunctionName(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    name: str


class NamedChoice(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    type: Literal["function"]
    function: FunctionName


class CalledFunction(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    name: str
    arguments: str  # a JSON object's text (as the server answered it)


class ToolCallIn(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    id: str
    type: Literal["function"]
    function: CalledFunction


class Message(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    reasoning_content: str | None = None  # an assistant's thinking, given to the template as it is
    tool_calls: Annotated[list[ToolCallIn], Field(max_length=128)] | None = None  # an assistant's calls
    tool_call_id: str | None = None  # a tool message: the call it answers

    @model_validator(mode="after")
    def _tool_fields(self) -> Message:
        if self.tool_calls and self.role != "assistant":
            raise ValueError(f"tool_calls belong to an assistant message, not a {self.role} one")
        if self.role == "tool" and self.tool_call_id is None:
            raise ValueError("a tool message needs the tool_call_id of the call it answers")
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class ChatRequest(_Request):
    messages: Annotated[list[Message], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1, le=INT_MAX)] | None = None
    # llama.cpp's name: "none" keeps a think block in ``content``; else it goes to ``reasoning_content``
    reasoning_format: Literal["auto", "deepseek", "none"] = "auto"
    tools: Annotated[list[Tool], Field(max_length=128)] | None = None  # (ktquest.tool_calls)
    tool_choice: Literal["none", "auto", "required"] | NamedChoice | None = None
    parallel_tool_calls: bool = True
    functions: list | None = None  # OpenAI's deprecated names for tools and tool_choice: refused, not ignored
    function_call: str | dict | None = None
    logprobs: bool = False  # each reply token's log probability (server/logprobs.py) ...
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None  # ... and this many most likely tokens

    @model_validator(mode="after")
    def _top_needs_logprobs(self) -> ChatRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return self

    @field_validator("functions", "function_call")
    @classmethod
    def _deprecated(cls, value, info):
        if value is not None:
            raise ValueError(f"{info.field_name} is OpenAI's deprecated form: send tools and tool_choice")
        return value

    def n_logprobs(self) -> int | None:
        """The alternatives a token's logprobs list (None: no logprobs)."""
        return (self.top_logprobs or 0) if self.logprobs else None

    def limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def chat(self) -> list[dict]:
        """The messages as chat templates take them (Hugging Face's convention): a developer message is a
        system message; an assistant's ``reasoning_content`` kept where given, its ``tool_calls`` with their
        arguments as objects; a tool message with the ``name`` of the function whose call it answers.
        ValueError naming a call whose arguments are not a JSON object."""
        out, names = [], {}
        for i, m in enumerate(self.messages):
            msg = {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
            if m.reasoning_content is not None:
                msg["reasoning_content"] = m.reasoning_content
            if m.tool_calls:
                msg["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                    "name": c.function.name, "arguments": _arguments(c.function.arguments, i, j)}}
                    for j, c in enumerate(m.tool_calls)]
                names.update((c.id, c.function.name) for c in m.tool_calls)
            if m.role == "tool":
                msg["tool_call_id"] = m.tool_call_id
                if m.tool_call_id in names:
                    msg["name"] = names[m.tool_call_id]
            out.append(msg)
        return out

    def tool_list(self) -> list[dict] | None:
        return None if self.tools is None else [t.model_dump(exclude_none=True) for t in self.tools]

    def tool_choice_value(self) -> str | dict | None:
        c = self.tool_choice
        return c.model_dump() if isinstance(c, NamedChoice) else c


def _arguments(text: str, i: int, j: int) -> dict:
    where = f"messages[{i}].tool_calls[{j}].function.arguments"
    try:
        args = json.loads(text)
    except (ValueError, RecursionError):
        args = None
    if not isinstance(args, dict):
        raise ValueError(f"{where} is not a JSON object: {text[:80]!r}")
    if deeper_than(args, MAX_DEPTH):
        raise ValueError(f"{where} is nested too deeply: more than {MAX_DEPTH} levels of arrays and objects")
    return args


def deeper_than(value: object, limit: int) -> bool:
    """Whether arrays and objects nest in ``value`` more than ``limit`` levels (without recursion)."""
    todo = [(value, 1)]
    while todo:
        item, depth = todo.pop()
        if depth > limit:
            return True
        children = item.values() if isinstance(item, dict) else item
        todo.extend((c, depth + 1) for c in children if isinstance(c, (list, dict)))
    return False


class CompletionRequest(_Request):
    logprobs: Annotated[int, Field(ge=0, le=5)] | None = None  # each token's log probability, and this many best

    # text, one text in a list, or token ids (as OpenAI's API takes them)
    prompt: str | Annotated[list[str], Field(min_length=1, max_length=1)] | \
        Annotated[list[Annotated[int, Field(ge=0, le=INT_MAX)]], Field(min_length=1)]

    def n_logprobs(self) -> int | None:
        return self.logprobs

    tools: list | None = None  # (chat fields: refused here rather than ignored)
    tool_choice: str | dict | None = None

    @model_validator(mode="after")
    def _not_empty(self) -> CompletionRequest:
        if self.prompt == "" or self.prompt == [""]:
            raise ValueError("prompt is empty: there is nothing to continue from")
        return self

    @field_validator("tools", "tool_choice")
    @classmethod
    def _chat_only(cls, value, info):
        if value:
            raise ValueError(f"{info.field_name} is a chat request's: send it to /v1/chat/completions")
        return value


_Request.model_rebuild()
ChatRequest.model_rebuild()
CompletionRequest.model_rebuild()
