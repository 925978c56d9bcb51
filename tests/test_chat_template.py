"""The bounded chat-template renderer: what templates do still works; templates that would render gigabytes,
run for hours, recurse, divide by zero or render nothing fail with one ChatTemplateError line, quickly."""

from __future__ import annotations

import time

import pytest

from ktquest.formats.chat_template import DEFAULT_MAX_CHARS, ChatTemplate, ChatTemplateError, TemplateLimits

LIMITS = TemplateLimits(max_chars=2**16, max_seconds=0.3)
MESSAGES = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi <b>there</b>"}]


def _render(source: str, limits: TemplateLimits = LIMITS) -> str:
    return ChatTemplate(source).render(limits, messages=MESSAGES, add_generation_prompt=True, bos_token="<s>")


def test_what_templates_do_still_works():
    source = (
        "{{ bos_token }}{% set ns = namespace(sys='') %}"
        "{% macro role(m) %}[{{ m.role | upper }}]{% endmacro %}"
        "{% for m in messages %}{% if m.role == 'system' %}{% set ns.sys = m['content'] %}{% continue %}"
        "{% endif %}"
        "{{ role(m) }}{{ (ns.sys ~ ' ' ~ m.content) | trim | replace('<b>', '*') | replace('</b>', '*') }}"
        "{% if not loop.last %}\n{% endif %}{% endfor %}"
        "|{{ 'x' * 3 }}|{{ 2 ** 10 }}|{{ '%s=%d' % ('n', 7) }}|{{ '{}:{:>4}'.format('w', 1) }}"
        "|{{ range(3) | join(',') }}|{{ {'a': [1]} | tojson }}|{{ 'a\nb' | indent(2) }}|{{ 'ab'.center(4) }}"
        "|{{ [[1], [2]] | sum(start=[]) }}|{{ range(5) | batch(2) | list | length }}|{{ 7 // 2 }}"
        "|{{ strftime_now('%Y') | length }}{% if add_generation_prompt %}|go{% endif %}"
    )
    assert _render(source) == ('<s>[USER]Be terse. Hi *there*|xxx|1024|n=7|w:   1|0,1,2|{"a": [1]}'
                               "|a\n  b| ab |[1, 2]|3|3|4|go")


