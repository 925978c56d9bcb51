"""Haystacks for the retrieval tasks: kinds of filler text a needle is hidden in.

Each kind is a source of *units* (a line or a sentence) and the string that joins them:

- ``code``: lines of the Python standard-library sources (the needle task's classic haystack);
- ``prose``: the text of the Python Language Reference (``pydoc_data``, shipped with Python), Python's
  licence and the licences under /usr/share/common-licenses when the machine has them, line by line;
- ``narrative``: a story generated from the seed, sentence by sentence (people, places, small events);
- ``json``: JSON Lines records of a generated shop inventory (words and numbers below 1,000).

``haystack(kind, rng, avoid)`` returns ``units(n)``, the first n units of one haystack (``units(m)`` is a
prefix of ``units(n)`` for m < n, so a document can grow a unit at a time), and the joiner. A line source
starts at a point drawn from ``rng`` and wraps around. Units holding a run of 5 digits (a pass key's
shape) or any phrase of ``avoid`` (the needles' cities and answers, lower case) are never used, so the
needle is the only place that holds the answer.
"""

from __future__ import annotations

import functools
import json
import random
import re
from collections.abc import Callable
from pathlib import Path

KINDS = ("code", "prose", "narrative", "json")

_MAX_LINE = 100  # characters; longer lines are skipped so a unit stays small

Units = Callable[[int], list[str]]


def haystack(kind: str, rng: random.Random, avoid: tuple[str, ...] = ()) -> tuple[Units, Callable]:
    """(units, join) of one haystack of ``kind`` drawn from ``rng``: see the module docstring."""
    if kind in ("code", "prose"):
        lines = _clean(source_lines() if kind == "code" else _prose_lines(), avoid)
        start = rng.randrange(len(lines))

        def units(n: int) -> list[str]:
            return [lines[(start + i) % len(lines)] for i in range(n)]

        return units, "\n".join
    if kind in ("narrative", "json"):
        make = _story_sentence if kind == "narrative" else _inventory_record
        pool: list[str] = []

        def units(n: int) -> list[str]:
            while len(pool) < n:
                unit = make(rng)
                if _usable(unit, avoid):
                    pool.append(unit)
            return pool[:n]

        return units, (" ".join if kind == "narrative" else "\n".join)
    raise ValueError(f"filler kind {kind!r} is not allowed: one of {', '.join(KINDS)}")


@functools.lru_cache(maxsize=1)
def source_lines() -> tuple[str, ...]:
    """Non-empty lines (<= 100 characters, no run of 5 digits) of the Python standard-library sources,
    in a fixed order."""
    import sysconfig

    root = Path(sysconfig.get_paths()["stdlib"])
    out: list[str] = []
    for path in sorted(root.glob("*.py")):
        for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
            line = line.rstrip()
            if line and len(line) <= _MAX_LINE and not _has_digit_run(line):
                out.append(line)
        if len(out) >= 200_000:  # ~2M tokens
            break
    return tuple(out)


@functools.lru_cache(maxsize=1)
def _prose_lines() -> tuple[str, ...]:
    """Non-empty lines of the Language Reference (topics in name order), Python's LICENSE.txt, then the
    machine's common licences (each file once, in name order)."""
    import pydoc_data.topics
    import sysconfig

    texts = [pydoc_data.topics.topics[name] for name in sorted(pydoc_data.topics.topics)]
    licence = Path(sysconfig.get_paths()["stdlib"]) / "LICENSE.txt"
    files = [licence] if licence.is_file() else []
    common = Path("/usr/share/common-licenses")
    if common.is_dir():
        seen = set()
        for path in sorted(common.iterdir()):
            real = path.resolve()
            if real.is_file() and real not in seen:
                seen.add(real)
                files.append(real)
    texts += [p.read_text(encoding="utf-8", errors="replace") for p in files]
    return tuple(
        line.rstrip()
        for text in texts
        for line in text.splitlines()
        if line.strip() and len(line.rstrip()) <= _MAX_LINE and not _has_digit_run(line)
    )


@functools.lru_cache(maxsize=8)
def _clean(lines: tuple[str, ...], avoid: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(line for line in lines if _usable(line, avoid))


def _usable(unit: str, avoid: tuple[str, ...]) -> bool:
    if _has_digit_run(unit):
        return False
    words = f" {words_of(unit)} "
    return not any(f" {a} " in words for a in avoid)


def words_of(text: str) -> str:
    """Lower-case words and numbers of ``text`` joined by single spaces (punctuation dropped)."""
    return " ".join(re.findall(r"[a-z0-9]+", text.lower()))


def _has_digit_run(line: str) -> bool:
    return re.search(r"\d{5}", line) is not None


# ---- generated kinds ----

_NAMES = ("Mara", "Tobias", "Ines", "Oskar", "Lena", "Felix", "Nadia", "Hugo", "Clara", "Anton", "Rosa", "Emil")
_PLACES = ("the harbour", "the bakery", "the library", "the old bridge", "the train station", "the orchard",
           "the market square", "the school", "the river bank", "the workshop", "the post office", "the hill")
_THINGS = ("a red umbrella", "a letter", "a basket of apples", "an old map", "a wooden box", "a kite",
           "a small radio", "a notebook", "a bicycle", "a loaf of bread", "a blue scarf", "a key ring")
_EVENTS = (
    "{a} walked to {p} with {t}.",
    "At {p}, {a} met {b}, who was looking for {t}.",
    "{a} told {b} a long story about {p}.",
    "It started to rain, so {a} waited at {p} for a while.",
    "{b} laughed when {a} dropped {t} on the way to {p}.",
    "Later that day, {a} and {b} went back to {p}.",
    "Nobody at {p} had ever seen {t} like that before.",
    "{a} wrote a short note and left it at {p}.",
    "The evening was quiet, and {a} thought about {t}.",
    "{a} asked {b} whether {p} would be open the next morning.",
    "On the way home, {b} found {t} near {p}.",
    "{a} promised to bring {t} to {p} after lunch.",
)
_ITEMS = ("kettle", "lamp", "teapot", "chair", "rug", "mirror", "clock", "vase", "shelf", "basket", "jar", "stool")
_COLOURS = ("red", "blue", "green", "grey", "white", "black", "yellow", "brown")


def _story_sentence(rng: random.Random) -> str:
    a, b = rng.sample(_NAMES, 2)
    return rng.choice(_EVENTS).format(a=a, b=b, p=rng.choice(_PLACES), t=rng.choice(_THINGS))


def _inventory_record(rng: random.Random) -> str:
    return json.dumps({
        "item": f"{rng.choice(_COLOURS)} {rng.choice(_ITEMS)}",
        "shelf": f"{rng.choice('ABCDEFGH')}{rng.randint(1, 40)}",
        "count": rng.randint(0, 250),
        "price": round(rng.uniform(1, 300), 2),
        "in_stock": rng.random() < 0.8,
    })
