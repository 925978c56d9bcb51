"""Natural text for long contexts, as token ids (``context_tokens``): the Python standard library's sources
(the text the presets were tuned on) and held-out kinds; ``ktquest bench`` and the tools in tools/ read it."""

from __future__ import annotations

import sysconfig
from pathlib import Path


def stdlib_text(min_chars: int) -> str:
    """Python standard-library sources, concatenated in a fixed order until ``min_chars`` are reached: the
    top-level modules (about 4.7M characters, 1.3M tokens), then, for longer texts, the sub-packages'
    (``package_text``), so every shorter text is a prefix of a longer one."""
    root = Path(sysconfig.get_paths()["stdlib"])
    parts, n = [], 0
    for path in sorted(root.glob("*.py")):
        text = path.read_text(encoding="utf-8", errors="replace")
        parts.append(text)
        n += len(text)
        if n >= min_chars:
            return "".join(parts)
    return "".join(parts) + package_text(min_chars - n)


# Texts of context_tokens: ``stdlib`` (the top-level standard-library modules: the text the presets were
# tuned on) and held-out kinds: ``packages`` (the standard library's sub-package sources, other code),
# ``prose``, ``narrative`` and ``json`` (ktquest.eval.fillers' haystacks).
TEXT_KINDS = ("stdlib", "packages", "prose", "narrative", "json")
HELD_OUT_TEXTS = TEXT_KINDS[1:]


def context_tokens(tokenizer, n_tokens: int, kind: str = "stdlib") -> list[int]:
    """Exactly ``n_tokens`` token ids of natural text of ``kind`` (TEXT_KINDS)."""
    if kind not in TEXT_KINDS:
        raise ValueError(f"text kind {kind!r} is not allowed: one of {', '.join(TEXT_KINDS)}")
    make = {"stdlib": stdlib_text, "packages": package_text}.get(kind, lambda n: filler_text(kind, n))
    text = make(n_tokens * 6)  # code is ~3-4 characters a token; 6 leaves room
    ids = tokenizer.encode(text, add_bos=False, parse_special=False)
    if len(ids) < n_tokens:
        ids = tokenizer.encode(make(n_tokens * 12), add_bos=False, parse_special=False)
    return ids[:n_tokens]


def package_text(min_chars: int) -> str:
    """The standard library's sub-package sources (not its tests), concatenated in a fixed order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    parts, n = [], 0
    for path in sorted(root.glob("*/*.py")):
        if path.parent.name.startswith(("test", "site-packages", "idlelib")):
            continue
        parts.append(path.read_text(encoding="utf-8", errors="replace"))
        n += len(parts[-1])
        if n >= min_chars:
            return "".join(parts)
    raise ValueError(f"only {n:,} characters of standard-library source found under {root}: not enough natural "
                     f"text for a context of this length")


def filler_text(kind: str, min_chars: int) -> str:
    """At least ``min_chars`` of one ``ktquest.eval.fillers`` haystack (a fixed draw)."""
    import random

    from ktquest.eval.fillers import haystack

    units, join = haystack(kind, random.Random(f"context:{kind}"))
    n = 256
    while len(text := join(units(n))) < min_chars:
        n *= 2
    return text
