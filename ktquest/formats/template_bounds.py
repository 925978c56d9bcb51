"""The bounds of a chat template's render (``formats/chat_template.py``): the budget of the render in
progress (a deadline and a size cap, per thread/task), the size of values, and the checks of the
operations that can amplify, each measured before it runs. A bound hit is ``Exceeded``."""

from __future__ import annotations

import functools
import inspect
import re
import string
import time
from collections.abc import Iterable, Iterator, Mapping
from contextvars import ContextVar
from dataclasses import dataclass
from types import GeneratorType
from typing import Any

from jinja2.utils import Namespace

DEFAULT_MAX_CHARS = 4 * 2**20
DEFAULT_MAX_SECONDS = 5.0
_ITEM = 8  # a container's item costs at least this many characters (its pointer)
_MAX_DEPTH = 64  # values nested deeper are refused (a namespace holding itself)
_MAX_INT_BITS = 2**16  # integers built by * and ** (a 10**10**10 would run for hours in one C call)
_MAX_JSON_INDENT = 16
_MAX_SLOW_FILTER_INPUT = 2**16  # striptags and urlize: regexes that may take quadratic time
_MAX_SUM_ITEMS = 4096  # |sum over lists or strings copies the partial sum at each item: quadratic


@dataclass(frozen=True, slots=True)
class TemplateLimits:
    max_chars: int = DEFAULT_MAX_CHARS  # output, and any value inside the render
    max_seconds: float = DEFAULT_MAX_SECONDS

    @classmethod
    def for_context(cls, max_seq_len: int) -> TemplateLimits:
        """Room for any prompt that a context of ``max_seq_len`` tokens could hold (32 characters a token,
        8 times English text's average), and never less than the default."""
        return cls(max_chars=max(DEFAULT_MAX_CHARS, 32 * max_seq_len))


# ---- the budget of the render in progress ----


class Exceeded(Exception):
    """A bound of TemplateLimits was hit (the message says which)."""


class Budget:
    __slots__ = ("deadline", "limits")

    def __init__(self, limits: TemplateLimits):
        self.limits = limits
        self.deadline = time.monotonic() + limits.max_seconds

    def tick(self) -> None:
        if time.monotonic() > self.deadline:
            raise Exceeded(f"it ran longer than {self.limits.max_seconds:g} s")


# The render in progress, per thread/task. None while compiling (jinja folds constant filter calls then).
BUDGET: ContextVar[Budget | None] = ContextVar("ktquest_chat_template_budget", default=None)


def tick_budget() -> int:
    """Check the deadline; returns the size cap."""
    budget = BUDGET.get()
    if budget is None:
        return DEFAULT_MAX_CHARS
    budget.tick()
    return budget.limits.max_chars