# (template, what the one-line message says); each must fail within the time limit, allocating little
HOSTILE = {
    "string repeat": ("{{ 'a' * 10**9 }}", "'*' would build more than 65,536 characters (line 1)"),
    "list repeat": ("{{ ['a'] * 10**9 }}", "'*' would build more than"),
    "repeat of a big list": ("{% set l = ['x' * 1000] * 1000 %}{{ l }}", "'*' would build more than"),
    "big integer power": ("{{ 10 ** (10 ** 10) }}", "'**' would build an integer of more than 65536 bits"),
    "big integer square": ("{% set ns = namespace(n=3) %}{% for i in range(40) %}{% set ns.n = ns.n * ns.n %}"
                           + "{% endfor %}{{ ns.n }}", "'*' would build an integer"),
    "doubling with ~": ("{% set ns = namespace(s='a') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}"
                        + "{% endfor %}{{ ns.s }}", "'~' would build more than"),
    "doubling with +": ("{% set ns = namespace(s=['a']) %}{% for i in range(64) %}"
                        + "{% set ns.s = ns.s + ns.s %}{% endfor %}{{ ns.s }}", "'+' would build more than"),
    "doubling in a macro": ("{% macro f(s) %}{{ f(s ~ s) }}{% endmacro %}{{ f('a') }}", "'~' would build"),
    "output in a loop": ("{% for i in range(100000) %}{{ 'abcdefgh' }}{% endfor %}",
                         "the output passed 65,536 characters"),
    "block capture": ("{% set s = 'x' * 60000 %}{% set y %}{% for i in range(99) %}{{ s }}{% endfor %}"
                      + "{% endset %}{{ y | length }}", "a block would build more than"),
    "macro output": ("{% set s = 'x' * 60000 %}{% macro m() %}{{ s }}{{ s }}{% endmacro %}{{ m() | length }}",
                     "a block would build more than"),
    "printf width": ("{{ '%1000000000d' % 1 }}", "'%' would build more than"),
    "format width": ("{{ '{:>1000000000}'.format(1) }}", "format() would build more than"),
    "format filter": ("{{ '%1000000000s' | format('a') }}", "'%' would build more than"),
    "center": ("{{ 'a' | center(10**9) }}", "center would build more than"),
    "str.center": ("{{ 'a'.center(1000000000) }}", "center() would build more than"),
    "str.replace": ("{% set s = 'a' * 60000 %}{{ s.replace('', s) }}", "replace() would build more than"),
    "replace filter": ("{% set s = 'a' * 60000 %}{{ s | replace('a', s) }}", "replace would build more than"),
    "join": ("{{ range(100000) | join('x' * 60000) }}", "join would build more than"),
    "indent": ("{% set s = '\n' * 60000 %}{{ s | indent(60000) }}", "indent would build more than"),
    "batch fill": ("{{ [1] | batch(10**9, 'x') | list }}", "batch would build more than"),
    "sum of lists": ("{{ range(100000) | batch(1) | sum(start=[]) }}", "sum of more than 4096 lists"),
    "nested loops": ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}x",
                     "it ran longer than 0.3 s"),
    "nested loops over a variable": ("{% set r = 'x' * 60000 %}{% for i in r %}{% for j in r %}"
                                     + "{% endfor %}{% endfor %}x", "it ran longer than 0.3 s"),
    "many small items": ("{% set s = 'ab ' * 20000 %}{{ s.split() | length }}", "a value of more than"),
    "branching recursion": ("{% macro f(n) %}{% if n < 60 %}{{ f(n + 1) }}{{ f(n + 1) }}{% endif %}"
                            + "{% endmacro %}{{ f(0) }}x", "it ran longer than 0.3 s"),
    "recursion": ("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", "recursion too deep"),
    "division by zero": ("{% for m in messages %}\n{{ 1 / 0 }}{% endfor %}", "division by zero (line 2)"),
    "integer division by zero": ("{{ 7 // 0 }}", "division by zero"),
    "modulo by zero": ("{{ 7 % 0 }}", "division by zero"),
    "range too big": ("{{ range(10**9) | list }}", "Range too big"),
    "raise_exception": ("{{ raise_exception('Conversation roles must alternate') }}",
                        "Conversation roles must alternate (line 1)"),
    "missing key": ("{{ messages[0].nope.deeper }}", "'dict object' has no attribute 'nope'"),
    "type error": ("{{ 'a' + 1 }}", "TypeError"),
    "sandbox": ("{{ messages.__class__.__mro__ }}", "is unsafe"),
    "empty prompt": ("{% for m in messages %}{% endfor %}", "it rendered an empty prompt"),
    "blank prompt": ("{% for m in messages %}\n\n{% endfor %}", "it rendered an empty prompt"),
    "syntax": ("{% for m in messages %}", "syntax error at line 1"),
}


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_hostile_template_fails_fast_in_one_line(bounded_process, name):
    source, message = HOSTILE[name]
    t0 = time.monotonic()
    with bounded_process(LIMITS.max_seconds + 5.0, 1 << 28), pytest.raises(ChatTemplateError) as info:
        _render(source)  # (a bound that does not hold: "out of memory" or Hung, the machine unharmed)
    assert time.monotonic() - t0 < LIMITS.max_seconds + 1.0
    text = str(info.value)
    assert text.startswith("chat template: ") and "\n" not in text and message in text, text


def test_limits_follow_the_context():
    assert TemplateLimits.for_context(4096).max_chars == DEFAULT_MAX_CHARS
    assert TemplateLimits.for_context(2**20).max_chars == 32 * 2**20
    doc = "word " * 100_000  # a long document is fine within the default limits
    out = ChatTemplate("{% for m in messages %}{{ m.content }}{% endfor %}").render(
        TemplateLimits(), messages=[{"role": "user", "content": doc}])
    assert out == doc
