"""Shared helpers of the tools: long natural text, JSON output, the peer engine."""

from __future__ import annotations

import json
import os
import sysconfig
from pathlib import Path

CONFIGS = Path(__file__).resolve().parent.parent / "configs"


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
    raise RuntimeError(f"only {n} characters of standard-library package source found under {root}")


def filler_text(kind: str, min_chars: int) -> str:
    """At least ``min_chars`` of one ``ktquest.eval.fillers`` haystack (a fixed draw)."""
    import random

    from ktquest.eval.fillers import haystack

    units, join = haystack(kind, random.Random(f"context:{kind}"))
    n = 256
    while len(text := join(units(n))) < min_chars:
        n *= 2
    return text


def mode_config(mode: str, known: dict[str, str | None]) -> str | None:
    """The config of a --modes entry: ``known[mode]`` (a path, or None for the defaults), else the preset
    ``configs/<mode>.yaml``. ValueError naming the known modes and presets when there is neither."""
    if mode in known:
        return known[mode]
    path = CONFIGS / f"{mode}.yaml"
    if not path.is_file():
        names = sorted(set(known) | {p.stem for p in CONFIGS.glob("*.yaml")})
        raise ValueError(f"--modes: unknown mode or preset {mode!r}; known: {', '.join(names)}")
    return os.fspath(path)


def variant_knobs(spec: str, config: str | None, overrides: list[str], cache):
    """``--variant NAME:KEY=VALUE[,KEY=VALUE]`` as (NAME, the cache's long_context knobs with those keys): the
    values checked as ``--set`` values are, the keys as decode-time knobs by ``retune`` on the still empty
    cache (ConfigError); a malformed spec or a key outside long_context is a ValueError."""
    import dataclasses

    from ktquest.config import load_config

    name, _, sets = spec.partition(":")
    if not name or not sets:
        raise ValueError(f"{spec!r}: expected NAME:KEY=VALUE[,KEY=VALUE]")
    keys = [kv if "." in kv.split("=", 1)[0] else f"long_context.{kv}" for kv in sets.split(",")]
    for kv in keys:
        if not kv.startswith("long_context."):
            raise ValueError(f"{spec!r}: {kv.split('=', 1)[0]} is not a long_context key")
    want = load_config(config, [*overrides, *keys]).long_context
    lc = dataclasses.replace(cache.lc, **{f.name: getattr(want, f.name) for f in dataclasses.fields(want)
                                          if getattr(want, f.name) != getattr(cache.lc, f.name)})
    cache.retune(cache.retune(lc))  # a key that cannot change is refused here
    return name, lc


def write_json(path: str | Path, rows) -> None:
    write_atomic(Path(path), json.dumps(rows, indent=2) + "\n")


def write_atomic(path: Path, text: str) -> None:
    """``path`` holds ``text`` or what it held before, never a part of it (a run killed mid-write: the queues
    skip a run whose JSON is there)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def llama_cpp():
    """The llama_cpp module, or None when llama-cpp-python is not installed."""
    try:
        import llama_cpp
    except ImportError:
        return None
    return llama_cpp