def value_size(value: Any, cap: int, depth: int = 0) -> int:
    """Characters ``value`` takes as text (containers: their items'), counted until past ``cap``."""
    if isinstance(value, (str, bytes, bytearray)):
        return len(value)
    if value is None or isinstance(value, (bool, float)):
        return _ITEM
    if isinstance(value, int):
        return max(_ITEM, value.bit_length() // 3 + 1)
    if isinstance(value, Namespace):
        value = value._Namespace__attrs  # its attributes (jinja2 keeps them in this one dict)
    if isinstance(value, Mapping):
        items: Iterable[Any] = (x for kv in value.items() for x in kv)
    elif isinstance(value, (list, tuple, set, frozenset)):
        items = value
    else:
        return _ITEM  # ranges, functions, macros, undefined, loop objects: their text is short
    if depth >= _MAX_DEPTH:
        raise Exceeded(f"a value nested more than {_MAX_DEPTH} deep")
    total = 0
    for item in items:
        total += max(_ITEM, value_size(item, cap - total, depth + 1))
        if total > cap:
            break
    return total


def need_room(n: int, cap: int, what: str) -> None:
    if n > cap:
        raise Exceeded(f"{what} would build more than {cap:,} characters")


def checked_call(value: Any, cap: int) -> Any:
    if not isinstance(value, (GeneratorType, Iterator)) and value_size(value, cap) > cap:
        raise Exceeded(f"a value of more than {cap:,} characters")
    return value


# ---- checks of the operations that can amplify ----


def check_mul(left: Any, right: Any, cap: int) -> None:
    if isinstance(left, int) and isinstance(right, int):
        if left.bit_length() + right.bit_length() > _MAX_INT_BITS:
            raise Exceeded(f"'*' would build an integer of more than {_MAX_INT_BITS} bits")
        return
    for seq, n in ((left, right), (right, left)):
        if isinstance(n, int) and isinstance(seq, (str, bytes, list, tuple)) and n > 0:
            need_room(value_size(seq, cap) * n, cap, "'*'")


def check_pow(base: Any, exp: Any) -> None:
    if isinstance(base, int) and isinstance(exp, int) and exp > 0 and abs(base) > 1 \
            and (abs(base).bit_length() - 1) * exp > _MAX_INT_BITS:
        raise Exceeded(f"'**' would build an integer of more than {_MAX_INT_BITS} bits")


_PRINTF_FIELD = re.compile(r"%(?:\([^)]*\))?[-#0 +]*(\*|\d*)(?:\.(\*|\d*))?[hlL]?([a-zA-Z%])")


def check_printf(fmt: str | bytes, args: Any, cap: int) -> None:
    """``fmt % args``: its text, each field's width and precision, and the arguments' text."""
    if isinstance(fmt, bytes):
        fmt = fmt.decode("latin-1")
    fields = _PRINTF_FIELD.findall(fmt)
    if any(w == "*" or p == "*" for w, p, _ in fields):
        raise Exceeded("'%' with '*' widths is not allowed")
    values = list(args.values()) if isinstance(args, Mapping) else list(args) if isinstance(args, tuple) \
        else [args]
    biggest = max((value_size(v, cap) for v in values), default=0)
    need_room(len(fmt) + sum(int(w or 0) + int(p or 0) + biggest for w, p, _ in fields), cap, "'%'")


def check_format(fmt: str, args: tuple, kwargs: Mapping, cap: int) -> None:
    """``fmt.format(*args, **kwargs)``: each field takes at most its width and precision plus the largest
    argument."""
    biggest = max((value_size(v, cap) for v in (*args, *kwargs.values())), default=0)
    total = 0
    for literal, field, spec, _ in string.Formatter().parse(fmt):
        total += len(literal)
        if field is None:
            continue
        if spec and "{" in spec:
            raise Exceeded("format fields with nested '{}' widths are not allowed")
        total += biggest + sum(int(d) for d in re.findall(r"\d+", spec or ""))
    need_room(total, cap, "format()")


def _replace_size(s: str | bytes, old: Any, new: Any, count: Any) -> int:
    if not isinstance(old, (str, bytes)) or not isinstance(new, (str, bytes)):
        return len(s)
    hits = len(s) + 1 if not old else s.count(old)
    if isinstance(count, int) and count >= 0:
        hits = min(hits, count)
    return len(s) + hits * max(0, len(new) - len(old))


def _join_size(sep: Any, items: list, cap: int) -> int:
    return sum(value_size(x, cap) for x in items) + value_size(sep, cap) * max(0, len(items) - 1)


def check_text_method(s: str | bytes | bytearray, name: str, args: tuple, kwargs: dict, cap: int) -> tuple:
    """Methods of a string that can build a longer one; returns ``args`` (an iterable to join: as a list)."""
    def arg(i: int, key: str, default: Any) -> Any:
        return args[i] if len(args) > i else kwargs.get(key, default)

    if name in ("center", "ljust", "rjust", "zfill"):
        width = arg(0, "width", 0)
        need_room(max(len(s), width if isinstance(width, int) else 0), cap, f"{name}()")
    elif name == "expandtabs":
        tabsize = arg(0, "tabsize", 8)
        tabs = s.count("\t" if isinstance(s, str) else b"\t")
        need_room(len(s) + tabs * max(0, int(tabsize)), cap, "expandtabs()")
    elif name == "replace":
        size = _replace_size(s, arg(0, "old", None), arg(1, "new", None), arg(2, "count", -1))
        need_room(size, cap, "replace()")
    elif name == "join" and args:
        items = list(args[0])
        need_room(_join_size(s, items, cap), cap, "join()")
        return (items, *args[1:])
    elif name == "translate" and args:
        table = args[0]
        longest = max((value_size(v, cap) for v in table.values()), default=1) if isinstance(table, Mapping) else 1
        need_room(len(s) * max(1, longest), cap, "translate()")
    return args


def _filter_checks(name: str, a: dict[str, Any], cap: int) -> None:
    """Filters that can build much more than they are given, checked on their bound arguments ``a``."""
    if name == "center":
        need_room(max(value_size(a["value"], cap), a["width"] if isinstance(a["width"], int) else 0), cap, "center")
    elif name == "indent":
        s, width = str(a["s"]), a["width"]
        width = len(width) if isinstance(width, str) else width if isinstance(width, int) else 0
        need_room(len(s) + (s.count("\n") + 1) * max(0, width), cap, "indent")
    elif name == "wordwrap":
        wrap = a["wrapstring"] if isinstance(a["wrapstring"], str) else "\n"
        need_room(value_size(a["s"], cap) * (1 + len(wrap)), cap, "wordwrap")
    elif name == "replace":
        need_room(_replace_size(str(a["s"]), a["old"], a["new"], a["count"]), cap, "replace")
    elif name == "format":
        check_printf(str(a["value"]), a["kwargs"] or a["args"], cap)
    elif name in ("batch", "slice"):
        n = a["linecount"] if name == "batch" else a["slices"]
        need_room(n * _ITEM if isinstance(n, int) else 0, cap, name)
    elif name == "tojson" and isinstance(a["indent"], int) and a["indent"] > _MAX_JSON_INDENT:
        raise Exceeded(f"tojson(indent={a['indent']}): at most {_MAX_JSON_INDENT}")
    elif name in ("striptags", "urlize") and value_size(a["value"], cap) > _MAX_SLOW_FILTER_INPUT:
        raise Exceeded(f"{name} is limited to {_MAX_SLOW_FILTER_INPUT:,} characters")


_MATERIALIZED = {"join": "value", "sum": "iterable"}  # filters whose iterable is measured first (made a list)
_CHECKED_FILTERS = {"center", "indent", "wordwrap", "replace", "format", "batch", "slice", "tojson",
                    "striptags", "urlize", *_MATERIALIZED}


def bounded_filter(name: str, func: Any) -> Any:
    """``func`` with the deadline and the size of its result checked, and the checks of ``_filter_checks``."""
    if name not in _CHECKED_FILTERS:
        @functools.wraps(func)  # keeps jinja2's pass_context / pass_environment marks
        def measured(*args: Any, **kwargs: Any) -> Any:
            cap = tick_budget()
            return checked_call(func(*args, **kwargs), cap)

        return measured
    signature = inspect.signature(func)  # of the plain function: jinja2's async variants wrap it
    # an async variant of a filter that takes no context is called with the eval context first
    lead = int(hasattr(func, "jinja_pass_arg") and not hasattr(inspect.unwrap(func), "jinja_pass_arg"))

    @functools.wraps(func)
    def bounded(*args: Any, **kwargs: Any) -> Any:
        cap = tick_budget()
        bound = signature.bind(*args[lead:], **kwargs)
        bound.apply_defaults()
        a = bound.arguments
        if name in _MATERIALIZED:
            key = _MATERIALIZED[name]
            a[key] = items = list(a[key])
            if name == "join":
                need_room(_join_size(a["d"], items, cap), cap, "join")
            elif not isinstance(a["start"], (int, float)) and len(items) > _MAX_SUM_ITEMS:
                raise Exceeded(f"sum of more than {_MAX_SUM_ITEMS} lists or strings")
        _filter_checks(name, a, cap)
        return checked_call(func(*args[:lead], *bound.args, **bound.kwargs), cap)

    return bounded
