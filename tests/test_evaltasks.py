"""Long-context eval tasks: prompt generators (length in tokens, depth, one needle, seeds) and exact-match scorers.

Generators run on the bundled SmolLM2's tokenizer (from its GGUF metadata only, no weights). Length
tolerance: a prompt has between ``length - length_tolerance(task, filler)`` and ``length`` tokens (passkey 16,
needle 64, kvretrieval 96: at most one unit short). Token depth: the needle starts within 0.1 of the asked
depth, as a fraction of the document's tokens.
"""

from __future__ import annotations

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ktquest.eval.fillers import KINDS, haystack
from ktquest.eval.tasks import (
    AVOID,
    FILLERS,
    HELD_OUT_FILLERS,
    MAX_NEW_TOKENS,
    PHRASINGS,
    TASKS,
    TUNING_FILLERS,
    answer_complete,
    first_number,
    length_tolerance,
    make_sample,
    score,
    score_kvretrieval,
    score_needle,
    score_passkey,
)


@pytest.fixture(scope="module")
def tok(bundled_gguf):
    from ktquest.formats.tokenizer import Tokenizer
    from ktquest.models.loader import read_gguf

    return Tokenizer.from_gguf_metadata(read_gguf(bundled_gguf).metadata)


def _occurrences(text: str, sub: str) -> int:
    return len(re.findall(re.escape(sub), text, flags=re.IGNORECASE))


# ---- generators ----


@pytest.mark.parametrize("task", TASKS)
@pytest.mark.parametrize("length", [300, 1000, 2500])
@pytest.mark.parametrize("depth", [0.0, 0.37, 1.0])
def test_sample_length_depth_and_single_needle(tok, task, length, depth):
    s = make_sample(tok, task, length, depth, seed=3, trial=1)
    assert s.filler == "classic" and s.phrasing == 0
    _check_sample(tok, s, task, length, depth)


@pytest.mark.parametrize("task", ["passkey", "needle"])
@pytest.mark.parametrize("filler", KINDS)
@pytest.mark.parametrize("length", [300, 2500])
@pytest.mark.parametrize("depth", [0.0, 0.37, 1.0])
def test_filler_kinds(tok, task, filler, length, depth):
    """Every filler kind: the same contract as the classic haystack, in one of the non-classic phrasings."""
    s = make_sample(tok, task, length, depth, seed=3, trial=1, filler=filler)
    assert s.filler == filler and 1 <= s.phrasing < len(PHRASINGS[task])
    needle, question, _ = PHRASINGS[task][s.phrasing]
    assert s.question.startswith(question.split("{")[0]) and s.needle.startswith(needle.split("{")[0])
    _check_sample(tok, s, task, length, depth)


def _check_sample(tok, s, task, length, depth):
    # Length: the rendered chat prompt, in the model's tokens.
    assert length - length_tolerance(task, s.filler) <= len(s.tokens) <= length
    assert s.tokens == tok.encode_chat(tok.apply_chat_template([{"role": "user", "content": s.user_text}]))
    assert s.user_text.endswith(s.question)
    # The needle (and the answer) is in the document exactly once.
    assert s.document.count(s.needle) == 1
    if task == "passkey":
        assert _occurrences(s.document.replace(s.needle, ""), s.answer) == 0
        assert s.needle.count(s.answer) == (2 if s.phrasing == 0 else 1)
        assert 5 <= len(s.answer) <= 7 and s.answer[0] != "0"
    elif task == "needle":
        assert score_needle(s.needle, s.answer)
        assert not score_needle(s.document.replace(s.needle, ""), s.answer)
    else:
        assert _occurrences(s.document, s.answer) == 1 and _occurrences(s.document, s.key) == 1
        assert s.key in s.question and s.answer not in s.question
    # Depth: in units exactly, in tokens within 0.1 (units are not all the same size).
    units = s.n_units - 1
    assert s.needle_unit == round(depth * units)
    if length >= 1000:
        before = len(tok.encode(s.document[: s.document.index(s.needle)], add_bos=False, parse_special=False))
        total = len(tok.encode(s.document, add_bos=False, parse_special=False))
        assert abs(before / total - depth) <= 0.1


