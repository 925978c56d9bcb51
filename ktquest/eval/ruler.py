"""RULER's synthetic tasks (Hsieh et al. 2024, "RULER: What's the Real Context Size of Your Long-Context Language
Models?"), generated here from a seed, with RULER's scoring: the share of the expected strings a reply holds.

    niah_single_1     one needle (a 7-digit number) in repeated noise sentences
    niah_single_2     one needle (a number) in prose (the Python Language Reference: fillers.py's ``prose``)
    niah_single_3     one needle (a UUID) in prose
    niah_multikey_1   the needle asked about beside 3 needles of other keys (distractors), in noise
    niah_multikey_2   the same in prose
    niah_multikey_3   a haystack made of needles only (UUID keys' values): one is asked about
    niah_multivalue   one key with 4 values, all asked for, in prose
    niah_multiquery   4 keys asked about at once, each with its value, in prose
    vt                variable tracking: a chain of 5 names passing a 5-digit number along ("VAR B = VAR A"),
                      in noise; every name that holds it
    cwe               common words: a numbered list where 10 words occur f times (30 from 4K tokens on, 10
                      below) and every other word 3 times; the 10
    fwe               frequent words: words drawn from a Zeta distribution (s = 2) over 2,000 made-up words;
                      the 3 most frequent

A needle says "A special magic {number|uuid} for {key} is {value}."; keys and words are made up from syllables
(``word-word``), numbers have 7 digits, and the prose haystack never holds a run of 5 digits, so nothing but the
needles holds an answer. As for the retrieval tasks (``tasks.py``), a sample's prompt (the document and the
question as one user message in the model's chat template; completion style for a base model: the question
ends with the answer's first words) has at most ``length`` tokens and grows by whole haystack units; the needles'
depths are drawn once a sample, and everything is a function of (task, length, seed, trial).
"""

from __future__ import annotations

import random
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from ktquest.eval.fillers import haystack

RULER_TASKS = ("niah_single_1", "niah_single_2", "niah_single_3", "niah_multikey_1", "niah_multikey_2",
               "niah_multikey_3", "niah_multivalue", "niah_multiquery", "vt", "cwe", "fwe")
NOISE = ("The grass is green.", "The sky is blue.", "The sun is yellow.", "Here we go.", "There and back again.")
# Reply tokens each task needs (a list of values or words takes more)
MAX_NEW_TOKENS = {t: 48 for t in RULER_TASKS} | {"niah_multivalue": 128, "niah_multiquery": 128, "niah_single_3": 64,
                                                 "niah_multikey_3": 64, "vt": 64, "cwe": 128}
# niah tasks: (value kind, haystack, keys in the document, values a key, keys asked)
_NIAH = {"niah_single_1": ("number", "noise", 1, 1, 1), "niah_single_2": ("number", "prose", 1, 1, 1),
         "niah_single_3": ("uuid", "prose", 1, 1, 1), "niah_multikey_1": ("number", "noise", 4, 1, 1),
         "niah_multikey_2": ("number", "prose", 4, 1, 1), "niah_multikey_3": ("uuid", "needles", 1, 1, 1),
         "niah_multivalue": ("number", "prose", 1, 4, 1), "niah_multiquery": ("number", "prose", 4, 1, 4)}
_SYLLABLES = ("ba", "ko", "ri", "tu", "me", "la", "zo", "pi", "sa", "ne", "do", "gu", "fa", "vi", "ro", "te", "mu",
              "ka", "li", "so", "ze", "nu", "ha", "yo", "qui", "bre", "tra", "plo", "sni", "gra")


@dataclass(slots=True)
class RulerSample:
    task: str
    length: int  # the requested prompt length, tokens
    trial: int
    document: str
    question: str
    answers: list[str]  # the strings the reply should hold (RULER's references)
    tokens: list[int]  # the rendered chat prompt, ready to prefill
    n_units: int  # haystack units in the document

    @property
    def user_text(self) -> str:
        return f"{self.document}\n\n{self.question}"


def score(reply: str, answers: list[str]) -> float:
    """RULER's string match: the share of ``answers`` the reply holds (case-insensitive), 0..1."""
    low = reply.lower()
    return sum(a.lower() in low for a in answers) / len(answers)


@dataclass(frozen=True)
class _Task:
    build: Callable[[int], str]  # the document of n haystack units
    answers: Callable[[int], list[str]]  # the answers of that document
    question: str
    completion: str


