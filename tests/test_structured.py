"""Structured output (ktquest/structured.py): the vocabulary as llguidance reads it spells what the tokenizer
decodes; through a real ``ktquest serve`` and the ``openai`` client, replies at temperature 1 held to a JSON schema
always parse and validate, JSON mode's replies that end are JSON objects, and a format that cannot be held to
is a 400 naming what is wrong."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from test_server import MODEL, _start_server

from ktquest.formats.tokenizer import CONTROL, UNKNOWN
from ktquest.models.loader import read_gguf, read_tokenizer
from ktquest.structured import FormatError, ResponseFormat, token_bytes

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "city"],
          "properties": {"name": {"type": "string", "maxLength": 24},
                         "age": {"type": "integer", "minimum": 0, "maximum": 150},
                         "city": {"type": "string", "enum": ["Paris", "Lima", "Oslo", "Kyoto"]}}}
TEXT = "Grüße, 東京! Tabs\tand\nnewlines, numbers 12345 and émojis 🙂 in a line."


@pytest.mark.parametrize("which", ["bundled_gguf", "bundled_gemma3"])
def test_token_bytes_spell_the_decoded_text(which, request):
    """Byte-level BPE (SmolLM2) and SentencePiece (Gemma 3): the tokens' bytes joined are the text's bytes (a
    multi-byte character split over byte tokens too); control tokens are 0xFF and their text."""
    tok = read_tokenizer(read_gguf(request.getfixturevalue(which)))
    tb = token_bytes(tok)
    assert len(tb) == len(tok.tokens)
    ids = tok.encode(TEXT, add_bos=False, parse_special=False)
    assert b"".join(tb[i] for i in ids).lstrip(b" ") == TEXT.encode()  # (SentencePiece's leading space)
    controls = [i for i, t in enumerate(tok.token_types) if t in (CONTROL, UNKNOWN)]
    assert controls and all(tb[i] == b"\xff" + tok.tokens[i].encode() for i in controls)


def test_formats_that_cannot_be_held_are_named():
    for fmt, match in (({"type": "grammar"}, "'grammar' is not supported"),
                       ({"type": "json_schema"}, "needs"),
                       ({"type": "json_schema", "json_schema": {"schema": {"not": {"type": "string"}}}}, "not"),
                       ({"type": "json_schema", "json_schema": {"schema": {"type": "objekt"}}}, "objekt")):
        with pytest.raises(FormatError, match=match):
            ResponseFormat.parse(fmt)
    assert ResponseFormat.parse(None) is None and ResponseFormat.parse({"type": "text"}) is None


@pytest.fixture(scope="module")
def client(bundled_gguf):
    proc, url, _ = _start_server("--set", "threads=2")
    yield openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)
    proc.terminate()
    out, _ = proc.communicate(timeout=30)
    assert "Traceback" not in out, out


def _ask(client, seed: int, **kw):
    return client.chat.completions.create(
        model="gpt-4o-mini", temperature=1.0, seed=seed, max_tokens=160,
        messages=[{"role": "user", "content": "Describe a person as JSON: name, age and city."}], **kw)


def test_schema_replies_always_validate(client):
    """100 replies sampled at temperature 1 under a strict JSON schema: every one ends and validates."""
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "strict": True, "schema": PERSON}}
    for seed in range(100):
        r = _ask(client, seed, response_format=fmt)
        assert r.choices[0].finish_reason == "stop", r.choices[0].message.content
        jsonschema.validate(json.loads(r.choices[0].message.content), PERSON)
        assert r.model == MODEL


def test_json_mode_replies_are_objects(client):
    """JSON mode (any object), 20 replies at temperature 1: those that end are JSON objects, streamed or not (a
    reply cut at max_tokens is an unfinished object, as OpenAI's are)."""
    ended = 0
    for seed in range(20):
        stream = seed % 2 == 1
        if stream:
            parts = _ask(client, seed, response_format={"type": "json_object"}, stream=True)
            chunks = list(parts)
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            reason = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
        else:
            r = _ask(client, seed, response_format={"type": "json_object"})
            text, reason = r.choices[0].message.content, r.choices[0].finish_reason
        if reason == "stop":
            assert isinstance(json.loads(text), dict), text
            ended += 1
        else:
            assert reason == "length" and text.lstrip().startswith("{")
    assert ended >= 15


def test_logprobs_of_a_held_reply_are_the_models(client):
    """logprobs with a schema: the model's own log probabilities (finite, however few tokens the mask allows)."""
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    r = _ask(client, 1, response_format=fmt, logprobs=True, top_logprobs=5)
    jsonschema.validate(json.loads(r.choices[0].message.content), PERSON)
    entries = r.choices[0].logprobs.content
    assert entries and all(e.logprob <= 0 and len(e.top_logprobs) == 5 for e in entries)
    assert all(t.logprob > -1e30 for e in entries for t in e.top_logprobs)


def test_a_format_it_cannot_hold_is_a_400(client):
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "if": {}, "then": {}}}}
    with pytest.raises(openai.BadRequestError) as e:
        _ask(client, 0, response_format=bad)
    err = e.value.body
    assert err["param"] == "response_format" and "if" in err["message"]


def test_the_python_api_holds_a_completion_to_a_schema(bundled_gguf):
    """``Engine.generate(..., response_format=...)``: a raw completion held to the schema, 5 seeds at temperature 1;
    a format it cannot hold to is a FormatError (a ValueError) before any work."""
    import ktquest

    eng = ktquest.load(model=str(bundled_gguf), threads=2, max_seq_len=512)
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    for seed in range(5):
        text = eng.generate("A person, as JSON:", response_format=fmt, temperature=1.0, seed=seed, max_new_tokens=120)
        jsonschema.validate(json.loads(text), PERSON)
    with pytest.raises(ValueError, match="Unimplemented keys"):
        eng.generate("x", response_format={"type": "json_schema", "json_schema": {"schema": {"not": {}}}})
    with pytest.raises(TypeError, match="response_format must be dict or None"):
        eng.generate("x", response_format="json")


def test_a_format_without_lark_text_is_held_from_the_first_token_after_a_think_block_too():
    """A ResponseFormat made by hand from a compiled grammar has no Lark text to wrap: after_thinking keeps it."""
    import llguidance

    from ktquest.structured import ResponseFormat

    fmt = ResponseFormat(llguidance.grammar_from("regex", "[0-9]+"), "digits")
    assert fmt.after_thinking() is fmt
    held = ResponseFormat.parse({"type": "json_object"}).after_thinking()
    assert held.lark.startswith("start: thought") and "answer: %json" in held.lark
