"""Chat templates: a model's jinja2 template rendered within bounds; every failure is one ChatTemplateError.
A model without one (a base model) chats as plain text (``PlainText``).

A chat template is code that comes with the model file. It runs in jinja2's ImmutableSandboxedEnvironment (no
private attributes, no changes to lists and dicts: what HF transformers uses too), within ``TemplateLimits``:

- size: the output, and every value the template reads, builds, passes or prints, holds at most ``max_chars``
  characters (a container counts its items' characters, at least ``_ITEM`` each). The operations that could
  build a huge value in one step are measured before they run: ``*``, ``**``, ``+``, ``~``, ``%`` and
  ``format`` (field widths), padding, ``replace``, ``join``, ``indent``, ``wordwrap``, ``batch``, ``slice``,
  ``sum``;
- time: ``max_seconds``, checked at every loop step, call, attribute or item read, operator and output piece
  (the generated code's loops iterate through ``tick_iter``, its ``~`` joins through ``join_checked``);
- recursion: Python's own limit (a macro calling itself ends in a RecursionError, reported like the rest).

The message names the problem and the template line: ``chat template: division by zero (line 3)``.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Iterable, Iterator, Mapping
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.sandbox
from jinja2 import nodes
from jinja2.compiler import CodeGenerator, optimizeconst

from ktquest.formats.template_bounds import (  # noqa: F401 - DEFAULT_MAX_* are this module's too
    BUDGET,
    DEFAULT_MAX_CHARS,
    DEFAULT_MAX_SECONDS,
    Budget,
    Exceeded,
    TemplateLimits,
    bounded_filter,
    check_format,
    check_mul,
    check_pow,
    check_printf,
    check_text_method,
    checked_call,
    need_room,
    tick_budget,
    value_size,
)


class ChatTemplateError(ValueError):
    """The model's chat template failed or went past its bounds; the message is one line: what and where."""


DEFAULT_LIMITS = TemplateLimits()
MAX_TEMPLATE_FILE = 1 << 20  # bytes: a template file larger than this is refused before it is read


