"""Long-context retrieval tasks: prompt generators and exact-match scorers (used by tools/eval_longctx.py).

Three tasks, each a document with one piece of information at a given depth, and a question about it:

- ``passkey``: a random 5-7 digit number stated once ("The pass key is N. Remember it. N is the pass
  key.") inside repeated filler sentences; scored by the first number of the reply.
- ``needle``: one fact sentence ("The best thing to do in <city> is <activity>.") on its own line inside
  Python standard-library sources; scored by the activity's key phrase.
- ``kvretrieval``: a JSON object of random UUID keys and values; the question names one key; scored by
  the first UUID of the reply.

The document and question form one user message (``document + "\\n\\n" + question``, the way
``ChatSession(document=...)`` sends it), rendered with the model's chat template. A base model (no chat
template) is asked completion style: the question ends with the start of its answer ("... What is the pass
key? The pass key is"), and the text is continued. ``length`` counts the
tokens of that whole rendered prompt in the model's tokenizer: a sample has between
``length - length_tolerance(task, filler)`` and ``length`` tokens (the document grows by whole units: a filler
sentence, a source line, a key-value pair). ``depth`` in [0, 1] places the information after that fraction
of the document's units.

``filler`` picks the haystack: ``classic`` is each task's own above, with its original phrasing (what the
presets were tuned on); ``code``, ``prose``, ``narrative`` and ``json`` (``ktquest.eval.fillers``) hide a
passkey or needle in that kind of text, phrased by one of the other phrasings of ``PHRASINGS`` drawn from
the seed. ``TUNING_FILLERS`` are the kinds preset settings may be chosen on, ``HELD_OUT_FILLERS`` the
kinds to report on. Outside ``classic``, the haystack depends on (task, filler, length, seed, trial) and
not on depth, so the prompts of one trial share their text up to the shallower needle. Everything is a
function of (task, filler, length, depth, seed, trial).
"""

from __future__ import annotations

import json
import random
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from ktquest.eval.fillers import KINDS, haystack, source_lines, words_of

TASKS = ("passkey", "needle", "kvretrieval")
FILLERS = ("classic", *KINDS)
TUNING_FILLERS = ("classic", "code")  # the presets' settings were chosen on these
HELD_OUT_FILLERS = ("prose", "narrative", "json")  # never used to choose settings: report on these

# Reply tokens each task needs (greedy decode stops at the first stop token anyway).
# The bundled SmolLM2 echoes the key before the value ("The value of the key \"<uuid>\" is <uuid>"), 34
# tokens each, hence 96 for kvretrieval; the eval stops as soon as the answer is complete (answer_complete).
MAX_NEW_TOKENS = {"passkey": 16, "needle": 32, "kvretrieval": 96}

# A sample's prompt has between length - tolerance and length tokens: at most one unit short
# (filler sentence ~6 tokens, source line <= 100 characters, one "key": "value" pair ~75 tokens).
LENGTH_TOLERANCE = {"passkey": 16, "needle": 64, "kvretrieval": 96}
# ... and with another filler, one unit of it (a line <= 100 characters, a sentence, a JSON record).
FILLER_TOLERANCE = {"code": 64, "prose": 64, "narrative": 32, "json": 64}


def length_tolerance(task: str, filler: str = "classic") -> int:
    """How many tokens short of ``length`` a sample of ``task`` in ``filler`` text may be."""
    return LENGTH_TOLERANCE[task] if filler == "classic" else FILLER_TOLERANCE[filler]

FILLER = (
    "The grass is green.",
    "The sky is blue.",
    "The sun is yellow.",
    "Here we go.",
    "There and back again.",
)

CITIES = (
    "San Francisco",
    "Lisbon",
    "Kyoto",
    "Reykjavik",
    "Marrakesh",
    "Montreal",
    "Valparaiso",
    "Tallinn",
    "Hobart",
    "Ljubljana",
    "Cartagena",
    "Tbilisi",
)
# (activity, key phrase the reply must contain)
ACTIVITIES = (
    ("to eat a sandwich in Dolores Park", "dolores park"),
    ("to ride the blue tram to the lighthouse", "blue tram"),
    ("to feed the ducks at the old mill", "old mill"),
    ("to climb the clock tower at sunrise", "clock tower"),
    ("to buy honey at the night market", "night market"),
    ("to swim in the green lagoon", "green lagoon"),
    ("to visit the glass museum", "glass museum"),
    ("to watch the paper lantern parade", "lantern parade"),
    ("to drink cocoa in the ice cave", "ice cave"),
    ("to read poems in the rose garden", "rose garden"),
)