@pytest.mark.parametrize("task", TASKS)
def test_base_model_is_asked_completion_style(tiny_llama_base, task):
    """A model without a chat template: the question ends with the answer's first words, and the prompt is
    the plain text a base-model chat renders."""
    from ktquest.formats.tokenizer import Tokenizer
    from ktquest.models.loader import read_gguf

    base = Tokenizer.from_gguf_metadata(read_gguf(tiny_llama_base.path).metadata)
    s = make_sample(base, task, 600, 0.5, seed=3, trial=1)
    cue = {"passkey": "The pass key is", "needle": "is", "kvretrieval": f'The value of the key "{s.key}" is "'}
    assert s.question.endswith(cue[task]) and "Answer" not in s.question
    assert s.tokens == base.encode_chat(base.apply_chat_template([{"role": "user", "content": s.user_text}]))
    assert len(s.tokens) <= 600


def test_filler_groups_and_haystacks_do_not_depend_on_depth(tok):
    assert set(TUNING_FILLERS) | set(HELD_OUT_FILLERS) == set(FILLERS)
    assert not set(TUNING_FILLERS) & set(HELD_OUT_FILLERS) and "classic" in TUNING_FILLERS
    for filler in KINDS:
        deep, shallow = (make_sample(tok, "needle", 1500, d, seed=1, trial=4, filler=filler) for d in (0.9, 0.3))
        cut = shallow.document.index(shallow.needle)
        assert deep.document[:cut] == shallow.document[:cut]  # one haystack per trial: a shared prefix
        other = make_sample(tok, "needle", 1500, 0.3, seed=1, trial=5, filler=filler)
        assert other.document != shallow.document


@pytest.mark.parametrize("kind", KINDS)
def test_haystack_units_grow_by_prefix_and_avoid_the_answers(kind):
    import random

    units, join = haystack(kind, random.Random(f"t:{kind}"), AVOID)
    long, short = units(400), units(150)
    assert long[:150] == short and len(long) == 400 and all(u.strip() for u in long)
    text = f" {' '.join(re.findall(r'[a-z0-9]+', join(long).lower()))} "
    assert not re.search(r"\d{5}", join(long))
    assert not any(f" {a} " in text for a in AVOID)
    with pytest.raises(ValueError, match="filler kind 'poetry'"):
        haystack("poetry", random.Random(0))


@pytest.mark.parametrize("task", TASKS)
def test_samples_are_deterministic_per_seed(tok, task):
    a = make_sample(tok, task, 400, 0.5, seed=7, trial=2)
    b = make_sample(tok, task, 400, 0.5, seed=7, trial=2)
    assert a == b
    others = [make_sample(tok, task, 400, 0.5, seed=8, trial=2), make_sample(tok, task, 400, 0.5, seed=7, trial=3)]
    assert all(o.document != a.document or o.answer != a.answer for o in others)


def test_sample_errors(tok):
    with pytest.raises(ValueError, match="task='bogus'"):
        make_sample(tok, "bogus", 400, 0.5)
    with pytest.raises(ValueError, match="depth=1.5"):
        make_sample(tok, "passkey", 400, 1.5)
    with pytest.raises(ValueError, match="too short"):
        make_sample(tok, "kvretrieval", 60, 0.5)
    with pytest.raises(ValueError, match="filler='poetry'"):
        make_sample(tok, "passkey", 400, 0.5, filler="poetry")
    with pytest.raises(ValueError, match="kvretrieval"):
        make_sample(tok, "kvretrieval", 400, 0.5, filler="prose")


def test_reply_budgets_fit_the_answers():
    assert MAX_NEW_TOKENS["passkey"] >= 8 and MAX_NEW_TOKENS["kvretrieval"] >= 2 * 34 + 16


# ---- scorers ----


