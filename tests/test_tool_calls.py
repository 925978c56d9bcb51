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