def make_ruler_sample(tokenizer, task: str, length: int, seed: int = 0, trial: int = 0) -> RulerSample:
    """One prompt of ``task`` with at most ``length`` tokens (see the module docstring) and its answers.
    tokenizer: a ``ktquest.formats.tokenizer.Tokenizer``."""
    from ktquest.eval.tasks import _chat_tokens, _fit

    if task not in RULER_TASKS:
        raise ValueError(f"task={task!r} is not allowed: one of {', '.join(RULER_TASKS)}")
    tag = f"ruler:{task}:{seed}:{length}:{trial}"
    t = _niah(task, tag) if task in _NIAH else {"vt": _vt, "cwe": _cwe, "fwe": _fwe}[task](tag, length)
    question = t.question if tokenizer.chat_template is not None else t.completion

    def render(n: int) -> list[int]:
        return _chat_tokens(tokenizer, f"{t.build(n)}\n\n{question}")

    per_unit = len(tokenizer.encode(t.build(64), add_bos=False, parse_special=False)) / 64
    n = _fit(lambda m: len(render(m)), length, 1, estimate=max(1, int(length / max(per_unit, 1e-3))))
    tokens = render(n)
    if len(tokens) > length:
        raise ValueError(f"length={length} is too short for {task} ({len(tokens)} tokens with the smallest document)")
    return RulerSample(task, length, trial, t.build(n), question, t.answers(n), tokens, n)


# ---- made-up words, keys and values ----


def _word(rng: random.Random) -> str:
    return "".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(2, 3)))


def _fresh(rng: random.Random, taken: set[str], make: Callable[[random.Random], str]) -> str:
    while True:
        w = make(rng)
        if w not in taken:
            taken.add(w)
            return w


def _key(rng: random.Random, taken: set[str]) -> str:
    return _fresh(rng, taken, lambda r: f"{_word(r)}-{_word(r)}")


def _value(rng: random.Random, kind: str) -> str:
    return str(uuid.UUID(int=rng.getrandbits(128), version=4)) if kind == "uuid" else str(rng.randint(10**6, 10**7 - 1))


def _needle(kind: str, key: str, value: str) -> str:
    return f"A special magic {kind} for {key} is {value}."


def _inserted(units: Callable[[int], list[str]], lines: list[str], depths: list[float]) -> Callable[[int], str]:
    """The document of n units with lines[i] at depth depths[i] (ascending: the lines stay in order)."""
    def build(n: int) -> str:
        parts = units(n)
        for d, line in sorted(zip(depths, lines), key=lambda x: -x[0]):  # the deepest first: indexes stay right
            parts.insert(round(d * n), line)
        return "\n".join(parts)

    return build


def _noise(n: int) -> list[str]:
    return [NOISE[i % len(NOISE)] for i in range(n)]


# ---- the tasks ----


def _niah(task: str, tag: str) -> _Task:
    kind, hay, n_keys, n_values, n_asked = _NIAH[task]
    rng = random.Random(tag)
    taken: set[str] = set()
    keys = [_key(rng, taken) for _ in range(n_keys)]
    values = [[_value(rng, kind) for _ in range(n_values)] for _ in keys]
    needles = [_needle(kind, k, v) for k, vs in zip(keys, values) for v in vs]
    asked = keys[:n_asked]
    answers = [v for vs in values[:n_asked] for v in vs]
    if hay == "needles":  # other keys' needles, drawn as the document grows
        pool: list[str] = []
        pool_rng = random.Random(tag + ":pool")

        def units(n: int) -> list[str]:
            while len(pool) < n:
                pool.append(_needle(kind, _key(pool_rng, taken), _value(pool_rng, kind)))
            return pool[:n]
    elif hay == "prose":
        units = haystack("prose", random.Random(tag + ":prose"))[0]
    else:
        units = _noise
    depths = sorted(rng.random() for _ in needles)
    rng.shuffle(needles)  # (the asked one is not always first)
    plural = "numbers" if kind == "number" else "UUIDs"
    names = ", ".join(asked)
    return _Task(_inserted(units, needles, depths), lambda n: answers,
                 f"What are all the special magic {plural} for {names} in the text above? Answer with them only.",
                 f"The special magic {plural} for {names} in the text above are:")


