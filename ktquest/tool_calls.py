"""Tool calls: a chat request's ``tools`` rendered by the model's own chat template, and the calls the model writes
in its reply read back into OpenAI's ``tool_calls``.

    tools = ToolUse.parse(req_tools, tool_choice, parallel, tokenizer)   # ToolError: a 400
    tools.render                         # the list the template takes as ``tools`` (None for "none")
    tools.format()                       # "required" / a named function: the reply held to the call syntax
    reader = tools.reader()              # a reply's text, as it streams, into content and ToolCalls

A model writes a call in the syntax it was trained on, which its chat template shows it. Two are read:

    hermes   <tool_call>\\n{"name": "get_weather", "arguments": {"city": "Paris"}}\\n</tool_call>
             (Hermes 2 Pro, Qwen2.5, Qwen3, QwQ, and the many templates that copied them)
    xml      <tool_call>\\n<function=get_weather>\\n<parameter=city>\\nParis\\n</parameter>\\n</function>\\n</tool_call>
             (Qwen3-Coder, Qwen3.5): a parameter's text is a string, or JSON where the tool's schema says the
             parameter is not a string

A template whose rendering does not show the tools it is given (SmolLM2's, a base model's plain text) cannot
take them: the request is a 400, never a reply that ignored them. ``tool_choice`` ``"required"`` or a named
function holds the reply to one call (or several, with ``parallel_tool_calls``) by a grammar over the call's
syntax with each tool's parameters as its JSON schema (``ktquest.structured``), so its arguments always parse
and validate; ``"auto"`` lets the model choose and reads what it wrote (a block that does not parse stays text).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

import llguidance

from ktquest.structured import FormatError, ResponseFormat

NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for a function's name
OPEN, CLOSE = "<tool_call>", "</tool_call>"
_PROBE = "ktquest_probe_tool_4c1e"
# a held call's JSON written as json.dumps writes it (and the templates render calls): no blanks of the model's choice
COMPACT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}  # a name no template writes unless it renders the tools it is given


class ToolError(ValueError):
    """Tools a request cannot have honoured here (the server answers 400 with its text)."""


@dataclass(frozen=True, slots=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # a JSON object's text, as OpenAI's API gives it

    def openai(self, index: int | None = None) -> dict:
        """The call as a message's ``tool_calls`` entry (with ``index``: a streamed delta's)."""
        head = {} if index is None else {"index": index}
        return {**head, "id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def _call(name: str, args: dict) -> ToolCall | None:
    try:
        text = json.dumps(args, ensure_ascii=False)
    except (ValueError, RecursionError):  # (a value nested past what json writes)
        return None
    return ToolCall(f"call_{uuid.uuid4().hex[:24]}", name, text)


# ---- the syntaxes ----


class Hermes:
    name = "hermes"

    def read(self, body: str, schemas: dict[str, dict]) -> ToolCall | None:
        """A call's text between the tags, or None when it is not one (JSON with a name and object arguments)."""
        obj = _loads(body)
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return None
        args = obj.get("arguments", obj.get("parameters", {}))
        if isinstance(args, str):  # (some models write the arguments as a JSON string)
            args = _loads(args)
        return _call(obj["name"], args) if isinstance(args, dict) else None

    def grammar(self, name: str, schema: dict) -> str:
        args, defs = _split_defs(schema)
        call = {"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
                "properties": {"name": {"const": name}, "arguments": args}, "x-guidance": COMPACT, **defs}
        return f'"\\n" %json {json.dumps(call)} "\\n"'