# (needle, question, completion) per task; {k}: the pass key, {city} and {activity}. Index 0 is the
# classic phrasing; the other fillers draw one of the others.
PHRASINGS = {
    "passkey": (
        ("The pass key is {k}. Remember it. {k} is the pass key.",
         "What is the pass key? Answer with the number only.",
         "What is the pass key? The pass key is"),
        ("The secret access code is {k}.",
         "What is the secret access code? Answer with the number only.",
         "What is the secret access code? The secret access code is"),
        ("Please keep this in mind: the vault combination is {k}.",
         "What is the vault combination mentioned in the text? Answer with the number only.",
         "What is the vault combination mentioned in the text? The vault combination is"),
        ("Remember this: the magic number is {k}.",
         "What is the magic number? Answer with the number only.",
         "What is the magic number? The magic number is"),
    ),
    "needle": (
        ("The best thing to do in {city} is {activity}.",
         "What is the best thing to do in {city}? Answer in one short sentence.",
         "What is the best thing to do in {city}? The best thing to do in {city} is"),
        ("Anyone travelling to {city} should plan {activity}.",
         "What should anyone travelling to {city} plan to do? Answer in one short sentence.",
         "What should anyone travelling to {city} plan to do? Anyone travelling to {city} should plan"),
        ("Locals say that the nicest way to spend a day in {city} is {activity}.",
         "According to locals, what is the nicest way to spend a day in {city}? Answer in one short sentence.",
         "According to locals, what is the nicest way to spend a day in {city}? The nicest way to spend a day "
         "in {city} is"),
    ),
}
# Lower-case phrases no haystack unit may hold: a needle's city or answer elsewhere would be a second needle.
AVOID = tuple(words_of(x) for x in (*CITIES, *(phrase for _, phrase in ACTIVITIES)))


@dataclass(slots=True)
class Sample:
    task: str
    length: int  # the requested prompt length, tokens
    depth: float  # the requested depth
    trial: int
    document: str
    question: str
    answer: str  # what the scorer compares against (digits, key phrase or UUID)
    key: str  # kvretrieval: the key asked about (a reply may echo it); else ""
    needle: str  # the inserted text that holds the answer
    tokens: list[int]  # the rendered chat prompt, ready to prefill
    needle_unit: int  # index of the needle among the document's units
    n_units: int  # units in the document, the needle included
    filler: str = "classic"  # the haystack's kind (FILLERS)
    phrasing: int = 0  # the needle's and question's phrasing: an index into PHRASINGS[task]

    @property
    def user_text(self) -> str:
        return f"{self.document}\n\n{self.question}"


# ---- generators ----


