"""RULER's synthetic tasks (ktquest/eval/ruler.py) on the bundled SmolLM2's tokenizer (its GGUF metadata only):
each task's prompt fits its length, its document holds its answers and nothing else that answers, samples are
functions of their seed, and RULER's string-match score."""

from __future__ import annotations

import re
from collections import Counter

import pytest

from ktquest.eval.ruler import MAX_NEW_TOKENS, RULER_TASKS, make_ruler_sample, score

TOLERANCE = 64  # tokens a prompt may fall short of its length: one haystack unit at most


@pytest.fixture(scope="module")
def tok(bundled_gguf):
    from ktquest.formats.tokenizer import Tokenizer
    from ktquest.models.loader import read_gguf

    return Tokenizer.from_gguf_metadata(read_gguf(bundled_gguf).metadata)


@pytest.mark.parametrize("task", RULER_TASKS)
def test_every_task_fits_its_length_and_holds_its_answers(tok, task):
    s = make_ruler_sample(tok, task, 2048, seed=1, trial=0)
    assert 2048 - TOLERANCE <= len(s.tokens) <= 2048
    assert s.answers and MAX_NEW_TOKENS[task] >= 48
    assert all(a in s.document for a in s.answers)
    assert score(", ".join(s.answers), s.answers) == 1.0


@pytest.mark.parametrize("task", ["niah_single_1", "niah_multikey_1", "niah_multikey_2", "niah_multivalue",
                                  "niah_multiquery"])
def test_needles_are_the_only_numbers_and_distractors_are_not_answers(tok, task):
    """A needle's 7-digit number appears once; the haystack has no other 5-digit run; distractor keys' values are
    in the document but not among the answers (multikey), every asked key's value is (multiquery, multivalue)."""
    s = make_ruler_sample(tok, task, 2048, seed=2)
    numbers = re.findall(r"\d{5,}", s.document)
    needles = re.findall(r"A special magic number for ([a-z-]+) is (\d{7})\.", s.document)
    assert sorted(numbers) == sorted(v for _, v in needles)
    n_keys = len({k for k, _ in needles})
    expect = {"niah_single_1": (1, 1), "niah_multikey_1": (4, 1), "niah_multikey_2": (4, 1),
              "niah_multivalue": (1, 4), "niah_multiquery": (4, 4)}[task]
    assert (n_keys, len(s.answers)) == expect
    asked = [k for k, v in needles if v in s.answers]
    assert all(k in s.question for k in asked) and not any(k in s.question for k, v in needles if k not in asked)


def test_multikey_3_is_a_haystack_of_needles(tok):
    s = make_ruler_sample(tok, "niah_multikey_3", 2048, seed=3)
    lines = s.document.split("\n")
    assert all(re.fullmatch(r"A special magic uuid for [a-z-]+ is [0-9a-f-]{36}\.", x) for x in lines)
    keys = [x.split(" for ")[1].split(" is ")[0] for x in lines]
    assert len(set(keys)) == len(keys) and s.answers[0] in s.document


def test_variable_tracking_chain_is_in_order(tok):
    s = make_ruler_sample(tok, "vt", 2048, seed=4)
    value = re.search(r"value (\d{5})", s.question).group(1)
    chain = [x for x in s.document.split("\n") if x.startswith("VAR ")]
    assert chain[0] == f"VAR {s.answers[0]} = {value}" and len(chain) == len(s.answers) == 5
    assert chain[1:] == [f"VAR {b} = VAR {a}" for a, b in zip(s.answers, s.answers[1:])]


def test_common_and_frequent_words_are_counted_right(tok):
    cwe = make_ruler_sample(tok, "cwe", 4096, seed=5)
    counts = Counter(x.split(". ", 1)[1] for x in cwe.document.split("\n"))
    assert {counts[w] for w in cwe.answers} == {30}  # (from 4K tokens on; 10 below)
    assert max(c for w, c in counts.items() if w not in cwe.answers) == 3
    fwe = make_ruler_sample(tok, "fwe", 2048, seed=6)
    counts = Counter(fwe.document.split())
    assert [w for w, _ in counts.most_common(3)] == fwe.answers


def test_samples_are_functions_of_their_seed_and_trial(tok):
    a, b = (make_ruler_sample(tok, "niah_multiquery", 1024, seed=7, trial=1) for _ in range(2))
    assert a.document == b.document and a.answers == b.answers
    c = make_ruler_sample(tok, "niah_multiquery", 1024, seed=7, trial=2)
    assert c.answers != a.answers


def test_base_models_are_asked_completion_style(tiny_llama_base):
    from ktquest.formats.tokenizer import Tokenizer
    from ktquest.models.loader import read_gguf

    base = Tokenizer.from_gguf_metadata(read_gguf(tiny_llama_base.path).metadata)
    s = make_ruler_sample(base, "niah_single_1", 512, seed=8)
    assert s.question.startswith("The special magic numbers for ") and s.question.endswith("are:")


def test_score_is_the_share_of_answers_found():
    assert score("7061234 and 1234567", ["7061234", "1234567"]) == 1.0
    assert score("only 7061234", ["7061234", "1234567"]) == 0.5
    assert score("ABCDE, fghij", ["abcde", "FGHIJ", "klmno", "pqrst"]) == 0.5
    assert score("", ["x"]) == 0.0


def test_bad_arguments(tok):
    with pytest.raises(ValueError, match="task='niah' is not allowed"):
        make_ruler_sample(tok, "niah", 1024)
    with pytest.raises(ValueError, match="too short for cwe"):
        make_ruler_sample(tok, "cwe", 256)


def test_multiturn_sample_asks_each_needle_once(tok):
    """A document with one needle in each quarter, asked one a turn in a shuffled order; each value is in the
    document once; the first turn's prompt fits the length; the sample is a function of its seed and trial."""
    from ktquest.eval.ruler import make_multiturn_sample

    s = make_multiturn_sample(tok, 2048, 4, seed=3, trial=1)
    assert len(s.turns) == 4 and s.n_tokens <= 2048 and s.n_tokens > 1900
    places = [s.document.find(v) for _, v in s.turns]
    assert all(s.document.count(v) == 1 for _, v in s.turns) and min(places) > 0
    assert places != sorted(places)  # (this seed's order is not the document's)
    keys = [re.search(r"number for (\S+) in", q).group(1) for q, _ in s.turns]
    assert all(f"magic number for {k} is {v}." in s.document for k, (_, v) in zip(keys, s.turns))
    assert make_multiturn_sample(tok, 2048, 4, seed=3, trial=1) == s
    assert make_multiturn_sample(tok, 2048, 4, seed=3, trial=2).document != s.document