@pytest.mark.parametrize(
    ("reply", "ok"),
    [
        ("123456", True),
        ("The pass key is 123456.", True),  # extra words
        ("The pass key is 123,456. Remember it.", True),  # thousands separators
        ("123456 is the pass key, not 654321", True),  # the first number counts
        ("12345", False),  # partial digits
        ("1234567", False),  # a longer number
        ("1234560", False),
        ("12 3456", False),
        ("654321 or 123456", False),
        ("The pass key is", False),
        ("", False),
        ("12,34,56", False),  # not thousands separators
    ],
)
def test_score_passkey(reply, ok):
    assert score_passkey(reply, "123456") is ok
    assert score("passkey", reply, "123456") is ok


def test_first_number():
    assert first_number("a 1,234,567 b") == "1234567"
    assert first_number("v2 then 30") == "2"
    assert first_number("none") is None


@given(st.integers(10_000, 9_999_999))
@settings(max_examples=50, deadline=None)
def test_score_passkey_formats(n):
    key = str(n)
    assert score_passkey(f"The pass key is {n:,}.", key)
    assert score_passkey(f"{key}", key)
    assert not score_passkey(key[:-1], key)
    assert not score_passkey(key + "1", key)


@pytest.mark.parametrize(
    ("reply", "ok"),
    [
        ("The best thing to do in Kyoto is to visit the glass museum.", True),
        ("GLASS   MUSEUM!", True),  # case, spacing, punctuation
        ("glass-museum", True),
        ("the glass museums", False),  # not the whole word
        ("the museum of glass", False),
        ("glass", False),
        ("", False),
    ],
)
def test_score_needle(reply, ok):
    assert score_needle(reply, "glass museum") is ok
    assert score("needle", reply, "glass museum") is ok


VALUE = "928320b1-4ac6-4bfa-b7c5-c5654dd7dc75"
KEY = "4944e535-d606-4612-91db-f944395a7553"


@pytest.mark.parametrize(
    ("reply", "ok"),
    [
        (VALUE, True),
        (VALUE.upper(), True),  # case
        (f'The value is "{VALUE}".', True),  # extra words, quotes
        (f'The value of the key "{KEY}" is {VALUE}.', True),  # the echoed key is skipped
        (f"{VALUE[:-1]}", False),  # truncated
        (VALUE[:18], False),
        (f"{VALUE}0", False),  # a longer hex run
        (f"a{VALUE}", False),
        (f"{KEY}", False),  # only the key
        (f"0b8c6f2e-5a47-4d2b-9a55-0c1f2e3d4a5b then {VALUE}", False),  # the first value counts
        ("", False),
    ],
)
def test_score_kvretrieval(reply, ok):
    assert score_kvretrieval(reply, VALUE, KEY) is ok
    assert score("kvretrieval", reply, VALUE, KEY) is ok


def test_score_unknown_task():
    with pytest.raises(ValueError, match="task='x'"):
        score("x", "", "")


@pytest.mark.parametrize(
    ("task", "reply", "answer", "done"),
    [
        ("passkey", "The pass key is 12", "12345", False),  # may still grow
        ("passkey", "The pass key is 12,3", "12345", False),
        ("passkey", "The pass key is 12,345.", "12345", True),
        ("passkey", "12345 ", "12345", True),
        ("needle", "in the glass muse", "glass museum", False),
        ("needle", "in the glass museum", "glass museum", False),  # "museums" could follow
        ("needle", "in the glass museum.", "glass museum", True),
        ("kvretrieval", f'The value of the key "{KEY}" is', VALUE, False),
        ("kvretrieval", f'The value of the key "{KEY}" is {VALUE}', VALUE, False),
        ("kvretrieval", f'The value of the key "{KEY}" is {VALUE}.', VALUE, True),
    ],
)
def test_answer_complete(task, reply, answer, done):
    assert answer_complete(task, reply, answer, KEY) is done
    if done:  # nothing appended can change the verdict
        for tail in ("", " 99999", f" {VALUE[::-1]}", "s"):
            assert score(task, reply + tail, answer, KEY) == score(task, reply, answer, KEY)