class Xml:
    name = "xml"
    _FUNCTION = re.compile(r"\s*<function=([^>\n]+)>(.*?)</function>\s*", re.S)
    _PARAM = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.S)
    KEY = re.compile(r"[^\s<>=/\"\\]{1,128}")  # a key the tags can hold and the reader reads back

    def read(self, body: str, schemas: dict[str, dict]) -> ToolCall | None:
        m = self._FUNCTION.fullmatch(body)
        if m is None:
            return None
        name = m.group(1).strip()
        props = schemas.get(name, {}).get("properties", {})
        args = {}
        for p in self._PARAM.finditer(m.group(2)):
            key, text = p.group(1).strip(), p.group(2)
            args[key] = text if _is_string(props.get(key)) else _json_or_text(text)
        return _call(name, args)

    def grammar(self, name: str, schema: dict) -> str:
        args, defs = _split_defs(schema)
        required = set(args.get("required", ()))
        parts = [_lit(f"\n<function={name}>\n")]
        for key, sub in args.get("properties", {}).items():
            if _is_string(sub):  # the raw text and the closing tag in one regex (a lexeme is matched greedily)
                value = _text_rule(key, sub)
            else:
                value = f"%json {json.dumps({**sub, 'x-guidance': COMPACT, **defs})} " + _lit("\n</parameter>\n")
            param = f"({_lit(f'<parameter={key}>' + chr(10))} {value})"
            parts.append(param if key in required else param + "?")
        parts.append(_lit("</function>\n"))
        return " ".join(parts)

    def check(self, name: str, schema: dict) -> None:
        """ToolError for what this syntax cannot carry: a parameter key its tags cannot hold."""
        for key in schema.get("properties", {}):
            if not self.KEY.fullmatch(key):
                raise ToolError(f"tools: {name}'s parameter {key!r} cannot be written as <parameter={key}> "
                                "(blanks, quotes, <, >, = and / are not allowed there)")


def _lit(text: str) -> str:
    """``text`` as a Lark string literal."""
    return json.dumps(text)


def _split_defs(schema: dict) -> tuple[dict, dict]:
    """A parameters schema apart from its ``$defs`` / ``definitions``, which go to the root of the schema it is
    put in (so its ``#/$defs/...`` references still resolve)."""
    defs = {k: schema[k] for k in ("$defs", "definitions") if k in schema}
    return {k: v for k, v in schema.items() if k not in defs}, defs


def _text_rule(key: str, schema: dict) -> str:
    """A string parameter's raw text and the closing tag as one grammar item: its enum or const, else text
    within its length bounds. Held text cannot hold ``</`` (nor ``<`` at all under length bounds)."""
    close = "\n</parameter>\n"
    options = schema.get("enum", [schema["const"]] if "const" in schema else None)
    if isinstance(options, list) and options and all(isinstance(o, str) for o in options):
        return "(" + " | ".join(_lit(o + close) for o in options) + ")"
    lo, hi = schema.get("minLength", 0), schema.get("maxLength")
    tail = r"\n<\/parameter>\n"
    if hi is not None or lo:
        return f"/[^<]{{{lo},{'' if hi is None else hi}}}{tail}/"
    return f"/([^<]|<[^\\/])*{tail}/"


def _is_string(schema) -> bool:
    return isinstance(schema, dict) and schema.get("type") == "string"


def _loads(text: str):
    """JSON text's value, or None (not JSON, or nested past what the parser takes)."""
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return None


def _json_or_text(text: str):
    value = _loads(text)
    return text if value is None and text.strip() != "null" else value


SYNTAXES = {"hermes": Hermes(), "xml": Xml()}


def syntax_of(template: str | None) -> Hermes | Xml | None:
    """The call syntax a chat template shows its model (None: neither of those read here, e.g. GLM-4.5's
    <tool_call>NAME<arg_key>...)."""
    if not template or OPEN not in template or "<arg_key>" in template:
        return None
    return SYNTAXES["xml"] if "<function=" in template else SYNTAXES["hermes"]


def takes_tools(tokenizer) -> bool:
    """Whether the model's chat template renders the tools it is given (a probe tool's name shows up)."""
    cached = getattr(tokenizer, "_takes_tools", None)
    if cached is None:
        probe = [{"type": "function", "function": {"name": _PROBE, "description": "probe",
                                                   "parameters": {"type": "object", "properties": {}}}}]
        try:
            text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], True, tools=probe)
        except ValueError:  # (ChatTemplateError: a template that fails on tools does not take them)
            text = ""
        cached = tokenizer._takes_tools = _PROBE in text
    return cached


# ---- a request's tools ----


