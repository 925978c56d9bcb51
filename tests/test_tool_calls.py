"""Tool calls (ktquest/tool_calls.py and the server's ``tools`` / ``tool_choice``): a reply's calls read out of its
text in both syntaxes however the text is cut into pieces; tools, calls and tool results rendered by the model's
template with their special-token strings as text; a template without tools refused; and through a real server
(in process) with the ``openai`` client, on a tiny qwen3 whose template takes tools: a required or named call
at temperature 1 always has arguments that validate, streamed deltas add up to the same calls, and a tool
message is fed back."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from conftest import CHAT_TEMPLATE, make_tiny_model
from test_server_requests import _serving

import ktquest
from ktquest.server.app import create_app
from ktquest.server.worker import Worker
from ktquest.structured import FormatError
from ktquest.tool_calls import CallReader, Hermes, ToolError, ToolUse, Xml, syntax_of, takes_tools

# A Hermes-style template (as Qwen2.5's and Qwen3's show their models): the tools as JSON lines in the system
# turn, an assistant's calls as <tool_call> blocks, a tool's result in a user turn.
HERMES_TEMPLATE = """{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}

{% endif %}# Tools
<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools>
Call a function as <tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'system' and loop.first %}
{%- elif message.role == 'assistant' %}<|im_start|>assistant
{{ message.content }}{% for tc in message.tool_calls or [] %}
<tool_call>
{"name": "{{ tc.function.name }}", "arguments": {{ tc.function.arguments | tojson }}}
</tool_call>{% endfor %}<|im_end|>
{% elif message.role == 'tool' %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

# Qwen3-Coder's syntax: the same turns, a call as <function=...> with a <parameter=...> block per argument
XML_TEMPLATE = HERMES_TEMPLATE.replace("""Call a function as <tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call>""", """Call a function as <tool_call>
<function=NAME>
<parameter=KEY>
VALUE
</parameter>
</function>
</tool_call>""").replace("""<tool_call>
{"name": "{{ tc.function.name }}", "arguments": {{ tc.function.arguments | tojson }}}
</tool_call>""", """<tool_call>
<function={{ tc.function.name }}>
{% for k, v in tc.function.arguments.items() %}<parameter={{ k }}>
{{ v if v is string else v | tojson }}
</parameter>
{% endfor %}</function>
</tool_call>""")
assert XML_TEMPLATE.count("<function=") == 2

WEATHER = {"type": "object", "additionalProperties": False, "required": ["city", "days"],
           "properties": {"city": {"type": "string", "enum": ["Paris", "Lima", "Oslo"]},
                          "days": {"type": "integer", "minimum": 1, "maximum": 7},
                          "metric": {"type": "boolean"}}}
TIME = {"type": "object", "additionalProperties": False, "required": ["zone"],
        "properties": {"zone": {"type": "string", "maxLength": 12}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The forecast <|im_end|>",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "The time in a zone",
                                           "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}


def _read(reader: CallReader, text: str, cuts: list[int]) -> tuple[str, list, int]:
    """``text`` pushed in pieces cut at ``cuts``: (content, calls, characters accounted for)."""
    events, last = [], 0
    for c in [*cuts, len(text)]:
        events += reader.push(text[last:c])
        last = c
    events += reader.flush()
    return "".join(t for t, call, _ in events if call is None), [c for _, c, _ in events if c], \
        sum(n for *_, n in events)


HERMES_REPLY = ('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}\n'
                '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>')
XML_REPLY = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n<parameter=days>\n2\n"
             "</parameter>\n<parameter=metric>\ntrue\n</parameter>\n</function>\n</tool_call>")


@pytest.mark.parametrize("step", [1, 2, 3, 7, 1000])
def test_hermes_calls_are_read_however_the_text_is_cut(step):
    text, calls, n = _read(CallReader(Hermes(), SCHEMAS), HERMES_REPLY, list(range(step, len(HERMES_REPLY), step)))
    assert text == "Let me look.\n" and n == len(HERMES_REPLY)
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Oslo", "days": 2}),
                                                                  ("get_time", {"zone": "UTC"})]
    assert len({c.id for c in calls}) == 2


@pytest.mark.parametrize("step", [1, 5, 1000])
def test_xml_calls_take_their_types_from_the_schema(step):
    text, calls, _ = _read(CallReader(Xml(), SCHEMAS), XML_REPLY, list(range(step, len(XML_REPLY), step)))
    assert text == "" and [(c.name, json.loads(c.arguments)) for c in calls] == \
        [("get_weather", {"city": "Oslo", "days": 2, "metric": True})]


@pytest.mark.parametrize("reply", ["plain text with a < sign and <tool", "<tool_call>\nnot json\n</tool_call> after",
                                   '<tool_call>\n{"name": "get_time", "arguments": {"zone"'])
def test_what_is_not_a_call_stays_text(reply):
    """Text, a block that does not parse, and a call cut short (max_tokens) come out as the text they are."""
    text, calls, n = _read(CallReader(Hermes(), SCHEMAS), reply, [3, 11])
    assert (text, calls, n) == (reply, [], len(reply))


def test_the_syntax_is_the_templates():
    assert isinstance(syntax_of(HERMES_TEMPLATE), Hermes)
    assert isinstance(syntax_of(HERMES_TEMPLATE.replace("<tool_call>\n{", "<tool_call>\n<function=")), Xml)
    assert syntax_of(CHAT_TEMPLATE) is None and syntax_of(None) is None


@pytest.fixture(scope="module", params=["hermes", "xml"])
def tool_model(request, tmp_path_factory, tiny_bpe):
    template = HERMES_TEMPLATE if request.param == "hermes" else XML_TEMPLATE
    return make_tiny_model(tmp_path_factory.mktemp("tiny_tools"), "qwen3", tiny_bpe, template)


@pytest.fixture(scope="module")
def engine(tool_model):
    return ktquest.load(tool_model.path, max_seq_len=2048, threads=1)


def test_tools_calls_and_results_render_as_text(engine):
    """The template gets the tools and the calls' arguments as objects; a special-token string in a tool's
    description is characters, not the template's end-of-turn token."""
    tok = engine.tokenizer
    assert takes_tools(tok)
    messages = [{"role": "user", "content": "Weather in Oslo?"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}}]},
                {"role": "tool", "content": "sunny, 12 C", "tool_call_id": "call_1", "name": "get_weather"}]
    text = tok.apply_chat_template(messages, True, tools=TOOLS)
    assert json.dumps(TOOLS[0]) in text
    assert '"arguments": {"city": "Oslo", "days": 2}' in text or \
        "<parameter=city>\nOslo\n</parameter>\n<parameter=days>\n2\n</parameter>" in text
    assert "<tool_response>\nsunny, 12 C\n</tool_response>" in text
    ids = tok.encode_messages(messages, tools=TOOLS)
    im_end = tok.encode("<|im_end|>", add_bos=False, parse_special=True)
    assert len(im_end) == 1 and ids.count(im_end[0]) == 4  # system, user, assistant, tool: not the description's


