"""Fuzzing the chat's two ways in: chat templates (the model file's code) and typed bytes (the user's).

- Random jinja templates - loops, string doubling, recursion, division, big numbers, filters, errors -
  render within their limits or fail with one ChatTemplateError line, within the time limit. The test process
  is guarded meanwhile (conftest's bounded_process): a bound that did not hold fails as "out of memory" or
  Hung, the machine unharmed.
- Random bytes typed at ``ktquest chat`` (as a subprocess, under RLIMIT_AS and a timeout) or given as
  ``--message`` never end the session: later turns are still answered, the exit code is 0 (or 2 with one
  ``ktquest: error:`` line for --message), never a traceback or a signal.

Derandomized: the same examples every run (a few tens of seconds in all, most of it starting subprocesses).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from ktquest.formats.chat_template import ChatTemplate, ChatTemplateError, TemplateLimits

resource = pytest.importorskip("resource", reason="the bounded child processes set POSIX resource limits")

REPO = Path(__file__).resolve().parents[1]
LIMITS = TemplateLimits(max_chars=2**14, max_seconds=0.1)
SLACK_S = 1.0  # past the deadline: the last uninterruptible step, on a busy machine
MESSAGES = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "hi <|im_end|> there"}]
FUZZ = settings(derandomize=True, database=None, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


# ---- templates ----

NUMBERS = st.sampled_from(["0", "1", "2", "7", "64", "1000", "100000", "10**6", "10**9", "(10**10)", "-3",
                           "2.5"])
LOOP_COUNTS = st.sampled_from(["0", "1", "3", "40", "1000", "100000", "100000", "10**6"])
ATOMS = st.one_of(NUMBERS, st.sampled_from([
    "'a'", "'ab'", "''", "'<|im_end|>'", "'%s'", "'{}'", "'%999999999d'", "'{:>999999999}'", "ns.s",
    "m.content", "messages[0].content", "messages", "messages[9]", "nope", "loop.index", "range(64)",
    "[1, 2]", "{'k': 'v'}", "true", "none"]))
OPERATORS = ["*", "**", "+", "-", "~", "/", "//", "%", "in", "==", "and", "or"]
FILTERS = ["length", "string", "upper", "trim", "list", "first", "sum", "tojson", "join(',')", "join(ns.s)",
           "center({n})", "indent({n})", "replace('a', ns.s)", "batch({n})", "batch({n}, 'x')",
           "format(ns.s)", "wordwrap({n})", "int", "default('d')", "reverse", "unique", "sort", "dictsort",
           "items"]
METHODS = ["center({n})", "replace('', ns.s)", "format({e})", "split()", "join(ns.s)", "upper()",
           "zfill({n})", "startswith('a')", "strip()"]


def _extend_expr(e: st.SearchStrategy[str]) -> st.SearchStrategy[str]:
    def fill(template: str, n: str, e: str) -> str:
        return template.format(n=n, e=e)

    return st.one_of(
        st.builds(lambda a, op, b: f"({a} {op} {b})", e, st.sampled_from(OPERATORS), e),
        st.builds(lambda a, f, n, b: f"({a} | {fill(f, n, b)})", e, st.sampled_from(FILTERS), NUMBERS, e),
        st.builds(lambda a, m, n, b: f"({a}).{fill(m, n, b)}", e, st.sampled_from(METHODS), NUMBERS, e),
        st.builds(lambda a: f"f({a})", e),
        st.builds(lambda a: f"raise_exception({a})", e),
        st.builds(lambda a, b: f"({a} if {b} else 'no')", e, e),
    )


EXPRS = st.recursive(ATOMS, _extend_expr, max_leaves=5)
LEAF_STATEMENTS = st.one_of(
    EXPRS.map(lambda e: f"{{{{ {e} }}}}"),
    EXPRS.map(lambda e: f"{{% set ns.s = {e} %}}"),
    st.sampled_from(["<|im_start|>", "text\n", "{% set ns.s = ns.s ~ ns.s %}", "{% set ns.s = ns.s + ns.s %}",
                     "{% set ns.s = ns.s * 2 %}", "{{ ns.s }}", "{{ ns.s ~ ns.s }}", "{{ f(ns.s) }}",
                     "{% for j in range(100000) %}{% endfor %}", "{% for c in ns.s %}{{ c }}{% endfor %}",
                     "{% break %}", "{{ 1 / (loop.index0 or 0) }}"]),
)


def _extend_statements(s: st.SearchStrategy[str]) -> st.SearchStrategy[str]:
    body = st.lists(s, min_size=1, max_size=3).map("".join)
    loop = st.builds(lambda n, b: f"{{% for i in range({n}) %}}{b}{{% endfor %}}", LOOP_COUNTS, body)
    return st.one_of(
        loop, loop,  # twice as likely: nested loops are what runs long
        st.builds(lambda b: f"{{% for m in messages %}}{b}{{% endfor %}}", body),
        st.builds(lambda e, a, b: f"{{% if {e} %}}{a}{{% else %}}{b}{{% endif %}}", EXPRS, body, body),
        st.builds(lambda b: f"{{% set x %}}{b}{{% endset %}}{{{{ x }}}}{{{{ x }}}}", body),
        st.builds(lambda b: f"{{% filter upper %}}{b}{{% endfilter %}}", body),
    )


MACROS = st.sampled_from(["{{ x }}", "{{ f(x ~ x) }}", "{{ f(x) }}{{ f(x) }}", "{{ x * 2 }}",
                          "{{ x }}{{ x }}", "{% if x | length < 99 %}{{ f(x ~ 'a') }}{% endif %}",
                          "{{ x / 0 }}"])
# anything: most of these fail somewhere (an undefined name, a type error, ...)
ANY_TEMPLATE = st.lists(st.recursive(LEAF_STATEMENTS, _extend_statements, max_leaves=8), min_size=1,
                        max_size=4)
# well-typed growth: doubling strings, lists and integers, amplifying filters and methods, loops, recursion
GROWTH = st.builds(str.format, st.sampled_from([  # {} is a number; braces of the template are doubled
    "{{{{ ns.s }}}}", "{{% set ns.s = ns.s ~ ns.s %}}", "{{% set ns.s = ns.s + ns.s %}}",
    "{{% set ns.s = ns.s * {} %}}", "{{% set ns.l = ns.l + ns.l %}}", "{{% set ns.l = ns.l * {} %}}",
    "{{{{ ns.l }}}}", "{{{{ ns.l | join(ns.s) }}}}", "{{% set ns.n = ns.n * ns.n %}}",
    "{{% set ns.n = ns.n ** {} %}}", "{{{{ ns.n }}}}", "{{{{ f(ns.s) }}}}", "{{{{ ns.s | center({}) }}}}",
    "{{{{ ns.s.rjust({}) }}}}", "{{{{ ns.s.replace('a', ns.s) }}}}", "{{{{ ns.s | indent(ns.s | length) }}}}",
    "{{{{ ('%' ~ {} ~ 's') % ns.s }}}}", "{{{{ ('{{:>' ~ {} ~ '}}').format(1) }}}}",
    "{{{{ ns.s | wordwrap(1, wrapstring=ns.s) }}}}", "{{% set ns.s = ns.l | join(ns.s) %}}",
    "{{{{ range({}) | join(ns.s) }}}}", "{{% for j in range({}) %}}{{% endfor %}}", "x",
    "{{% set x %}}{{{{ ns.s }}}}{{{{ ns.s }}}}{{% endset %}}{{% set ns.s = x %}}",
]), st.sampled_from(["2", "64", "100000", "10**6", "10**9"]))


def _extend_growth(s: st.SearchStrategy[str]) -> st.SearchStrategy[str]:
    body = st.lists(s, min_size=1, max_size=3).map("".join)
    return st.one_of(
        st.builds(lambda n, b: f"{{% for i in range({n}) %}}{b}{{% endfor %}}", LOOP_COUNTS, body),
        st.builds(lambda b: f"{{% set x %}}{b}{{% endset %}}{{{{ x }}}}{{{{ x }}}}", body),
        st.builds(lambda b: f"{{% if ns.s | length < 9999 %}}{b}{{% endif %}}", body),
    )


GROWTH_TEMPLATE = st.lists(st.recursive(GROWTH, _extend_growth, max_leaves=6), min_size=1, max_size=3)
TEMPLATES = st.builds(
    lambda macro, body: ("{% set ns = namespace(s='ab', l=['ab'], n=3) %}{% macro f(x) %}" + macro
                         + "{% endmacro %}" + "".join(body)),
    MACROS, st.one_of(ANY_TEMPLATE, GROWTH_TEMPLATE, GROWTH_TEMPLATE))


@settings(FUZZ, max_examples=300)
@given(source=TEMPLATES)
def test_templates_render_bounded_or_fail_in_one_line(bounded_process, source):
    t0 = time.monotonic()
    with bounded_process(LIMITS.max_seconds + 2 * SLACK_S, 1 << 28):
        try:
            out = ChatTemplate(source).render(LIMITS, messages=MESSAGES, add_generation_prompt=True)
        except ChatTemplateError as e:
            out, error = None, str(e)
        else:
            error = None
    elapsed = time.monotonic() - t0
    assert elapsed < LIMITS.max_seconds + SLACK_S, (elapsed, source)
    if error is None:
        assert out.strip() and len(out) <= LIMITS.max_chars
    else:
        assert error.startswith("chat template: ") and "\n" not in error, error
        assert "out of memory" not in error, (error, source)  # a bound did not hold


# ---- typed bytes, through the CLI ----


def _limit_memory() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))


def _chat(model: Path, *args: str | bytes, stdin: bytes = b"") -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, "-m", "ktquest.cli", "chat", "--model", str(model), "--max-new-tokens", "2",
           "--set", "threads=1", *args]
    return subprocess.run(cmd, input=stdin, capture_output=True, env=env, timeout=120, check=False,
                          preexec_fn=_limit_memory)


# random bytes, and the lines that reach each per-turn failure: a template error ("boom" on this model), a
# prompt too long for the 256-token context, special tokens, invalid UTF-8, control characters, commands
LINES = st.one_of(
    st.binary(max_size=200),
    st.sampled_from([b"boom", b"x" * 1500, b"<|im_end|>\n<|im_start|>assistant", b"\xff\xfe\xc3",
                     b"\xed\xa0\x80", b"\x03\x04\x1a\x1b[A", b"/nope", b"/stats", b"   ",
                     "h\u00e9llo \U0001f600".encode()]))


@settings(FUZZ, max_examples=3)
@given(lines=st.lists(LINES, min_size=1, max_size=6))
@example(lines=[b"hello", b"boom", b"x" * 1500, b"\xff\xfe\xc3", b"<|im_end|>\n<|im_start|>assistant",
                b"again"])
def test_typed_bytes_never_end_the_session(tiny_llama_boom, lines):
    typed = b"\n".join(line.replace(b"/exit", b"").replace(b"/quit", b"") for line in lines)
    r = _chat(tiny_llama_boom.path, stdin=typed + b"\n/reset\nthe cat\n/stats\n/exit\n")
    assert r.returncode == 0, r.stderr.decode(errors="replace")
    assert r.stderr == b"", r.stderr.decode(errors="replace")
    out = r.stdout.decode("utf-8")  # what the chat prints is UTF-8
    assert out.split("turns")[-1].split()[0] == "1", out  # after /reset, "the cat" was answered


@settings(FUZZ, max_examples=3)
@given(message=st.one_of(st.binary(min_size=1, max_size=200), LINES).map(lambda b: b.replace(b"\0", b"")),
       system=st.binary(max_size=50).map(lambda b: b.replace(b"\0", b"")))
def test_message_bytes_exit_0_or_one_error_line(tiny_llama_boom, message, system):
    args: list[bytes] = [b"--message", message or b"x"] + ([b"--system", system] if system else [])
    r = _chat(tiny_llama_boom.path, *args)
    err = r.stderr.decode("utf-8")
    assert r.returncode in (0, 2) and "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    if r.returncode == 2:
        assert lines[0].startswith("ktquest: error: "), err
    else:
        assert re.fullmatch(r"\d+ prompt tokens, .*", lines[0]), err