def make_sample(tokenizer, task: str, length: int, depth: float, seed: int = 0, trial: int = 0,
                filler: str = "classic") -> Sample:
    """One prompt of ``task`` with ``length`` tokens hidden in ``filler`` text (see the module docstring)
    and its answer.

    tokenizer: a ``ktquest.formats.tokenizer.Tokenizer`` (encode, apply_chat_template, encode_chat).
    """
    if task not in TASKS:
        raise ValueError(f"task={task!r} is not allowed: one of {', '.join(TASKS)}")
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth={depth} is not allowed: a number in [0, 1]")
    if filler not in FILLERS:
        raise ValueError(f"filler={filler!r} is not allowed: one of {', '.join(FILLERS)}")
    if filler == "classic":
        rng, phrasing = random.Random(f"{task}:{seed}:{length}:{depth!r}:{trial}"), 0
        build = {"passkey": _passkey, "needle": _needle, "kvretrieval": _kvretrieval}[task]
        needle, (question, completion), answer, key, units, join, place = build(rng, length)
    elif task == "kvretrieval":
        raise ValueError(f"filler={filler!r} is not allowed for kvretrieval: its haystack is its JSON (classic)")
    else:
        rng = random.Random(f"{task}:{filler}:{seed}:{length}:{depth!r}:{trial}")
        phrasing = rng.randrange(1, len(PHRASINGS[task]))
        needle, (question, completion), answer = _NEEDLES[task](rng, phrasing)
        units, join = haystack(filler, random.Random(f"{task}:{filler}:{seed}:{length}:{trial}"), AVOID)
        key, place = "", "insert"
    if tokenizer.chat_template is None:  # a base model: the answer's first words end the prompt
        question = completion

    def document(n: int) -> tuple[str, int]:
        if place == "insert":  # the needle goes between units: n haystack units + the needle
            i = round(depth * n)
            parts = units(n)
            return join(parts[:i] + [needle] + parts[i:]), i
        i = round(depth * (n - 1))  # "replace": the needle is unit i of n
        parts = units(n)
        parts[i] = needle
        return join(parts), i

    def render(n: int) -> list[int]:
        doc, _ = document(n)
        return _chat_tokens(tokenizer, f"{doc}\n\n{question}")

    n_min = 0 if place == "insert" else 1
    n = _fit(lambda m: len(render(m)), length, n_min, estimate=_estimate(tokenizer, units, length))
    doc, i = document(n)
    tokens = render(n)
    if len(tokens) > length:
        raise ValueError(
            f"length={length} is too short for the {task} question and needle "
            f"({len(tokens)} tokens with the smallest document)"
        )
    return Sample(
        task=task,
        length=length,
        depth=depth,
        trial=trial,
        document=doc,
        question=question,
        answer=answer,
        key=key,
        needle=needle,
        tokens=tokens,
        needle_unit=i,
        n_units=n + (1 if place == "insert" else 0),
        filler=filler,
        phrasing=phrasing,
    )


def _chat_tokens(tokenizer, user_text: str) -> list[int]:
    return tokenizer.encode_chat(tokenizer.apply_chat_template([{"role": "user", "content": user_text}]))


def _estimate(tokenizer, units: Callable[[int], list[str]], length: int) -> int:
    """Units that make about ``length`` tokens, from the tokens of a sample of units."""
    probe = units(64)
    n_tok = len(tokenizer.encode(" ".join(probe), add_bos=False, parse_special=False))
    return max(1, int(length * len(probe) / max(n_tok, 1)))


