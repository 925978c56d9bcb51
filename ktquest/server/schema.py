"""The requests ``ktquest serve`` takes, as OpenAI's API defines them (the fields ktquest honours), checked by
pydantic in strict mode: a wrong type is an error, not a conversion (``true`` is not 1). Every number is bounded
as ``GenerationConfig`` bounds it (so a value past them is a 400 naming the field, never an error later), floats
are finite. Fields ktquest does not know are ignored, as OpenAI's clients send many; ``n`` other than 1 and
content parts other than text are refused, and so are ``tools`` (a 400 naming them, until the server honours
them: a client must not take free text for them); ``response_format`` is checked by ``ktquest.structured``. An assistant
message may bring its thinking (``reasoning_content``, as the server answers it): the chat template decides
whether to render it."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from ktquest.config import INT_MAX, SEED_MAX

MAX_STOPS = 4  # OpenAI's limit


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
    # Known but not honoured yet: a request that sets them is refused (``unsupported``), not silently answered
    tools: list | None = None
    tool_choice: str | dict | None = None

    def unsupported(self) -> str | None:
        """The first field set that this server does not honour yet (with how it was set), or None."""
        if self.tools:
            return "tools"
        if self.tool_choice not in (None, "none", "auto"):
            return "tool_choice"
        return None

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


class Message(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None
    reasoning_content: str | None = None  # an assistant's thinking, given to the template as it is

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
    logprobs: bool = False  # each reply token's log probability (server/logprobs.py) ...
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None  # ... and this many most likely tokens

    @model_validator(mode="after")
    def _top_needs_logprobs(self) -> ChatRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return self

    def n_logprobs(self) -> int | None:
        """The alternatives a token's logprobs list (None: no logprobs)."""
        return (self.top_logprobs or 0) if self.logprobs else None

    def limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def chat(self) -> list[dict[str, str]]:
        """The messages as the chat template takes them (a developer message is a system message; an
        assistant's ``reasoning_content`` kept where given)."""
        return [{"role": "system" if m.role == "developer" else m.role, "content": m.text(),
                 **({"reasoning_content": m.reasoning_content} if m.reasoning_content is not None else {})}
                for m in self.messages]


class CompletionRequest(_Request):
    logprobs: Annotated[int, Field(ge=0, le=5)] | None = None  # each token's log probability, and this many best

    # text, one text in a list, or token ids (as OpenAI's API takes them)
    prompt: str | Annotated[list[str], Field(min_length=1, max_length=1)] | \
        Annotated[list[Annotated[int, Field(ge=0, le=INT_MAX)]], Field(min_length=1)]

    def n_logprobs(self) -> int | None:
        return self.logprobs

    @model_validator(mode="after")
    def _not_empty(self) -> CompletionRequest:
        if self.prompt == "" or self.prompt == [""]:
            raise ValueError("prompt is empty: there is nothing to continue from")
        return self


_Request.model_rebuild()
ChatRequest.model_rebuild()
CompletionRequest.model_rebuild()