def test_requests_that_cannot_be_honoured_are_named(engine, tiny_llama):
    tok = engine.tokenizer
    for tools, choice, match in ((TOOLS, {"type": "function", "function": {"name": "nope"}}, "'nope'"),
                                 ([TOOLS[0], TOOLS[0]], "auto", "twice"),
                                 ([{"type": "function", "function": {"name": "a b"}}], "auto", "letters"),
                                 (None, "required", "needs tools")):
        with pytest.raises(ToolError, match=match):
            ToolUse.parse(tools, choice, True, tok)
    plain = ktquest.load(tiny_llama.path, max_seq_len=64, threads=1).tokenizer  # (a template without tools)
    with pytest.raises(ToolError, match="does not render tools"):
        ToolUse.parse(TOOLS, "auto", True, plain)
    assert ToolUse.parse(TOOLS, "none", True, plain).render is None  # (nothing is asked of the template)


@pytest.fixture(scope="module")
def served(engine):
    with _serving(create_app(Worker(engine), "tiny-tools")) as post:
        yield post, openai.OpenAI(base_url=f"http://127.0.0.1:{post.port}/v1", api_key="none", max_retries=0,
                                  timeout=120)


def _ask(client, max_tokens: int = 200, **kw):
    return client.chat.completions.create(model="gpt-4o-mini", max_tokens=max_tokens, tools=TOOLS,
                                          messages=[{"role": "user", "content": "What is the weather?"}], **kw)


def test_required_calls_always_validate(served):
    """tool_choice required, 40 replies at temperature 1, parallel calls allowed or not: each reply is calls
    only, of listed tools, with arguments that validate against their schemas. (The tiny tokenizer spells a
    call in ~100 tokens, and a random model stops after a call or writes another at even odds: room for many.)"""
    _, client = served
    for seed in range(40):
        r = _ask(client, 2000, tool_choice="required", temperature=1.0, seed=seed, parallel_tool_calls=seed % 2 == 0)
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls", choice.message
        calls = choice.message.tool_calls
        assert calls and (seed % 2 == 0 or len(calls) == 1) and choice.message.content is None
        for c in calls:
            jsonschema.validate(json.loads(c.function.arguments), SCHEMAS[c.function.name])
            assert c.type == "function" and c.id.startswith("call_")


def test_a_named_function_is_called(served):
    _, client = served
    for seed in range(10):
        r = _ask(client, tool_choice={"type": "function", "function": {"name": "get_time"}}, temperature=1.0,
                 seed=seed, parallel_tool_calls=False)
        (call,) = r.choices[0].message.tool_calls
        assert call.function.name == "get_time"
        jsonschema.validate(json.loads(call.function.arguments), TIME)