@dataclass(frozen=True, slots=True)
class ToolUse:
    """A chat request's tools: what the template renders, what the reply is held to, how it is read."""

    render: list[dict] | None  # the ``tools`` the template takes (None for tool_choice "none": none rendered)
    schemas: dict[str, dict]  # name -> parameters' JSON schema
    choice: str  # "none" | "auto" | "required" | "function" (the one named ``function``)
    parallel: bool
    syntax: Hermes | Xml | None
    function: str | None = None

    @classmethod
    def parse(cls, tools: list[dict] | None, choice: str | dict | None, parallel: bool,
              tokenizer) -> ToolUse | None:
        """The request's ``tools``, ``tool_choice`` and ``parallel_tool_calls`` checked against each other and
        the model's template (ToolError naming what is wrong); None without tools."""
        if not tools:
            if choice not in (None, "none", "auto"):
                raise ToolError("tool_choice needs tools: the request lists none")
            return None
        schemas: dict[str, dict] = {}
        for i, t in enumerate(tools):
            fn = t["function"]
            name = fn["name"]
            if not NAME.fullmatch(name):
                raise ToolError(f"tools[{i}].function.name {name!r}: a name is 1-64 letters, digits, '_' or '-'")
            if name in schemas:
                raise ToolError(f"tools[{i}].function.name {name!r} is listed twice")
            schemas[name] = fn.get("parameters") or {"type": "object", "properties": {}}
            _check_parameters(f"tools[{i}].function.parameters", schemas[name])
        function = None
        if isinstance(choice, dict):
            function, choice = choice["function"]["name"], "function"
            if function not in schemas:
                raise ToolError(f"tool_choice names the function {function!r}, which tools does not list")
        choice = choice or "auto"
        if choice == "none":
            return cls(None, schemas, "none", parallel, None)
        if not takes_tools(tokenizer):
            raise ToolError("this model's chat template does not render tools: it cannot be given any (use a "
                            "model whose template takes them, e.g. Qwen3 or Qwen2.5 Instruct)")
        syntax = syntax_of(tokenizer.chat_template)
        if syntax is None:
            raise ToolError("this model's chat template takes tools, but writes its calls in a syntax ktquest "
                            f"does not read (it reads {OPEN} blocks of JSON or of <function=...> XML)")
        if isinstance(syntax, Xml):
            for name, schema in schemas.items():
                syntax.check(name, schema)
        return cls([dict(t) for t in tools], schemas, choice, parallel, syntax, function)

    def format(self) -> ResponseFormat | None:
        """The grammar a reply is held to ("required": calls of any tool, one or several as ``parallel``
        says; a named function: one call of it); None when the model chooses. FormatError (a 400) for a
        parameters schema that cannot be held to."""
        if self.choice in ("none", "auto"):
            return None
        names = list(self.schemas) if self.choice == "required" else [self.function]
        if isinstance(self.syntax, Xml):
            for n in names:
                _check_xml_held(n, self.schemas[n])
        rules = [f"call_{i}: {self.syntax.grammar(n, self.schemas[n])}" for i, n in enumerate(names)]
        body = " | ".join(f"call_{i}" for i in range(len(names)))
        calls = 'call ("\\n" call)*' if self.parallel and self.choice == "required" else "call"
        lark = "\n".join([f"start: {calls}", f"call: {_lit(OPEN)} ({body}) {_lit(CLOSE)}", *rules])
        try:
            grammar = llguidance.grammar_from("lark", lark)
            failed, msgs = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
        except ValueError as e:
            failed, msgs = True, [str(e)]
        if failed:
            raise FormatError(f"tools: a function's parameters cannot be held to: {msgs[0].strip()}")
        return ResponseFormat(grammar, "tool_call", lark)

    def reader(self) -> CallReader | None:
        return None if self.syntax is None else CallReader(self.syntax, self.schemas)


def _check_parameters(where: str, schema: dict) -> None:
    """ToolError unless ``schema`` is an object schema whose properties and required keys are well formed."""
    if schema.get("type", "object") != "object":
        raise ToolError(f"{where}: the arguments are an object: its type must be 'object', not {schema['type']!r}")
    props = schema.get("properties", {})
    if not isinstance(props, dict) or not all(isinstance(v, dict) for v in props.values()):
        raise ToolError(f"{where}.properties must be an object of schemas (objects)")
    required = schema.get("required", [])
    if not isinstance(required, list) or not all(isinstance(k, str) for k in required):
        raise ToolError(f"{where}.required must be a list of property names")
    for key, sub in props.items():
        if "enum" in sub and not isinstance(sub["enum"], list):
            raise ToolError(f"{where}.properties.{key}.enum must be a list")
        for bound in ("minLength", "maxLength"):
            if bound in sub and (not isinstance(sub[bound], int) or isinstance(sub[bound], bool) or sub[bound] < 0):
                raise ToolError(f"{where}.properties.{key}.{bound} must be a non-negative integer")