def _vt(tag: str, length: int) -> _Task:
    rng = random.Random(tag)
    value = str(rng.randint(10**4, 10**5 - 1))
    taken: set[str] = set()
    names = [_fresh(rng, taken, lambda r: "".join(r.choice("BCDFGHJKLMNPQRSTVWXZ") for _ in range(5)))
             for _ in range(5)]
    chain = [f"VAR {names[0]} = {value}"] + [f"VAR {b} = VAR {a}" for a, b in zip(names, names[1:])]
    return _Task(_inserted(_noise, chain, sorted(rng.random() for _ in chain)), lambda n: names,
                 f"Which variables in the text above hold the value {value}, assigned directly or through another "
                 "variable? Answer with their names only.",
                 f"The variables that hold the value {value} are:")


def _cwe(tag: str, length: int) -> _Task:
    rng = random.Random(tag)
    taken: set[str] = set()
    common = [_fresh(rng, taken, lambda r: _word(r) + _word(r)) for _ in range(10)]
    often = 30 if length >= 4096 else 10
    rare: list[str] = []

    def build(n: int) -> str:  # n rare words, 3 times each, beside the common ones
        while len(rare) < n:
            rare.append(_fresh(rng, taken, lambda r: _word(r) + _word(r)))
        words = [w for w in common for _ in range(often)] + [w for w in rare[:n] for _ in range(3)]
        random.Random(f"{tag}:{n}").shuffle(words)
        return "\n".join(f"{i}. {w}" for i, w in enumerate(words, 1))

    return _Task(build, lambda n: common,
                 "What are the 10 most common words in the list above? Answer with the words only.",
                 "The 10 most common words in the list above are:")


def _fwe(tag: str, length: int) -> _Task:
    rng = random.Random(tag)
    taken: set[str] = set()
    vocab = [_fresh(rng, taken, lambda r: _word(r) + _word(r)) for _ in range(2000)]
    weights = [1.0 / (r + 1) ** 2 for r in range(len(vocab))]  # Zeta(2) over the ranks
    draws: list[int] = []

    def drawn(n: int) -> list[int]:
        while len(draws) < n:
            draws.extend(rng.choices(range(len(vocab)), weights=weights, k=max(1024, n - len(draws))))
        return draws[:n]

    def answers(n: int) -> list[str]:
        return [vocab[i] for i, _ in Counter(drawn(n)).most_common(3)]

    return _Task(lambda n: " ".join(vocab[i] for i in drawn(n)), answers,
                 "What are the 3 most frequent words in the text above? Answer with the words only.",
                 "The 3 most frequent words in the text above are:")


# ---- several questions about one document, one conversation ----


@dataclass(frozen=True, slots=True)
class MultiTurnSample:
    """A document of ``len(turns)`` key-value needles in prose, and one question a turn: (question, value)."""

    length: int
    trial: int
    document: str
    turns: list[tuple[str, str]]
    n_tokens: int  # the first turn's prompt


def make_multiturn_sample(tokenizer, length: int, n_turns: int = 4, seed: int = 0, trial: int = 0) -> MultiTurnSample:
    """A chat about one document of at most ``length`` tokens (the first turn's prompt): ``n_turns`` needles
    ("A special magic number for KEY is VALUE.") at spread depths in prose, asked one a turn, in an order
    unrelated to their depths. What a long conversation over a document needs from the cache: later turns
    read with the earlier questions and answers in it."""
    from ktquest.eval.tasks import _chat_tokens, _fit

    tag = f"multiturn:{seed}:{length}:{trial}:{n_turns}"
    rng = random.Random(tag)
    taken: set[str] = set()
    keys = [_key(rng, taken) for _ in range(n_turns)]
    values = [_value(rng, "number") for _ in keys]
    depths = [(i + rng.random()) / n_turns for i in range(n_turns)]  # one needle in each share of the document
    build = _inserted(haystack("prose", random.Random(tag + ":prose"))[0],
                      [_needle("number", k, v) for k, v in zip(keys, values)], depths)
    order = list(range(n_turns))
    rng.shuffle(order)
    turns = [(f"What is the special magic number for {keys[i]} in the text above? Answer with the number only.",
              values[i]) for i in order]

    def render(n: int) -> list[int]:
        return _chat_tokens(tokenizer, f"{build(n)}\n\n{turns[0][0]}")

    n = _fit(lambda m: len(render(m)), length, 1, estimate=max(1, length // 16))
    return MultiTurnSample(length, trial, build(n), turns, len(render(n)))