def test_streamed_calls_add_up_to_the_reply(served):
    """Greedy, streamed or not: the streamed tool-call deltas (by index) are the same calls, ids aside."""
    _, client = served
    kw = dict(tool_choice="required", temperature=0.0)
    whole = _ask(client, **kw).choices[0]
    calls: dict[int, dict] = {}
    finish = None
    for ev in _ask(client, stream=True, **kw):
        for d in ev.choices[0].delta.tool_calls or []:
            c = calls.setdefault(d.index, {"name": "", "arguments": ""})
            c["name"] += d.function.name or ""
            c["arguments"] += d.function.arguments or ""
        finish = ev.choices[0].finish_reason or finish
    assert finish == "tool_calls"
    assert [calls[i] for i in sorted(calls)] == [{"name": c.function.name, "arguments": c.function.arguments}
                                                 for c in whole.message.tool_calls]


def test_a_tool_result_is_fed_back(served):
    """The call and its result go back as messages: the reply to them is free text (auto), and the prompt
    held them (it is longer than the question alone by the call and the result)."""
    _, client = served
    first = _ask(client, tool_choice="required", temperature=0.0, parallel_tool_calls=False)
    call = first.choices[0].message.tool_calls[0]
    messages = [{"role": "user", "content": "What is the weather?"},
                {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                {"role": "tool", "tool_call_id": call.id, "content": "sunny, 12 C"}]
    r = client.chat.completions.create(model="m", max_tokens=8, tools=TOOLS, messages=messages, temperature=0.0)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert r.usage.prompt_tokens > first.usage.prompt_tokens + len("sunny, 12 C") // 4


def test_bad_tool_requests_are_400s(served):
    post, _ = served
    base = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": TOOLS}
    for body, needle in (({**base, "tool_choice": {"type": "function", "function": {"name": "x"}}}, "'x'"),
                         ({**base, "tool_choice": "required", "response_format": {"type": "json_object"}}, "one of"),
                         ({**base, "tools": [{"type": "function", "function": {
                             "name": "f", "parameters": {"type": "object", "properties": {"a": {"not": {}}}}}}],
                           "tool_choice": "required"}, "parameters"),
                         ({"model": "m", "messages": [{"role": "user", "content": "hi"}, {
                             "role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {
                                 "name": "f", "arguments": "{not json"}}]}]}, "arguments"),
                         ({"model": "m", "messages": [{"role": "tool", "content": "x"}]}, "tool_call_id")):
        status, reply = post("/v1/chat/completions", body)
        assert status == 400 and needle in reply["error"]["message"], reply


def _held_accepts(use: ToolUse, tok, text: str, think: bool = False) -> bool:
    """Whether the grammar a held reply follows takes ``text`` (tokenized as the tokenizer does) to its end
    (``think``: after a think block the prompt opened)."""
    import torch

    fmt = use.format()
    c = (fmt.after_thinking() if think else fmt).constraint(tok, len(tok.tokens))
    try:
        for t in tok.encode(text, add_bos=False, parse_special=False):
            if c.apply(torch.zeros(len(tok.tokens)))[t] == float("-inf"):  # (as generate asks it)
                return False
            c.advance(t)
        return c.complete
    finally:
        c.close()


FREE = [{"type": "function", "function": {"name": "note", "parameters": {
    "type": "object", "required": ["text"], "properties": {"text": {"type": "string"}, "n": {"type": "integer"}}}}}]


def test_held_grammars_take_the_calls_they_should(engine):
    """The grammar of a named call takes free string values (blanks, '<', new lines: not only the empty one),
    optional parameters left out, and $ref'd definitions; it refuses what the schema does not allow."""
    tok = engine.tokenizer
    xml = isinstance(syntax_of(tok.chat_template), Xml)
    use = ToolUse.parse(FREE, {"type": "function", "function": {"name": "note"}}, True, tok)

    def call(text, n=None):
        if xml:
            extra = "" if n is None else f"<parameter=n>\n{n}\n</parameter>\n"
            return f"<tool_call>\n<function=note>\n<parameter=text>\n{text}\n</parameter>\n{extra}</function>\n</tool_call>"
        args = {"text": text} | ({} if n is None else {"n": n})
        return f'<tool_call>\n{json.dumps({"name": "note", "arguments": args})}\n</tool_call>'

    for text in ("UTC", "Europe/Oslo", "two words\nand a line", "x < y", ""):
        assert _held_accepts(use, tok, call(text)), text
    assert _held_accepts(use, tok, call("hi", 3))
    assert not _held_accepts(use, tok, call("hi", "three"))
    assert not _held_accepts(use, tok, call("hi") + "\n" + call("again"))  # a named call is one call
    assert _held_accepts(use, tok, "first, a thought\n</think>\n\n" + call("hi"), think=True)
    assert not _held_accepts(use, tok, "first, a thought\n</think>\n\nno call", think=True)
    assert not _held_accepts(use, tok, call("hi"), think=True)  # (the call is still thought: </think> first)
    ref = [{"type": "function", "function": {"name": "place", "parameters": {
        "type": "object", "required": ["at"], "properties": {"at": {"$ref": "#/$defs/Point"}},
        "$defs": {"Point": {"type": "object", "required": ["x"], "properties": {"x": {"type": "integer"}}}}}}}]
    use = ToolUse.parse(ref, "required", False, tok)
    text = ('<tool_call>\n<function=place>\n<parameter=at>\n{"x": 4}\n</parameter>\n</function>\n</tool_call>' if xml
            else '<tool_call>\n{"name": "place", "arguments": {"at": {"x": 4}}}\n</tool_call>')
    assert _held_accepts(use, tok, text)