def _check_xml_held(name: str, schema: dict) -> None:
    """FormatError for a string parameter the XML syntax's raw text cannot be held to."""
    for key, sub in schema.get("properties", {}).items():
        if _is_string(sub):
            for kw in ("pattern", "format"):
                if kw in sub:
                    raise FormatError(f"tools: {name}'s parameter {key!r} has a {kw}, which a held call in this "
                                      "model's syntax (<parameter=...> text) cannot be held to")


class CallReader:
    """A reply's text, as it streams, split into content and the calls it writes. ``push`` returns events that
    can go out now, each ``(text, call, consumed)``: content text or a ToolCall, and how many characters of
    the reply it stands for; text that may begin a call waits. A call block that does not parse, or one
    cut short, is content as it came."""

    def __init__(self, syntax: Hermes | Xml, schemas: dict[str, dict]):
        self.syntax, self.schemas = syntax, schemas
        self.held = ""  # outside a call: text that may begin one
        self.inside = False
        self._parts: list[str] = []  # inside a call: its text so far (joined once it ends: a long call is linear)
        self._tail = ""  # ... and its last characters (where the closing tag may have begun)
        self.after_call = False  # the last thing read was a call: blanks after it wait for what follows
        self.calls: list[ToolCall] = []
        self.content: list[str] = []

    def push(self, piece: str) -> list[tuple[str, ToolCall | None, int]]:
        out: list[tuple[str, ToolCall | None, int]] = []
        if self.inside:
            window = self._tail + piece
            if CLOSE not in window:
                self._parts.append(piece)
                self._tail = window[-(len(CLOSE) - 1):]
                return out
            buf, self._parts = "".join(self._parts) + piece, []
        else:
            buf, self.held = self.held + piece, ""
        while buf:
            if self.inside:
                end = buf.find(CLOSE)
                if end < 0:
                    self._parts, self._tail = [buf], buf[-(len(CLOSE) - 1):]
                    break
                call = self.syntax.read(buf[len(OPEN):end], self.schemas)
                raw, buf = buf[:end + len(CLOSE)], buf[end + len(CLOSE):]
                self.inside, self.after_call = False, call is not None
                out.append(self._text(raw) if call is None else self._call(call, raw))
            else:
                at = buf.find(OPEN)
                head = buf[:at] if at >= 0 else buf[:len(buf) - _partial_tail(buf, OPEN)]
                if self.after_call and not head.strip():  # blanks after a call (and perhaps a tag's start)
                    if at < 0:  # (wait: another call may follow)
                        self.held = buf
                        break
                    out.append(("", None, at))  # between two calls: not content
                    buf, at = buf[at:], 0
                self.after_call = False
                if at >= 0:
                    if at:
                        out.append(self._text(buf[:at]))
                    self.inside, buf = True, buf[at:]
                    continue
                keep = _partial_tail(buf, OPEN)
                if len(buf) > keep:
                    out.append(self._text(buf[:len(buf) - keep]))
                self.held = buf[len(buf) - keep:]
                break
        return out

    def flush(self) -> list[tuple[str, ToolCall | None, int]]:
        """The end of the reply: what was held is content (an unfinished call among it)."""
        held = "".join(self._parts) if self.inside else self.held
        self.held, self.inside, self._parts = "", False, []
        if self.after_call and not held.strip():  # (blanks after the last call)
            return [("", None, len(held))] if held else []
        return [self._text(held)] if held else []

    def _text(self, text: str) -> tuple[str, None, int]:
        self.content.append(text)
        return text, None, len(text)

    def _call(self, call: ToolCall, raw: str) -> tuple[str, ToolCall, int]:
        self.calls.append(call)
        return "", call, len(raw)

    def message_content(self) -> str | None:
        """The reply's content once its calls are taken out (as streamed): None when only blanks are left
        beside calls."""
        text = "".join(self.content)
        return None if self.calls and not text.strip() else text


def _partial_tail(text: str, tag: str) -> int:
    """The length of the longest end of ``text`` that begins ``tag`` (what may still become it)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0