def _fit(count: Callable[[int], int], length: int, n_min: int, estimate: int) -> int:
    """The largest n >= n_min with count(n) <= length (count is non-decreasing); n_min if none."""
    if count(n_min) > length:
        return n_min
    step = max(1, estimate // 64)
    n = max(estimate, n_min)
    if count(n) <= length:  # gallop up
        lo, hi = n, n + step
        while count(hi) <= length:
            lo, hi, step = hi, hi + step, step * 2
    else:  # gallop down
        hi, cand = n, n - step
        while cand > n_min and count(cand) > length:
            hi, step = cand, step * 2
            cand = hi - step
        lo = max(n_min, cand)
    while hi - lo > 1:  # count(lo) <= length < count(hi)
        mid = (lo + hi) // 2
        if count(mid) <= length:
            lo = mid
        else:
            hi = mid
    return lo


def _passkey_needle(rng: random.Random, phrasing: int):
    """(needle, (question, completion), answer) of a pass key of 5-7 digits."""
    n_digits = rng.randint(5, 7)
    key = str(rng.randint(10 ** (n_digits - 1), 10**n_digits - 1))
    needle, question, completion = (x.format(k=key) for x in PHRASINGS["passkey"][phrasing])
    return needle, (question, completion), key


def _needle_needle(rng: random.Random, phrasing: int):
    """(needle, (question, completion), key phrase) of a city's best activity."""
    city = rng.choice(CITIES)
    activity, key_phrase = rng.choice(ACTIVITIES)
    needle, question, completion = (x.format(city=city, activity=activity) for x in PHRASINGS["needle"][phrasing])
    return needle, (question, completion), key_phrase


_NEEDLES = {"passkey": _passkey_needle, "needle": _needle_needle}


def _passkey(rng: random.Random, length: int):
    needle, question, key = _passkey_needle(rng, 0)

    def units(n: int) -> list[str]:
        return [FILLER[i % len(FILLER)] for i in range(n)]

    return needle, question, key, "", units, " ".join, "insert"


def _needle(rng: random.Random, length: int):
    needle, question, key_phrase = _needle_needle(rng, 0)
    lines = source_lines()
    start = rng.randrange(len(lines) // 2)  # a different stretch of source for each trial

    def units(n: int) -> list[str]:
        if start + n > len(lines):
            raise ValueError(f"needle: not enough standard-library source for {n} lines")
        return list(lines[start : start + n])

    return needle, question, key_phrase, "", units, "\n".join, "insert"


def _kvretrieval(rng: random.Random, length: int):
    pool: list[tuple[str, str]] = []

    def units(n: int) -> list[str]:
        while len(pool) < n:
            pool.append((_uuid(rng), _uuid(rng)))
        return [f"{json.dumps(k)}: {json.dumps(v)}" for k, v in pool[:n]]

    key, value = _uuid(rng), _uuid(rng)
    needle = f"{json.dumps(key)}: {json.dumps(value)}"
    asked = f'What is the value of the key "{key}" in the JSON object above?'
    question = (f"{asked} Answer with the value only.", f'{asked} The value of the key "{key}" is "')
    units(1 + length // 60)  # draw the pool now: the pairs do not depend on how many are used

    def join(parts: list[str]) -> str:
        return "JSON data:\n{" + ", ".join(parts) + "}"

    return needle, question, value, key, units, join, "replace"


def _uuid(rng: random.Random) -> str:
    return str(uuid.UUID(int=rng.getrandbits(128), version=4))


# ---- scorers ----

_NUMBER = re.compile(r"\d{1,3}(?:,\d{3})+(?!\d)|\d+")
_UUID = re.compile(
    r"(?<![0-9a-f-])([0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12})(?![0-9a-f-])",
    re.IGNORECASE,
)


def first_number(reply: str) -> str | None:
    """The first number in ``reply`` with thousands separators removed ("1,234,567" -> "1234567")."""
    m = _NUMBER.search(reply)
    return m.group().replace(",", "") if m else None


def score_passkey(reply: str, answer: str) -> bool:
    """The reply's first number is exactly the pass key (extra words are fine; a partial or longer
    number is wrong; "12,345" reads as 12345)."""
    return first_number(reply) == answer


def score_needle(reply: str, key_phrase: str) -> bool:
    """The key phrase occurs in the reply as whole words, ignoring case, punctuation and spacing."""
    return f" {words_of(key_phrase)} " in f" {words_of(reply)} "




def uuids(reply: str) -> list[str]:
    """Whole UUIDs in ``reply``, lower-cased (a UUID inside a longer hex run does not count)."""
    return [m.group(1).lower() for m in _UUID.finditer(reply)]


def score_kvretrieval(reply: str, answer: str, key: str = "") -> bool:
    """The reply's first UUID other than the echoed ``key`` equals the value (case-insensitive; a
    truncated UUID is wrong)."""
    found = [u for u in uuids(reply) if u != key.lower()]
    return bool(found) and found[0] == answer.lower()


def score(task: str, reply: str, answer: str, key: str = "") -> bool:
    """Exact match of ``reply`` for ``task`` (see the score_* functions)."""
    if task == "passkey":
        return score_passkey(reply, answer)
    if task == "needle":
        return score_needle(reply, answer)
    if task == "kvretrieval":
        return score_kvretrieval(reply, answer, key)
    raise ValueError(f"task={task!r} is not allowed: one of {', '.join(TASKS)}")


def answer_complete(task: str, reply: str, answer: str, key: str = "") -> bool:
    """True once more reply text cannot change the score (generation may stop early).

    The reply is judged without its trailing run of characters that could still grow (digits and
    commas; letters and digits; hex digits and dashes): passkey needs a first number there, needle the
    key phrase, kvretrieval a whole UUID other than the key.
    """
    if task == "passkey":  # cut a trailing run that may still grow ("12,3" -> "12,345")
        return _NUMBER.search(re.sub(r"[\d,]+$", "", reply)) is not None
    if task == "needle":
        return score_needle(re.sub(r"[A-Za-z0-9]+$", "", reply), answer)
    if task == "kvretrieval":
        return any(u != key.lower() for u in uuids(re.sub(r"[0-9a-fA-F-]+$", "", reply)))
    raise ValueError(f"task={task!r} is not allowed: one of {', '.join(TASKS)}")