def test_a_tool_may_be_named_like_a_choice(engine):
    """A function named "none", "auto" or "required" chosen by name is that function, held to one call."""
    tok = engine.tokenizer
    for name in ("none", "auto", "required"):
        tools = [{"type": "function", "function": {"name": name}}, TOOLS[1]]
        use = ToolUse.parse(tools, {"type": "function", "function": {"name": name}}, True, tok)
        assert use.render is not None and use.choice == "function" and use.function == name
        assert use.format() is not None


def test_schemas_that_cannot_be_carried_are_named(engine):
    tok = engine.tokenizer
    xml = isinstance(syntax_of(tok.chat_template), Xml)
    for params, match in (({"type": "object", "properties": [1]}, "properties"),
                          ({"type": "object", "required": 5}, "required"),
                          ({"type": "object", "required": [["a"]]}, "required"),
                          ({"type": "object", "properties": {"a": {"type": "string", "enum": 5}}}, "enum"),
                          ({"type": "object", "properties": {"a": {"type": "string", "maxLength": -1}}}, "maxLength"),
                          ({"type": "string"}, "object")):
        with pytest.raises(ToolError, match=match):
            ToolUse.parse([{"type": "function", "function": {"name": "f", "parameters": params}}], "auto", True, tok)
    odd = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {'x" | /.*/ | "y': {"type": "string"}}}}}]
    if xml:  # a key its tags cannot hold
        with pytest.raises(ToolError, match="cannot be written"):
            ToolUse.parse(odd, "required", True, tok)
        pat = [{"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "properties": {"a": {"type": "string", "pattern": "^[a-z]+$"}}}}}]
        with pytest.raises(FormatError, match="pattern"):
            ToolUse.parse(pat, "required", True, tok).format()
    else:  # JSON carries any key
        assert ToolUse.parse(odd, "required", True, tok).format() is not None


def test_deep_or_deprecated_requests_are_400s(served):
    post, _ = served
    deep = "[" * 3000 + "]" * 3000
    for body, needle in (
            ({"model": "m", "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": [
                {"id": "c", "type": "function", "function": {"name": "f", "arguments": '{"a": ' + deep + "}"}}]}]},
             "arguments"),
            ({"model": "m", "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": [
                {"id": "c", "type": "function", "function": {"name": "f", "arguments": '{"a": ' + "[" * 100 +
                                                             "]" * 100 + "}"}}]}]}, "nested too deeply"),
            ({"model": "m", "messages": [{"role": "user", "content": "hi"}], "functions": [{"name": "f"}]},
             "tools and tool_choice"),
            ({"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function",
              "function": {"name": "f", "parameters": {"type": "object", "properties": [1]}}}],
              "tool_choice": "required"}, "properties")):
        status, reply = post("/v1/chat/completions", body)
        assert status == 400 and needle in reply["error"]["message"], reply
    status, reply = post("/v1/completions", {"model": "m", "prompt": "hi", "tool_choice": "auto"})
    assert status == 400 and "chat" in reply["error"]["message"]


def test_a_long_call_is_read_in_linear_time():
    """A call of 200,000 characters arriving a few characters at a time: read once it ends (the reader keeps
    its pieces and looks only at their tail for the closing tag)."""
    import time

    body = json.dumps({"name": "note", "arguments": {"text": "word " * 40000}})
    text = f"<tool_call>\n{body}\n</tool_call>"
    reader = CallReader(Hermes(), {})
    t0 = time.perf_counter()
    events = [e for i in range(0, len(text), 3) for e in reader.push(text[i:i + 3])] + reader.flush()
    assert [c.name for _, c, _ in events if c] == ["note"] and sum(n for *_, n in events) == len(text)
    assert time.perf_counter() - t0 < 10  # (quadratic: minutes)