def read_template_file(path: str | os.PathLike) -> str:
    """The Jinja text of a chat template file (``chat_template:``, ``--chat-template FILE``); a ChatTemplateError
    naming the file unless it is a UTF-8 file of at most ``MAX_TEMPLATE_FILE`` bytes whose template compiles and
    renders one user message."""
    p = Path(path)
    try:
        if not p.is_file():
            raise ChatTemplateError(f"{path}: no such file")
        if p.stat().st_size > MAX_TEMPLATE_FILE:
            raise ChatTemplateError(f"{path}: {p.stat().st_size:,} bytes, more than a chat template's "
                                    f"{MAX_TEMPLATE_FILE:,}")
        source = p.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ChatTemplateError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    except OSError as e:
        raise ChatTemplateError(f"{path}: {e.strerror or e}") from None
    if not source.strip():
        raise ChatTemplateError(f"{path}: the file is empty")
    try:
        ChatTemplate(source).render(messages=[{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                    bos_token="", eos_token="")
    except ChatTemplateError as e:
        raise ChatTemplateError(f"{path}: {e}") from None
    return source


class ChatTemplate:
    """A compiled chat template (a syntax error is a ChatTemplateError here already)."""

    def __init__(self, source: str):
        self.source = source
        env = _Environment()
        try:
            self._template = env.from_string(source)
        except jinja2.TemplateSyntaxError as e:
            what = f"chat template: syntax error at line {e.lineno}: {e.message}"
            raise ChatTemplateError(_one_line(what)) from None
        except Exception as e:  # noqa: BLE001 - whatever compiling the file's template raised, one line
            raise ChatTemplateError(_describe(e)) from None

    def render(self, limits: TemplateLimits = DEFAULT_LIMITS, /, **variables: Any) -> str:
        """The template's text for ``variables`` (messages, add_generation_prompt, bos_token, ...).

        Streams the output and stops past ``limits``; an empty or all-blank result is an error too.
        """
        budget = Budget(limits)
        token = BUDGET.set(budget)
        pieces: list[str] = []
        n = 0
        stream = self._template.generate(**variables)
        try:
            for piece in stream:
                n += len(piece)
                if n > limits.max_chars:
                    raise Exceeded(f"the output passed {limits.max_chars:,} characters")
                budget.tick()
                pieces.append(piece)
        except Exception as e:  # noqa: BLE001 - the template is the file's code: any failure is the template's
            raise ChatTemplateError(_describe(e)) from None
        finally:
            stream.close()
            BUDGET.reset(token)
        text = "".join(pieces)
        if not text.strip():
            raise ChatTemplateError("chat template: it rendered an empty prompt")
        return text


class PlainText:
    """What a model without a chat template (a base model) chats with: the conversation as one plain text that
    the model continues. Each system or user message starts a new line (the system prompt first, the document
    at the head of the first user message); the model continues the last message's text itself (completion
    style: "The capital of France is" -> " Paris."), so a reply joins the text as generated, with nothing
    between."""

    def render(self, limits: TemplateLimits = DEFAULT_LIMITS, /, *, messages: list[dict[str, Any]],
               **variables: Any) -> str:
        """The messages' text; ``limits`` and the template variables do not apply (no code runs)."""
        out: list[str] = []
        for m in messages:
            if out and m["role"] != "assistant":
                out.append("\n")
            out.append(m["content"])
        return "".join(out)


# ---- the environment ----


class _CodeGenerator(CodeGenerator):
    """jinja2's code generator with two hooks into the environment: each loop's iterable goes through
    ``environment.tick_iter`` (a step of the loop is a step of the clock) and ``~`` through
    ``environment.join_checked`` (measured before it is joined)."""

    def visit_Template(self, node: nodes.Template, frame: Any = None) -> None:
        for loop in node.find_all(nodes.For):
            loop.iter = nodes.Call(nodes.EnvironmentAttribute("tick_iter"), [loop.iter], [], None, None,
                                   lineno=loop.iter.lineno)
        super().visit_Template(node, frame)

    @optimizeconst
    def visit_Concat(self, node: nodes.Concat, frame: Any) -> None:
        self.write("environment.join_checked((")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")


class _Environment(jinja2.sandbox.ImmutableSandboxedEnvironment):
    """The sandbox HF transformers renders chat templates in, with every path to a large value measured."""

    code_generator_class = _CodeGenerator
    intercepted_binops = frozenset({"*", "**", "%", "+"})

    def __init__(self) -> None:
        super().__init__(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols],
                         finalize=self._finalize)
        self.globals.pop("lipsum", None)  # lorem ipsum of any length: no template needs it
        self.globals["raise_exception"] = _raise_exception
        self.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        self.filters["tojson"] = _tojson
        self.filters = {name: bounded_filter(name, f) for name, f in self.filters.items()}

    # every value printed by {{ }}, before it becomes text
    def _finalize(self, value: Any) -> Any:
        return checked_call(value, tick_budget())

    def tick_iter(self, iterable: Iterable[Any]) -> Iterator[Any]:
        for item in iterable:
            tick_budget()
            yield item

    def join_checked(self, values: tuple) -> str:
        cap = tick_budget()
        need_room(sum(value_size(v, cap) for v in values), cap, "'~'")
        return "".join(map(str, values))

    def concat(self, pieces: Iterable[str]) -> str:  # type: ignore[override]
        """Every buffer the template renders into (macro output, ``{% set %}`` blocks, filter blocks)."""
        pieces = list(pieces)
        need_room(sum(map(len, pieces)), tick_budget(), "a block")
        return "".join(pieces)

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        cap = tick_budget()
        if operator == "*":
            check_mul(left, right, cap)
        elif operator == "**":
            check_pow(left, right)
        elif operator == "%" and isinstance(left, (str, bytes)):
            check_printf(left, right, cap)
        elif operator == "+" and isinstance(left, (str, bytes, list, tuple)):
            need_room(value_size(left, cap) + value_size(right, cap), cap, "'+'")
        return checked_call(super().call_binop(context, operator, left, right), cap)

    def getattr(self, obj: Any, attribute: str) -> Any:
        cap = tick_budget()
        return checked_call(super().getattr(obj, attribute), cap)

    def getitem(self, obj: Any, argument: Any) -> Any:
        cap = tick_budget()
        return checked_call(super().getitem(obj, argument), cap)

    def wrap_str_format(self, value: Any) -> Any:
        fmt = super().wrap_str_format(value)
        if fmt is None:
            return None
        text, is_map = value.__self__, value.__name__ == "format_map"

        @functools.wraps(fmt)
        def checked_format(*args: Any, **kwargs: Any) -> str:
            cap = tick_budget()
            if is_map and args and isinstance(args[0], Mapping):
                check_format(text, (), args[0], cap)
            else:
                check_format(text, args, kwargs, cap)
            return checked_call(fmt(*args, **kwargs), cap)

        return checked_format

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: PYI063 - jinja2's
        cap = tick_budget()
        owner = getattr(__obj, "__self__", None)
        if isinstance(owner, (str, bytes, bytearray)) and callable(__obj):
            args = check_text_method(owner, getattr(__obj, "__name__", ""), args, kwargs, cap)
        return checked_call(super().call(__context, __obj, *args, **kwargs), cap)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


# ---- messages ----


def _describe(e: BaseException) -> str:
    if isinstance(e, Exceeded):
        what = str(e)
    elif isinstance(e, RecursionError):
        what = "recursion too deep (a macro that calls itself?)"
    elif isinstance(e, ZeroDivisionError):
        what = "division by zero"
    elif isinstance(e, MemoryError):
        what = "out of memory"
    elif isinstance(e, jinja2.TemplateError):
        what = e.message or type(e).__name__
    else:
        what = f"{type(e).__name__}: {e}"
    line = None
    tb = e.__traceback__
    while tb is not None:  # jinja2 rewrites the traceback so that template frames carry template lines
        if tb.tb_frame.f_code.co_filename == "<template>":
            line = tb.tb_lineno
        tb = tb.tb_next
    return _one_line(f"chat template: {what}" + (f" (line {line})" if line else ""))


def _one_line(text: str, limit: int = 300) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."
